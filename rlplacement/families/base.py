"""What a decoder family looks like to the converters: data, not code.

A family names its HF ``model_type`` values and two switches (per-head q/k norm, q/k/v bias); the
name tables below hold for every Llama-style dense model (Qwen2, Qwen3, Llama). A new family with
the same block layout is one small file that builds a :class:`DenseFamily`. A mixture-of-experts
family (:class:`MoEFamily`) replaces a sparse layer's MLP by a router and per-expert MLPs
(:data:`EXPERT_LAYER_NAMES`); attention and norms, and its dense layers, are the dense tables.

Megatron side names are suffixes of ``GPTModel`` parameters. Both layer specs map: the local spec
keeps separate norms (``input_layernorm``, ``pre_mlp_layernorm``) while TransformerEngine fuses them
into the following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Fused:
    """A Megatron tensor built from several HF tensors; ``kind`` is ``qkv`` or ``fc1``."""

    kind: str
    hf: tuple[str, ...]


# Megatron layer suffix -> HF layer suffix (a str) or a Fused group. "{i}" is the global layer index.
LAYER_NAMES: dict[str, str | Fused] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE spec
    "self_attention.linear_qkv.weight": Fused("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                      "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": Fused("qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias",
                                                    "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE spec
    "mlp.linear_fc1.weight": Fused("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
# Megatron suffix -> HF suffix of a sparse layer's MLP in a mixture-of-experts family (the rest of the layer is
# in LAYER_NAMES: a sparse layer keeps ``pre_mlp_layernorm`` apart in both specs, since the router reads it
# too); "{e}" is the global expert index. Experts are per-expert tensors in HF checkpoints (transformers fuses
# them in memory only) and megatron's sequential layout (``local_experts.{e}``, renumbered from local to
# global by the stream).
EXPERT_LAYER_NAMES: dict[str, str | Fused] = {
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.experts.local_experts.{e}.linear_fc1.weight": Fused("fc1", ("mlp.experts.{e}.gate_proj.weight",
                                                                      "mlp.experts.{e}.up_proj.weight")),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": "mlp.experts.{e}.down_proj.weight",
}
GLOBAL_NAMES: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
MEGATRON_LAYER_PREFIX = "decoder.layers.{i}."
HF_LAYER_PREFIX = "model.layers.{i}."
# HF names whose rows index the vocabulary (padded on the Megatron side).
VOCAB_HF_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class DenseFamily:
    """A Llama-style dense decoder. ``qkv_bias=None`` reads HF ``attention_bias``."""

    name: str
    model_types: tuple[str, ...]
    qk_norm: bool
    qkv_bias: bool | None
    layer_names: dict[str, str | Fused] = dataclasses.field(default_factory=lambda: dict(LAYER_NAMES))
    global_names: dict[str, str] = dataclasses.field(default_factory=lambda: dict(GLOBAL_NAMES))

    def uses_qkv_bias(self, hf_config: Any) -> bool:
        if self.qkv_bias is None:
            return bool(getattr(hf_config, "attention_bias", False))
        return self.qkv_bias

    moe = False
    """Whether the family has experts (:class:`MoEFamily`)."""

    @staticmethod
    def checkpoint_views(name: str, tensor: Any, first_expert: int = 0) -> list[tuple[str, Any]]:
        """A parameter of transformers' model as the checkpoint's tensors: a dense model's are the same."""
        return [(name, tensor)]

    @staticmethod
    def holds_experts(name: str) -> bool:
        """Whether a parameter is a sparse layer's fused experts: a dense model has none."""
        return False

    def check(self, hf_config: Any, source: str = "config.json") -> None:
        """Refuse features the converters do not implement, naming the config field."""
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError(f"{source}: mlp_bias=true is not supported for {self.name}")
        if not self.moe and num_experts(hf_config):
            raise ValueError(f"{source}: model_type {self.name!r} with experts is not a model rlplacement knows; "
                             f"the mixture-of-experts family it knows is qwen3_moe")
        if getattr(hf_config, "use_sliding_window", False):
            raise ValueError(f"{source}: use_sliding_window=true is not supported; set it to false")
        rope = rope_parameters(hf_config)
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"{source}: rope type {kind!r} is not supported (only default RoPE)")
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {hf_config.hidden_act!r} is not supported (silu only)")


