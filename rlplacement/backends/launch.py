"""Starting torch.distributed: from explicit (rank, world, address, port), from torchrun's environment,
or by spawning local worker processes (gloo on CPU) for the CLI and multi-rank tests.

Workers are never forked from the caller (fork is unsafe once torch threads exist). On a machine without
CUDA they come from a fork server (``multiprocessing``'s ``forkserver``) that imported torch, megatron-core
and transformers once (:data:`PRELOAD`) and has run nothing since, so a worker starts in milliseconds
instead of re-importing them for seconds; each worker then takes the caller's environment, working
directory and ``sys.path`` as they are at the call, as a spawned one would. With CUDA they are spawned
(the fork server's imports must not touch a GPU driver its children would inherit). A worker's exception
is sent back and re-raised in the parent with the rank, so a failed rank cannot turn into a hang of the
caller: the parent waits with a timeout and terminates the rest.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlplacement.rendezvous import host_store, join_store


def free_port() -> int:
    """A port free now, for a program that must be given a number; it can be taken before that
    program binds it, so prefer a ``rendezvous.host_store`` wherever torch.distributed is the user."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                     backend: str | None = None, timeout_s: float = 600.0, store: Any = None) -> None:
    """Initialise the default process group unless it already is (then the sizes must agree).

    With ``store`` (a ``rendezvous`` store this rank hosts or joined) the address is not used:
    that is how a caller avoids binding a port picked earlier, which another process may have taken.
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"torch.distributed already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not {rank} of {world_size}")
        return
    backend = backend or default_backend()
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=timeout)


def init_single_process(backend: str | None = None) -> None:
    """A world of one in this process (a CLI or a test with no launcher), on a store it hosts."""
    if not dist.is_initialized():
        store, _ = host_store("127.0.0.1", 1, 600.0)
        init_distributed(0, 1, backend=backend, store=store)


def init_from_env(backend: str | None = None) -> tuple[int, int]:
    """Initialise from torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; return (rank, world)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_distributed(rank, world, os.environ.get("MASTER_ADDR", "127.0.0.1"),
                     int(os.environ.get("MASTER_PORT", 29500)), backend)
    return rank, world


PRELOAD = ("torch", "torch.distributed", "rlplacement.backends.launch", "transformers", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel")
"""What the fork server imports once before any worker (a module that is not installed is skipped)."""


def _context():
    """``forkserver`` preloaded with :data:`PRELOAD` where there is no CUDA, else ``spawn``."""
    import multiprocessing as mp

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first call of a process
    return ctx


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue, timeout_s: float,
            caller: tuple[dict, str, list] | None = None) -> None:
    if caller is not None:  # a fork server's child: the caller's environment, not the server's
        env, cwd, path = caller
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
    try:
        init_distributed(rank, world, backend="gloo", store=join_store("127.0.0.1", port, world, timeout_s))
        result = fn(rank, world, *args)
        # plain pickle copies tensor bytes; the queue's own pickler would pass shared-memory handles
        # that die with this process before the parent opens them
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent with the rank
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (a module-level function). Raises RuntimeError with the failing rank's
    traceback if any rank fails or the run exceeds ``timeout_s``.
    """
    import queue as queue_mod

    ctx = _context()
    caller = (dict(os.environ), os.getcwd(), list(sys.path)) if ctx.get_start_method() == "forkserver" else None
    results: dict[int, Any] = {}
    q = ctx.Queue()
    store, port = host_store("127.0.0.1", world_size, timeout_s)  # held here until every rank is done
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, q, timeout_s, caller), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        while len(results) < world_size:
            try:
                rank, ok, payload = q.get(timeout=timeout_s)
            except queue_mod.Empty:
                raise RuntimeError(f"distributed run of {fn.__name__} timed out after {timeout_s} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [results[r] for r in range(world_size)]
