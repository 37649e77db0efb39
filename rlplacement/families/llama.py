"""Llama (2/3 with default RoPE) dense: q/k/v bias only when ``attention_bias`` is set."""
from rlplacement.families.base import DenseFamily

FAMILY = DenseFamily(name="llama", model_types=("llama",), qk_norm=False, qkv_bias=None)
