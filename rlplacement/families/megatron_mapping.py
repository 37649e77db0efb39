"""Megatron GPT parameters <-> Hugging Face tensors: rename, fuse/un-fuse, vocabulary padding, TP shards.

Pure tensor code with no megatron import, so the converters, the Megatron backend and the GPU
check share it and it is tested on CPU; torch is imported only by the functions that build
tensors, so names and shapes are read without it. Every function is a lossless copy: HF -> Megatron -> HF returns the same
bytes. Layouts (Megatron's, which its checkpoints and TP sharding rely on):

- ``linear_qkv``: rows grouped by query group, ``[groups, q_per_group + 2, head_dim, ...]``: the group's
  q heads, then its k head, then its v head. TP shards hold whole groups (contiguous row chunks).
- ``linear_fc1``: ``[gate; up]`` for the full tensor, but TP rank r holds ``[gate_r; up_r]``, so the
  rank chunks of a gathered fc1 interleave and must be regrouped (:func:`tp_unshard`).
- vocabulary rows (embedding, output layer) are padded with zeros to :func:`padded_vocab_size`.
- experts (sequential layout, ``mlp.experts.local_experts.{e}``): named here by their global expert index
  ``e`` (:func:`global_expert_name` renumbers a rank's local ones); each expert's ``linear_fc1`` and
  ``linear_fc2`` shard over TP as the dense ones do; the router is replicated.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Callable, Iterator

from rlplacement.families.base import (HF_LAYER_PREFIX, MEGATRON_LAYER_PREFIX, VOCAB_HF_NAMES, DenseFamily, Fused,
                                       head_dim)

if TYPE_CHECKING:
    import torch

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_EXPERT_IN_NAME = re.compile(r"^(.*?mlp\.experts\.local_experts\.)(\d+)(\..+)$")
VOCAB_MEGATRON_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes the mappings need, read once from an HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    tied: bool

    @classmethod
    def from_hf(cls, hf_config: Any, padded_vocab: int) -> "ModelShape":
        return cls(hf_config.num_hidden_layers, hf_config.hidden_size, hf_config.num_attention_heads,
                   getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                   head_dim(hf_config), hf_config.vocab_size, padded_vocab,
                   bool(getattr(hf_config, "tie_word_embeddings", False)))

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_query_groups


def _split_layer(mname: str) -> tuple[int | None, str]:
    m = _LAYER_RE.match(mname)
    return (int(m.group(1)), m.group(2)) if m else (None, mname)


def hf_sources(mname: str, family: DenseFamily) -> str | Fused:
    """HF name (or fused group of HF names) behind a Megatron parameter name with a global layer index."""
    layer, suffix = _split_layer(mname)
    if layer is None:
        if suffix not in family.global_names:
            raise KeyError(f"no HF mapping for Megatron parameter {mname!r} ({family.name})")
        return family.global_names[suffix]
    prefix = HF_LAYER_PREFIX.format(i=layer)
    target = family.layer_names.get(suffix)
    if target is None and family.moe:
        expert = _EXPERT_RE.match(suffix)
        key = f"{expert.group(1)}{{e}}{expert.group(3)}" if expert else suffix
        target = family.expert_layer_names.get(key)
        if target is not None and expert:
            e = expert.group(2)
            target = (Fused(target.kind, tuple(n.format(e=e) for n in target.hf)) if isinstance(target, Fused)
                      else target.format(e=e))
    if target is None:
        raise KeyError(f"no HF mapping for Megatron parameter {mname!r} ({family.name})")
    if isinstance(target, Fused):
        return Fused(target.kind, tuple(prefix + n for n in target.hf))
    return prefix + target


def megatron_layer_name(layer: int, suffix: str) -> str:
    return MEGATRON_LAYER_PREFIX.format(i=layer) + suffix


def global_expert_name(suffix: str, first_local_expert: int) -> str:
    """A layer suffix with its local expert index made global (an expert-parallel rank holds experts
    ``first_local_expert`` onwards); other suffixes unchanged."""
    index = expert_index(suffix)
    if index is None or not first_local_expert:
        return suffix
    return with_expert_index(suffix, index + first_local_expert)


def expert_index(mname: str) -> int | None:
    """The expert index in a megatron parameter name (None: not an expert's)."""
    m = _EXPERT_IN_NAME.match(mname)
    return None if m is None else int(m.group(2))


def with_expert_index(mname: str, index: int) -> str:
    """An expert's megatron parameter name with its expert index replaced by ``index``."""
    m = _EXPERT_IN_NAME.match(mname)
    return f"{m.group(1)}{index}{m.group(3)}"


def fuse_qkv(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", shape: ModelShape) -> "torch.Tensor":
    import torch

    g, d = shape.num_query_groups, shape.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, shape.q_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(g * (shape.q_per_group + 2) * d, *rest)


def qkv_row_groups(qkv: "torch.Tensor", shape: ModelShape) -> list[tuple["torch.Tensor", tuple[int, ...] | None]]:
    """q, k and v of a full fused QKV without copies: ``(view, HF shape or None)`` each. With one query
    group the views have their HF shapes (None); with more, each group's rows are contiguous and the
    groups are not, so they are ``[groups, rows per group, *rest]`` views whose C-order elements are the
    HF tensor's, with that HF shape."""
    g, d, qpg = shape.num_query_groups, shape.head_dim, shape.q_per_group
    rest = tuple(qkv.shape[1:])
    grouped = qkv.reshape(g, (qpg + 2) * d, *rest)
    out = []
    for start, rows in ((0, qpg * d), (qpg * d, d), ((qpg + 1) * d, d)):
        view, hf_shape = grouped[:, start:start + rows], (g * rows, *rest)
        out.append((view.view(hf_shape), None) if g == 1 else (view, hf_shape))
    return out


def split_qkv(qkv: "torch.Tensor", shape: ModelShape) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    q, k, v = ((view if hf_shape is None else view.reshape(hf_shape)).contiguous()
               for view, hf_shape in qkv_row_groups(qkv, shape))
    return q, k, v


def hf_to_megatron(mname: str, read_hf: Callable[[str], "torch.Tensor"], shape: ModelShape,
                   family: DenseFamily) -> "torch.Tensor":
    """The full (unsharded) Megatron tensor for ``mname`` built from HF tensors read by ``read_hf``."""
    import torch

    src = hf_sources(mname, family)
    if isinstance(src, Fused):
        parts = [read_hf(n) for n in src.hf]
        return fuse_qkv(*parts, shape) if src.kind == "qkv" else torch.cat(parts, dim=0)
    if mname == "output_layer.weight" and shape.tied:
        src = "model.embed_tokens.weight"  # tied checkpoints store only the embedding
    tensor = read_hf(src)
    if mname in VOCAB_MEGATRON_NAMES and shape.padded_vocab_size > tensor.shape[0]:
        pad = tensor.new_zeros(shape.padded_vocab_size - tensor.shape[0], *tensor.shape[1:])
        tensor = torch.cat([tensor, pad], dim=0)
    return tensor


def megatron_to_hf(mname: str, full: "torch.Tensor", shape: ModelShape,
                   family: DenseFamily) -> list[tuple[str, "torch.Tensor"]]:
    """Un-fuse, strip vocabulary padding and rename one full Megatron tensor; [] for a tied output layer:
    :func:`hf_views`, each contiguous in its HF shape (a copy where it is not a view)."""
    return [(name, (view if hf_shape is None else view.reshape(hf_shape)).contiguous())
            for name, view, hf_shape in hf_views(mname, full, shape, family)]


def hf_views(mname: str, full: "torch.Tensor", shape: ModelShape,
             family: DenseFamily) -> list[tuple[str, "torch.Tensor", tuple[int, ...] | None]]:
    """``(HF name, view of full, HF shape or None)`` for one full Megatron tensor, renamed, un-fused and
    without vocabulary padding, copying nothing: every HF tensor is a view of ``full`` in its HF shape
    (None), except q, k and v of a ``linear_qkv`` with more than one query group, which are row groups
    (:func:`qkv_row_groups`) with their HF shapes. A reader in place (the colocated direct path) copies
    those group by group; anything else reshapes them, which copies."""
    if mname == "output_layer.weight" and shape.tied:
        return []
    src = hf_sources(mname, family)
    if isinstance(src, Fused):
        parts = qkv_row_groups(full, shape) if src.kind == "qkv" else [(p, None) for p in full.chunk(2, dim=0)]
        return [(n, view, hf_shape) for n, (view, hf_shape) in zip(src.hf, parts)]
    if src in VOCAB_HF_NAMES:
        full = full[: shape.vocab_size]
    return [(src, full, None)]


def hf_pieces(mname: str, local: "torch.Tensor", shape: ModelShape, family: DenseFamily, tp: int,
              rank: int) -> list[tuple[str, "torch.Tensor", tuple, tuple[int, ...]]]:
    """What TP rank ``rank``'s shard ``local`` of Megatron parameter ``mname`` is of the HF tensors:
    ``(HF name, its part in C order, box in the HF tensor, HF shape)`` each, copying only q/k/v of several
    query groups (their rows are not contiguous in the fused tensor). A TP rank holds whole query groups
    (q, k and v each a block of rows), its rows of gate and of up, its columns of a row-parallel weight and its
    vocabulary rows (none where its rows are all padding); a replicated parameter, or any at TP=1, is whole.
    [] for a tied output layer."""
    import dataclasses as dc

    pdim = tp_partition_dim(mname)
    if pdim is None or tp == 1:
        return [(name, t, tuple((0, n) for n in t.shape), tuple(t.shape)) for name, t in
                ((n, v if s is None else v.reshape(s)) for n, v, s in hf_views(mname, local, shape, family))]
    if mname in VOCAB_MEGATRON_NAMES:
        if mname == "output_layer.weight" and shape.tied:
            return []
        rows = local.shape[0]
        start, stop = rank * rows, min((rank + 1) * rows, shape.vocab_size)
        if stop <= start:
            return []
        rest = tuple(local.shape[1:])
        return [(hf_sources(mname, family), local[:stop - start], ((start, stop),) + tuple((0, n) for n in rest),
                 (shape.vocab_size, *rest))]
    if pdim == 1:
        cols = local.shape[1]
        ((name, view, _),) = hf_views(mname, local, shape, family)
        return [(name, view, ((0, local.shape[0]), (rank * cols, (rank + 1) * cols)) +
                 tuple((0, n) for n in local.shape[2:]), (local.shape[0], cols * tp, *local.shape[2:]))]
    local_shape = dc.replace(shape, num_heads=shape.num_heads // tp, num_query_groups=shape.num_query_groups // tp)
    out = []
    for name, view, hf_shape in hf_views(mname, local, local_shape, family):
        t = view if hf_shape is None else view.reshape(hf_shape)
        rows, rest = t.shape[0], tuple(t.shape[1:])
        out.append((name, t, ((rank * rows, (rank + 1) * rows),) + tuple((0, n) for n in rest), (rows * tp, *rest)))
    return out


# by suffix, so an expert's linear layers (``mlp.experts.local_experts.{e}.linear_fc1.weight``) match too
_COLUMN_PARALLEL = (".linear_qkv.weight", ".linear_qkv.bias", ".linear_fc1.weight", ".linear_fc1.bias")
_ROW_PARALLEL = (".linear_proj.weight", ".linear_fc2.weight")


def tp_partition_dim(mname: str) -> int | None:
    """The dimension Megatron splits ``mname`` along under TP (None: replicated on every TP rank).

    Decided by name, not by the ``partition_dim`` attribute megatron sets only when it initialises
    weights itself (``perform_initialization``), which conversion skips.
    """
    if mname in VOCAB_MEGATRON_NAMES or mname.endswith(_COLUMN_PARALLEL):
        return 0
    if mname.endswith(_ROW_PARALLEL):
        return 1
    return None


def is_fc1(mname: str) -> bool:
    return mname.endswith((".linear_fc1.weight", ".linear_fc1.bias"))


def tp_shard(mname: str, full: "torch.Tensor", partition_dim: int | None, tp: int, rank: int) -> "torch.Tensor":
    """Rank ``rank``'s TP shard of a full Megatron tensor (``partition_dim`` None: replicated)."""
    import torch

    if partition_dim is None or tp == 1:
        return full
    if is_fc1(mname):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    return full.chunk(tp, dim=partition_dim)[rank]


def tp_unshard(mname: str, shards: list["torch.Tensor"], partition_dim: int | None) -> "torch.Tensor":
    """The full Megatron tensor from all ranks' shards, in rank order (inverse of :func:`tp_shard`)."""
    import torch

    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if is_fc1(mname):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)


def megatron_names(shape: ModelShape, family: DenseFamily, qkv_bias: bool, te_spec: bool,
                   sparse: list[bool] | None = None, experts: int = 0) -> Iterator[str]:
    """Every Megatron parameter name of the model, global layer and expert indices, in model order;
    ``sparse``: per layer, whether it holds ``experts`` experts (a :class:`MoEFamily`)."""
    yield "embedding.word_embeddings.weight"
    for i in range(shape.num_layers):
        yield from (megatron_layer_name(i, s) for s in _layer_suffixes(family, qkv_bias, te_spec,
                                                                       experts if sparse and sparse[i] else 0))
    yield "decoder.final_layernorm.weight"
    if not shape.tied:
        yield "output_layer.weight"


def _layer_suffixes(family: DenseFamily, qkv_bias: bool, te_spec: bool, experts: int) -> Iterator[str]:
    """One layer's parameter suffixes: a dense MLP, or with ``experts`` the router and that many experts (a
    sparse layer keeps its MLP norm apart in both specs: the router reads it too)."""
    yield "self_attention.linear_qkv.layer_norm_weight" if te_spec else "input_layernorm.weight"
    yield "self_attention.linear_qkv.weight"
    if qkv_bias:
        yield "self_attention.linear_qkv.bias"
    if family.qk_norm:
        yield "self_attention.q_layernorm.weight"
        yield "self_attention.k_layernorm.weight"
    yield "self_attention.linear_proj.weight"
    if not experts:
        yield "mlp.linear_fc1.layer_norm_weight" if te_spec else "pre_mlp_layernorm.weight"
        yield "mlp.linear_fc1.weight"
        yield "mlp.linear_fc2.weight"
        return
    yield "pre_mlp_layernorm.weight"
    yield "mlp.router.weight"
    for e in range(experts):
        yield f"mlp.experts.local_experts.{e}.linear_fc1.weight"
        yield f"mlp.experts.local_experts.{e}.linear_fc2.weight"
