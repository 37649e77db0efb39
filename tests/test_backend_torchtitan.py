"""torchtitan: our HF <-> torchtitan name table against torchtitan's own adapter, and the refusal message."""

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from rlplacement.args import BackendConfig, ConfigError
from rlplacement.backends import make_backend
from rlplacement.backends import torchtitan as tt


def _adapter_map(family: str) -> dict:
    """``from_hf_map`` of torchtitan's installed adapter, read as source (importing needs triton)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed")
    src = Path(spec.origin).parent / "models" / family / "state_dict_adapter.py"
    for node in ast.walk(ast.parse(src.read_text())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "attr", None) == "from_hf_map":
            return ast.literal_eval(node.value)
    raise AssertionError(f"from_hf_map not found in {src}")


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_name_table_agrees_with_torchtitan_adapter(family):
    theirs = {k: v for k, v in _adapter_map(family).items() if v is not None and ".experts." not in k
              and "mlp.gate.weight" not in k}
    for hf, titan in theirs.items():
        assert tt.HF_TO_TORCHTITAN[hf] == titan
    assert tt.hf_to_torchtitan_name("model.layers.11.mlp.up_proj.weight") == "layers.11.feed_forward.w3.weight"
    assert tt.torchtitan_to_hf_name("layers.3.attention.qkv_linear.wk.weight") == "model.layers.3.self_attn.k_proj.weight"


def test_rope_permutation_round_trips_bit_exact():
    w = torch.randn(4 * 32, 64)
    p = tt.permute_for_interleaved_rope(w, 4)
    assert not torch.equal(p, w)
    assert torch.equal(tt.unpermute_from_interleaved_rope(p, 4), w)
    assert torch.equal(p[1], w[16])  # head 0: row pairs (0, 16) interleave


def test_backend_refuses_with_the_reason():
    with pytest.raises(ConfigError, match="--train-backend torchtitan is not available.*use --train-backend fsdp or megatron"):
        make_backend(BackendConfig("torchtitan", "x", None, 1, 1))
