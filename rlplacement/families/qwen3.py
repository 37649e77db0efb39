"""Qwen3 dense: RMSNorm per head on q and k (``q_norm``/``k_norm``), no q/k/v bias."""
from rlplacement.families.base import DenseFamily

FAMILY = DenseFamily(name="qwen3", model_types=("qwen3",), qk_norm=True, qkv_bias=False)
