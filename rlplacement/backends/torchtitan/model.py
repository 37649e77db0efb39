"""torchtitan's Qwen3 / Llama3 model built from an HF ``config.json`` and filled from HF safetensors.

The model is torchtitan's own (``Qwen3Model`` / ``Llama3Model`` with their transformer blocks,
``GQAttention``, ``FeedForward``, ``RMSNorm``, RoPE modules), assembled from torchtitan's public config
builders with two deliberate choices:
- q/k/v stay unfused (``fuse_qkv=False``: ``wq``/``wk``/``wv`` parameters) so an HF tensor maps to
  exactly one parameter and streaming is a rename (plus the Llama RoPE row permutation);
- the inner attention is torchtitan's ``ScaledDotProductAttention`` module with ``is_causal``: RL
  batches are right-padded single sequences, so plain causal attention is exactly the HF model's.
  torchtitan's language-model presets use flex or varlen only to mask packed documents, which we
  never pack. SDPA also has a fp32 path (the math kernel), so the GPU check can compare in fp32.

Importing torchtitan's models needs triton (see :mod:`rlplacement.backends.torchtitan.backend`); everything
here imports torchtitan inside functions.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch

from rlplacement.families import family_for, head_dim, rope_parameters
from rlplacement.families import torchtitan_mapping as names
from rlplacement.families.torchtitan_mapping import hf_to_torchtitan_tensor, torchtitan_to_hf_tensor
from rlplacement.hf_folder import HFTensors


def model_config(hf_config: Any):
    """torchtitan ``Qwen3Model.Config`` or ``Llama3Model.Config`` for the HF architecture."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    family = family_for(hf_config).name
    if family == "qwen3":
        from torchtitan.models.qwen3.model import Qwen3Model as Model
        from torchtitan.models.qwen3.model import Qwen3TransformerBlock as Block
        rope_cls = CosSinRoPE  # HF rotate-half layout: weights load unpermuted
    elif family == "llama":
        from torchtitan.models.llama3.model import Llama3Model as Model
        from torchtitan.models.llama3.model import Llama3TransformerBlock as Block
        rope_cls = ComplexRoPE  # interleaved pairs: q/k rows are permuted on load
    else:
        raise ValueError(f"torchtitan has no {family} model; known: {', '.join(names.FAMILIES)}")

    dim, hd, eps = hf_config.hidden_size, head_dim(hf_config), float(hf_config.rms_norm_eps)
    n_heads = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_heads
    theta = float(rope_parameters(hf_config).get("rope_theta", 10000.0))
    vocab = hf_config.vocab_size

    def norm(size: int):
        return RMSNorm.Config(normalized_shape=size, eps=eps)

    layers = [
        Block.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
                wqkv_param_init=None, wo_param_init=None,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=False,
                rope=rope_cls.Config(dim=hd, max_seq_len=hf_config.max_position_embeddings, theta=theta),
                qk_norm=norm(hd) if family == "qwen3" else None,
            ),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=hf_config.intermediate_size,
                                         w1_param_init=None, w2w3_param_init=None),
        )
        for _ in range(hf_config.num_hidden_layers)
    ]
    return Model.Config(
        dim=dim, vocab_size=vocab, norm=norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers,
        enable_weight_tying=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def build(hf_config: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model on ``device`` in ``dtype`` with arbitrary weights (fill with :func:`load_hf_weights`).

    RoPE caches are buffers computed in fp32 at construction and kept fp32 (a dtype cast would round
    them); only parameters take ``dtype``.
    """
    with torch.device(device):
        model = model_config(hf_config).build()
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def load_hf_weights(model: torch.nn.Module, hf_dir: str | os.PathLike, hf_config: Any) -> int:
    """Copy every HF tensor into its parameter (a tied embedding once); refuse tensors left unused.

    Runs before sharding, on plain parameters. Returns the number of parameters filled.
    """
    weights = HFTensors(hf_dir)
    used: set[str] = set()
    count = 0
    with torch.no_grad():
        for tt_name, param in model.named_parameters():  # tied lm_head is yielded once, as tok_embeddings
            hf_name = names.torchtitan_to_hf_name(tt_name)
            if hf_name not in weights:
                raise KeyError(f"{hf_dir}: tensor {hf_name!r} (for torchtitan {tt_name}) not in the safetensors files")
            tensor = hf_to_torchtitan_tensor(tt_name, weights.get(hf_name), hf_config)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} does not fit torchtitan {tt_name} "
                                 f"{tuple(param.shape)}")
            param.copy_(tensor.to(param.dtype))
            used.add(hf_name)
            count += 1
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    unused = sorted(n for n in weights.names if n not in used and not (tied and n == "lm_head.weight")
                    and "rotary_emb" not in n)
    if unused:
        raise ValueError(f"{hf_dir}: HF tensors with no torchtitan parameter: {', '.join(unused[:5])}"
                         + (" ..." if len(unused) > 5 else ""))
    return count


def hf_named_tensors(model: torch.nn.Module, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` per parameter in model order; collective when parameters are DTensors
    (``full_tensor`` all-gathers one parameter at a time)."""
    for tt_name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield names.torchtitan_to_hf_name(tt_name), torchtitan_to_hf_tensor(tt_name, full.detach(), hf_config)


def hf_tensor_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(hf_name, HF shape, dtype)`` of what :func:`hf_named_tensors` yields, in its order, without gathering
    (a DTensor's shape is the whole tensor's; the torchtitan -> HF conversion permutes rows, keeping shapes)."""
    return [(names.torchtitan_to_hf_name(n), tuple(p.shape), p.dtype) for n, p in model.named_parameters()]

