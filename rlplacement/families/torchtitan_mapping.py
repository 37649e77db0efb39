"""HF <-> torchtitan for the dense families torchtitan has a model for: parameter names and the
q/k row layout. Torch-free to import (tensors are only reshaped, by their own methods), so
preflight reads :data:`FAMILIES` and :data:`NEEDS_CUDA` without loading torch or torchtitan.

Layouts: q/k/v stay unfused and gate/up are ``w1``/``w3`` (``w2`` = down), so names map one to one.
Llama in torchtitan uses interleaved (complex) RoPE, so its q/k rows are permuted per head on
HF -> torchtitan and back; Qwen3 uses rotate-half (``CosSinRoPE``) like HF and maps unpermuted.
The name table is checked against torchtitan's own ``state_dict_adapter.from_hf_map`` in the tests.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from rlplacement.families import family_for

if TYPE_CHECKING:
    import torch

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


def permute_for_interleaved_rope(w: "torch.Tensor", n_heads: int) -> "torch.Tensor":
    """HF rotate-half q/k rows -> interleaved pairs per head (Llama in torchtitan): row ``i`` of a
    head's second half lands next to row ``i`` of its first half."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def unpermute_from_interleaved_rope(w: "torch.Tensor", n_heads: int) -> "torch.Tensor":
    """Inverse of :func:`permute_for_interleaved_rope` (torchtitan -> HF)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rope_heads(tt_name: str, hf_config: Any) -> int | None:
    """Heads to (un)permute for a Llama q/k weight, else None."""
    if family_for(hf_config).name != "llama":
        return None
    if tt_name.endswith("qkv_linear.wq.weight"):
        return hf_config.num_attention_heads
    if tt_name.endswith("qkv_linear.wk.weight"):
        return getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return None


def rope_head_rows(tt_name: str, hf_config: Any) -> int | None:
    """Rows of one head of a torchtitan weight whose rows are permuted per head against HF's (a Llama q/k
    weight: interleaved rotary pairs); None for any other weight, which is HF's layout as it is."""
    if _rope_heads(tt_name, hf_config) is None:
        return None
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def torchtitan_rows_to_hf(tt_name: str, rows: "torch.Tensor", hf_config: Any) -> "torch.Tensor":
    """Rows of a torchtitan weight in HF's layout: whole heads (:func:`rope_head_rows`), or any rows of a
    weight laid out alike; the same rows of the HF tensor."""
    per_head = rope_head_rows(tt_name, hf_config)
    return rows if per_head is None else unpermute_from_interleaved_rope(rows, rows.shape[0] // per_head)


def hf_to_torchtitan_tensor(tt_name: str, hf_tensor: "torch.Tensor", hf_config: Any) -> "torch.Tensor":
    heads = _rope_heads(tt_name, hf_config)
    return permute_for_interleaved_rope(hf_tensor, heads) if heads else hf_tensor


def torchtitan_to_hf_tensor(tt_name: str, tensor: "torch.Tensor", hf_config: Any) -> "torch.Tensor":
    heads = _rope_heads(tt_name, hf_config)
    return unpermute_from_interleaved_rope(tensor, heads) if heads else tensor
