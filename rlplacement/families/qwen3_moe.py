"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norm, no bias) with routed experts,
no shared expert."""
from rlplacement.families.base import MoEFamily

FAMILY = MoEFamily(name="qwen3_moe", model_types=("qwen3_moe",), qk_norm=True, qkv_bias=False)
