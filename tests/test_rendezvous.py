"""Rendezvous ports are held from the moment they are handed out (CI once lost one to EADDRINUSE)."""

import errno
import socket

import pytest
import torch.distributed as dist

from rlplacement.backends import launch
from rlplacement.runtime.trainer_worker import TrainerWorker


def _bind(host: str, port: int) -> None:
    with socket.socket() as s:
        s.bind((host, port))


def test_trainer_address_holds_its_port_until_setup():
    worker = TrainerWorker(0, 2)
    host, port = worker.address(timeout_s=30)
    with pytest.raises(OSError) as err:
        _bind(host, port)
    assert err.value.errno == errno.EADDRINUSE


def _world(rank: int, world: int) -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def test_spawned_ranks_join_the_store_their_parent_holds():
    assert launch.spawn(_world, 2, timeout_s=120) == [(0, 2), (1, 2)]


def _caller_state(rank: int, world: int) -> tuple:
    import os
    import sys

    return os.environ.get("RLPLACEMENT_SPAWN_PROBE"), os.getcwd(), sys.path[:2], "megatron.core" in sys.modules


def test_workers_take_the_callers_environment_directory_and_path_at_each_call(tmp_path, monkeypatch):
    """Workers come from a fork server started at the first call (no CUDA here): what the caller set after
    that still reaches every worker, as with a spawned one; the server's imports came with it."""
    import os
    import sys

    launch.spawn(_world, 2, timeout_s=120)  # the server is up (this process may have started it earlier)
    monkeypatch.setenv("RLPLACEMENT_SPAWN_PROBE", "after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    got = launch.spawn(_caller_state, 2, timeout_s=120)
    assert got == [("after the server started", os.fspath(tmp_path), sys.path[:2], True)] * 2
    assert launch._context().get_start_method() == "forkserver"