@dataclasses.dataclass(frozen=True)
class MoEFamily(DenseFamily):
    """A Llama-style decoder whose sparse layers route each token to ``num_experts_per_tok`` of
    ``num_experts`` gated MLPs of ``moe_intermediate_size`` (Qwen3-MoE): which layers are sparse is
    :meth:`sparse_layers`; no shared expert."""

    expert_layer_names: dict[str, str | Fused] = dataclasses.field(default_factory=lambda: dict(EXPERT_LAYER_NAMES))
    moe = True

    def check(self, hf_config: Any, source: str = "config.json") -> None:
        super().check(hf_config, source)
        experts = num_experts(hf_config)
        if not experts:
            raise ValueError(f"{source}: model_type {self.name!r} needs num_experts (the experts per sparse layer)")
        topk = getattr(hf_config, "num_experts_per_tok", None)
        if not topk or not 1 <= topk <= experts:
            raise ValueError(f"{source}: num_experts_per_tok {topk!r} must be between 1 and num_experts {experts}")
        for key in ("shared_expert_intermediate_size", "n_shared_experts"):
            if getattr(hf_config, key, None):
                raise ValueError(f"{source}: {key} is set: shared experts are not supported for {self.name}")
        if not any(self.sparse_layers(hf_config)):
            raise ValueError(f"{source}: no layer is sparse (decoder_sparse_step and mlp_only_layers leave every "
                             f"layer dense): use the dense family of this model")

    @staticmethod
    def holds_experts(name: str) -> bool:
        """Whether a parameter of transformers' model is a sparse layer's fused experts (``mlp.experts.gate_up_proj``
        or ``mlp.experts.down_proj``), which checkpoints store per expert."""
        prefix, found, last = name.rpartition("mlp.experts.")
        return bool(found) and last in ("gate_up_proj", "down_proj")

    @classmethod
    def checkpoint_views(cls, name: str, tensor: Any, first_expert: int = 0) -> list[tuple[str, Any]]:
        """A parameter of transformers' model as the checkpoint's tensors, copying nothing: transformers 5
        holds a sparse layer's experts fused, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's
        gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, where checkpoints (and
        vLLM's loaders, and an engine's update) name them per expert, ``mlp.experts.{e}.gate_proj.weight``
        and so on; each is a contiguous view of the fused parameter. ``first_expert``: the global index of
        ``tensor``'s first expert (a shard of the experts). Any other parameter is itself."""
        if not cls.holds_experts(name):
            return [(name, tensor)]
        prefix, _, last = name.rpartition("mlp.experts.")
        out = []
        for e in range(tensor.shape[0]):
            base = f"{prefix}mlp.experts.{e + first_expert}."
            if last == "down_proj":
                out.append((base + "down_proj.weight", tensor[e]))
            else:
                gate, up = tensor[e].chunk(2, dim=0)
                out += [(base + "gate_proj.weight", gate), (base + "up_proj.weight", up)]
        return out

    @staticmethod
    def sparse_layers(hf_config: Any) -> list[bool]:
        """Per layer, whether its MLP is the experts: HF's rule, layer i is sparse when it is not in
        ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``."""
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        return [i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers)]


def num_experts(hf_config: Any) -> int:
    """Experts per sparse layer (``num_experts``; ``num_local_experts`` as transformers 5 writes it, and
    Mixtral; ``n_routed_experts``, DeepSeek and GLM); 0 for a dense model."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(hf_config, key, None):
            return int(getattr(hf_config, key))
    return 0


def rope_parameters(hf_config: Any) -> dict:
    """RoPE settings across transformers versions (5.x moved ``rope_theta`` into ``rope_parameters``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and not params:
        params = dict(scaling)
    if "rope_theta" not in params and getattr(hf_config, "rope_theta", None) is not None:
        params["rope_theta"] = hf_config.rope_theta
    return params


def head_dim(hf_config: Any) -> int:
    explicit = getattr(hf_config, "head_dim", None)
    return int(explicit) if explicit else hf_config.hidden_size // hf_config.num_attention_heads
