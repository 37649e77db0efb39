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
