"""Qwen2 / Qwen2.5 dense: q/k/v projections carry a bias, no q/k norm."""
from rlplacement.families.base import DenseFamily

FAMILY = DenseFamily(name="qwen2", model_types=("qwen2",), qk_norm=False, qkv_bias=True)
