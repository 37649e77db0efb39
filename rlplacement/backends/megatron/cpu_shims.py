"""The few ``torch.cuda`` calls megatron-core makes unconditionally, made to work on a CPU-only host.

Applied by :func:`apply_cpu_shims` only when CUDA is absent (never on a GPU machine, where the real
calls must run), and undone by :func:`remove_cpu_shims` when the Megatron work ends (backend
``close``, end of a conversion), so other code in the same process (a vLLM CPU engine, other tests)
sees the real ``torch.cuda``. Invariant: every shim is a no-op stand-in or maps the CUDA RNG onto the CPU RNG,
so CPU runs are deterministic for a seed; nothing here changes numerics of a forward or backward.
Megatron calls: ``torch.cuda.current_device()`` (device placement), ``Tensor.cuda()`` (moving
buffers), ``torch.cuda.synchronize()`` (timers, checkpoint saves), and the CUDA RNG state get/set,
both in ``torch.cuda`` and in ``megatron.core.tensor_parallel.random`` (the TP RNG tracker).

Megatron's training machinery (DDP, its optimizers, the pipeline schedules) hard-codes CUDA in more
places; those get shims scoped to the megatron modules that need them, never to ``torch`` itself:
- inside the modules of :data:`CUDA_NAMING_MODULES`, the global name ``torch`` is a proxy whose tensor
  factories put ``device="cuda"`` (or a device index) on the CPU and whose ``torch.cuda`` has no-op
  streams, events and synchronisation (e.g. ``torch.tensor([0.0], device="cuda")`` in
  ``optimizer/optimizer.py``'s mixed-precision set-up, ``clip_grads.py``'s norms,
  ``pipeline_parallel/schedules.py``'s token counts, ``utils.py``'s l2 norm without apex);
- the functions of :data:`CUDA_TYPE_CHECKS` compare ``Tensor.type()`` with ``'torch.cuda.*Tensor'``
  (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``, ``clip_grad_by_total_norm_fp32``):
  while one runs, a CPU tensor's ``type()`` answers with the CUDA name of the same dtype.
- the MoE all-to-all dispatcher (``moe.token_dispatcher``) takes its split sizes as numpy where a GPU
  run would have copied them to the host (:func:`_splits_as_numpy`).
gloo runs every collective they issue (reduce-scatter, all-gather into tensors and the dispatcher's uneven
``all_to_all_single`` included).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import types

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
    for name in CUDA_NAMING_MODULES:
        patches.append((importlib.import_module(name), "torch", _CPU_TORCH))
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    patches.append((dispatcher, "maybe_move_tensor_to_cpu", _splits_as_numpy(dispatcher.maybe_move_tensor_to_cpu)))
    for module, qualname in CUDA_TYPE_CHECKS:
        owner = importlib.import_module(module)
        *path, attr = qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        patches.append((owner, attr, _answering_cuda_type_names(getattr(owner, attr))))
    for owner, attr, shim in patches:
        _ORIGINALS.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, shim)
    _APPLIED = True
    return True


_TE_NAMES_MOE_UTILS_READS = ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss",
                             "fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                             "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
                             "fused_unpermute")


def define_missing_te_names() -> None:
    """megatron-core 0.16's ``moe_utils`` imports TransformerEngine's fused MoE functions in a ``try`` and,
    without TE, leaves them undefined, though its router gating tests ``te_general_gemm is not None``
    (a ``NameError`` on every MoE forward without TE, CPU or GPU). Define the absent ones as None, the
    value that code expects for "no TE"; names TE did import are left alone."""
    from megatron.core.transformer.moe import moe_utils

    for name in _TE_NAMES_MOE_UTILS_READS:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def remove_cpu_shims() -> None:
    """Put back every original patched by :func:`apply_cpu_shims` (no-op if none)."""
    global _APPLIED
    while _ORIGINALS:
        owner, attr, original = _ORIGINALS.pop()
        setattr(owner, attr, original)
    _APPLIED = False


CUDA_NAMING_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.utils",
    "megatron.core.transformer.moe.token_dispatcher",  # the all-to-all dispatcher's device-to-host stream
    "megatron.core.transformer.moe.moe_utils",  # the auxiliary-loss tracker's ``device="cuda"``
)
"""megatron modules that create tensors on ``"cuda"`` or use CUDA streams and events unconditionally."""

CUDA_TYPE_CHECKS = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
    ("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),  # imported there by name
)
"""megatron functions that accept only tensors whose ``type()`` names a CUDA tensor type."""

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")


def _on_cpu(device):
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")) or (
            isinstance(device, torch.device) and device.type == "cuda"):
        return "cpu"
    return device


class _NoOp:
    """A CUDA stream or event: every method does nothing; usable as a context manager."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoOp()  # an event recorded on a stream is one too

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def query(self) -> bool:
        return True


class _CpuCuda(types.SimpleNamespace):
    def __getattr__(self, name):  # anything not stood in: the real torch.cuda (is_available, ...)
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as the modules of :data:`CUDA_NAMING_MODULES` see it on a CPU host."""

    _cuda = _CpuCuda(current_device=lambda: "cpu", synchronize=lambda *a, **k: None,
                     empty_cache=lambda *a, **k: None, Stream=_NoOp, Event=_NoOp,
                     stream=lambda *a, **k: contextlib.nullcontext(), default_stream=lambda *a, **k: _NoOp(),
                     current_stream=lambda *a, **k: _NoOp())

    def __getattr__(self, name):
        if name == "cuda":
            return self._cuda
        obj = getattr(torch, name)
        if name not in _FACTORIES:
            return obj

        @functools.wraps(obj)
        def on_cpu(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _on_cpu(kwargs["device"])
            return obj(*args, **kwargs)
        return on_cpu


_CPU_TORCH = _CpuTorch("torch")


def _splits_as_numpy(move):
    """megatron's ``maybe_move_tensor_to_cpu`` for the all-to-all dispatcher: it turns the split sizes into
    numpy only when they were on a GPU, and ``all_to_all_single`` refuses split sizes given as a tensor;
    on a CPU host they are CPU tensors already, so ``as_numpy`` converts them here."""

    @functools.wraps(move)
    def moved(tensor, as_numpy: bool = False, record_stream: bool = False):
        out = move(tensor, as_numpy=as_numpy, record_stream=record_stream)
        return out.numpy() if as_numpy and torch.is_tensor(out) else out
    return moved
_TENSOR_TYPE = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    if args or kwargs or self.is_cuda:
        return _TENSOR_TYPE(self, *args, **kwargs)
    return _TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)


def _answering_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        torch.Tensor.type = _cuda_type_name
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = _TENSOR_TYPE
    return wrapped
