"""The few ``torch.cuda`` calls megatron-core makes unconditionally, made to work on a CPU-only host.

Applied by :func:`apply_cpu_shims` only when CUDA is absent (never on a GPU machine, where the real
calls must run), and undone by :func:`remove_cpu_shims` when the Megatron work ends (backend
``close``, end of a conversion), so other code in the same process (a vLLM CPU engine, other tests)
sees the real ``torch.cuda``. Invariant: every shim is a no-op stand-in or maps the CUDA RNG onto the CPU RNG,
so CPU runs are deterministic for a seed; nothing here changes numerics of a forward or backward.
Megatron calls: ``torch.cuda.current_device()`` (device placement), ``Tensor.cuda()`` (moving
buffers), ``torch.cuda.synchronize()`` (timers, checkpoint saves), and the CUDA RNG state get/set,
both in ``torch.cuda`` and in ``megatron.core.tensor_parallel.random`` (the TP RNG tracker).
"""

from __future__ import annotations

import torch

_APPLIED = False
_ORIGINALS: list[tuple[object, str, object]] = []


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> bool:
    """Patch the CUDA entry points megatron-core needs; return whether anything was patched."""
    global _APPLIED
    if _APPLIED or not cuda_absent():
        return _APPLIED
    from megatron.core.tensor_parallel import random as tp_random

    patches = [
        (torch.cuda, "current_device", lambda: torch.device("cpu")),  # used as a device= argument
        (torch.cuda, "synchronize", lambda *a, **k: None),
        (torch.Tensor, "cuda", lambda self, *a, **k: self),
        (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        (torch.cuda, "manual_seed", lambda seed: None),  # the CPU generator is seeded by the caller
        (torch.cuda, "manual_seed_all", lambda seed: None),
        (tp_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        (tp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
    ]
    for owner, attr, shim in patches:
        _ORIGINALS.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, shim)
    _APPLIED = True
    return True


def remove_cpu_shims() -> None:
    """Put back every original patched by :func:`apply_cpu_shims` (no-op if none)."""
    global _APPLIED
    while _ORIGINALS:
        owner, attr, original = _ORIGINALS.pop()
        setattr(owner, attr, original)
    _APPLIED = False
