"""Running a collective conversion function from a CLI: under torchrun, in-process, or spawned.

Under torchrun (``WORLD_SIZE`` set) the current process is one rank. Otherwise a single-rank job runs
in this process and a multi-rank one spawns ``world_size`` local gloo processes. The caller must be
under an ``if __name__ == "__main__":`` guard: dist_checkpointing's save starts a spawn-context
manager that re-imports the main module.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch.distributed as dist

from rlplacement.backends import launch


def run_collective(fn: Callable[..., Any], world_size: int, *args: Any) -> Any:
    """Run ``fn(rank, world_size, *args)`` on every rank; return rank 0's result."""
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        rank, world = launch.init_from_env()
        if world != world_size:
            raise ValueError(f"torchrun started {world} processes but the model needs {world_size} "
                             f"(--tensor-model-parallel-size x --pipeline-model-parallel-size)")
        return fn(rank, world, *args)
    if world_size == 1 and not dist.is_initialized():
        launch.init_single_process("gloo")
        try:
            return fn(0, 1, *args)
        finally:
            _teardown()
    return launch.spawn(fn, world_size, *args)[0]


def _teardown() -> None:
    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        from rlplacement.backends.megatron.cpu_shims import remove_cpu_shims

        remove_cpu_shims()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
