"""Model families, one small file each; :func:`family_for` picks one from an HF config."""

from __future__ import annotations

import importlib
from typing import Any

from rlplacement.families.base import DenseFamily, Fused, MoEFamily, head_dim, num_experts, rope_parameters  # noqa: F401

FAMILY_MODULES = ("qwen3", "qwen2", "llama", "qwen3_moe")


def all_families() -> list[DenseFamily]:
    return [importlib.import_module(f"{__name__}.{m}").FAMILY for m in FAMILY_MODULES]


def family_for(hf_config: Any, source: str = "config.json") -> DenseFamily:
    """The family whose ``model_types`` holds ``hf_config.model_type``; checked for unsupported features."""
    model_type = getattr(hf_config, "model_type", None)
    for fam in all_families():
        if model_type in fam.model_types:
            fam.check(hf_config, source)
            return fam
    known = sorted(t for f in all_families() for t in f.model_types)
    if num_experts(hf_config):
        moe = sorted(t for f in all_families() if f.moe for t in f.model_types)
        raise ValueError(f"{source}: model_type {model_type!r} is a mixture-of-experts family rlplacement has no "
                         f"mapping for; the mixture-of-experts families it knows: {', '.join(moe)} (all known: "
                         f"{', '.join(known)})")
    raise ValueError(f"{source}: model_type {model_type!r} has no mapping; known: {', '.join(known)}")
