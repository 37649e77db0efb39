"""The HF-named tensors a decoder serves, from its ``config.json`` alone (no weights, no torch).

Each tensor carries the *kind* that decides how both sides shard it: ``q``/``k``/``v`` (rows by
attention head, the weight and the bias), ``column`` (rows split: ``gate_proj``, ``up_proj``), ``row``
(columns split: ``o_proj``, ``down_proj``), ``vocab`` (rows by vocabulary: ``embed_tokens``,
``lm_head``) and ``replicated`` (norms), and its decoder layer (None for the embedding, the final
norm and the head). A mixture-of-experts model's sparse layers hold a router (``mlp.gate``, replicated)
and per-expert ``gate_proj``/``up_proj`` (``column``) and ``down_proj`` (``row``): each expert is sharded
over TP as a dense MLP is (vLLM's fused-MoE loader and megatron's experts at the dense TP alike).
"""

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any

from rlplacement.transfer.plan.boxes import Box, along, whole

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    kind: str
    layer: int | None

    def bytes(self, itemsize: int) -> int:
        n = itemsize
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class ModelTensors:
    """A model's served tensors and the sizes the sharding rules need."""

    tensors: tuple[TensorInfo, ...]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    ffn_hidden_size: int
    vocab_size: int
    itemsize: int
    source: str = "config.json"
    expert_ffn_hidden_size: int = 0
    """Each expert's intermediate size (0: a dense model)."""

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str, source: str | None = None,
                       dtype: str | None = None) -> "ModelTensors":
        """From a ``config.json`` (a path or its parsed dict); ``dtype`` the served dtype (default: the
        config's ``torch_dtype``/``dtype``, else bfloat16). A model the families refuse is refused here
        too, naming the field."""
        from rlplacement.families import family_for, head_dim

        if isinstance(config, str):
            source = source or config
            with open(config) as f:
                config = json.load(f)
        source = source or "config.json"
        cfg = types.SimpleNamespace(**config)
        family = family_for(cfg, source)
        from rlplacement.families import num_experts

        sparse = family.sparse_layers(cfg) if family.moe else [False] * cfg.num_hidden_layers
        experts, expert_inter = (num_experts(cfg), cfg.moe_intermediate_size) if family.moe else (0, 0)
        dtype = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{source}: dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        hd, hidden = head_dim(cfg), cfg.hidden_size
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        inter = cfg.intermediate_size
        bias = family.uses_qkv_bias(cfg)
        out: list[TensorInfo] = [TensorInfo("model.embed_tokens.weight", (cfg.vocab_size, hidden), "vocab", None)]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = [("input_layernorm.weight", (hidden,), "replicated"),
                     ("self_attn.q_proj.weight", (heads * hd, hidden), "q"),
                     ("self_attn.k_proj.weight", (kv * hd, hidden), "k"),
                     ("self_attn.v_proj.weight", (kv * hd, hidden), "v")]
            if bias:
                layer += [("self_attn.q_proj.bias", (heads * hd,), "q"), ("self_attn.k_proj.bias", (kv * hd,), "k"),
                          ("self_attn.v_proj.bias", (kv * hd,), "v")]
            if family.qk_norm:
                layer += [("self_attn.q_norm.weight", (hd,), "replicated"),
                          ("self_attn.k_norm.weight", (hd,), "replicated")]
            layer += [("self_attn.o_proj.weight", (hidden, heads * hd), "row"),
                      ("post_attention_layernorm.weight", (hidden,), "replicated")]
            if sparse[i]:
                layer.append(("mlp.gate.weight", (experts, hidden), "replicated"))
                for e in range(experts):
                    layer += [(f"mlp.experts.{e}.gate_proj.weight", (expert_inter, hidden), "column"),
                              (f"mlp.experts.{e}.up_proj.weight", (expert_inter, hidden), "column"),
                              (f"mlp.experts.{e}.down_proj.weight", (hidden, expert_inter), "row")]
            else:
                layer += [("mlp.gate_proj.weight", (inter, hidden), "column"),
                          ("mlp.up_proj.weight", (inter, hidden), "column"),
                          ("mlp.down_proj.weight", (hidden, inter), "row")]
            out += [TensorInfo(p + n, shape, kind, i) for n, shape, kind in layer]
        out.append(TensorInfo("model.norm.weight", (hidden,), "replicated", None))
        if not config.get("tie_word_embeddings", False):
            out.append(TensorInfo("lm_head.weight", (cfg.vocab_size, hidden), "vocab", None))
        return cls(tuple(out), cfg.num_hidden_layers, heads, kv, hd, hidden, inter, cfg.vocab_size,
                   DTYPE_BYTES[dtype], source, expert_inter)

    @property
    def total_bytes(self) -> int:
        return sum(t.bytes(self.itemsize) for t in self.tensors)

    def tp_box(self, t: TensorInfo, rank: int, tp: int, padded_vocab: int) -> Box:
        """Rank ``rank`` of ``tp``'s slice of ``t`` under the tensor-parallel rules Megatron and vLLM share:
        q by head; k/v by KV head (with more ranks than KV heads, KV head ``rank // (tp / KV)``, replicated:
        vLLM's rule; Megatron refuses such a width); ``column`` by rows; ``row`` by columns; ``vocab`` rows
        of the vocabulary padded to ``padded_vocab`` (each side pads its own way), split evenly; the rest
        whole. A shard past the real vocabulary is empty (volume 0)."""
        hd = self.head_size
        if t.kind in ("k", "v") and tp >= self.num_kv_heads:
            head = rank // (tp // self.num_kv_heads)
            return along(t.shape, 0, head * hd, (head + 1) * hd)
        per, dim = {"q": (self.num_heads // tp * hd, 0), "k": (self.num_kv_heads // tp * hd, 0),
                    "v": (self.num_kv_heads // tp * hd, 0), "column": (t.shape[0] // tp, 0),
                    "row": (t.shape[-1] // tp, 1), "vocab": (padded_vocab // tp, 0)}.get(t.kind, (None, None))
        if per is None:
            return whole(t.shape)
        return along(t.shape, dim, rank * per, (rank + 1) * per)

    def stage_of(self, t: TensorInfo, pp: int) -> int:
        """The pipeline stage holding ``t`` under Megatron's even split: the embedding on the first, the
        final norm and the head on the last."""
        if t.layer is not None:
            return t.layer // (self.num_layers // pp)
        return 0 if t.name == "model.embed_tokens.weight" else pp - 1
