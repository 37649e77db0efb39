"""torchtitan: name table vs torchtitan's own adapter, refusals on CPU, and (where triton imports) two FSDP2
ranks of the real torchtitan model vs the HF reference."""

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

from rlplacement.config import BackendConfig, OptimConfig
from rlplacement.errors import ConfigError
from rlplacement.backends import make_backend
from rlplacement.backends import torchtitan as tt
from rlplacement.families import torchtitan_mapping as names
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.reference_checks import check_two_ranks_match_hf_reference


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
        assert names.HF_TO_TORCHTITAN[hf] == titan
    assert names.hf_to_torchtitan_name("model.layers.11.mlp.up_proj.weight") == "layers.11.feed_forward.w3.weight"
    assert names.torchtitan_to_hf_name("layers.3.attention.qkv_linear.wk.weight") == "model.layers.3.self_attn.k_proj.weight"


def test_rope_permutation_round_trips_bit_exact():
    w = torch.randn(4 * 32, 64)
    p = names.permute_for_interleaved_rope(w, 4)
    assert not torch.equal(p, w)
    assert torch.equal(names.unpermute_from_interleaved_rope(p, 4), w)
    assert torch.equal(p[1], w[16])  # head 0: row pairs (0, 16) interleave


def test_backend_refuses_without_cuda_naming_the_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the refusal is for CPU hosts")
    hf = make_tiny_model(tmp_path / "hf", TinySpec("qwen3"))
    with pytest.raises(ConfigError, match=r"--train-backend torchtitan needs CUDA on the trainer ranks: torchtitan "
                                          r"0.3.0 cannot train without CUDA: importing any of its models imports triton"):
        make_backend(BackendConfig(name="torchtitan", hf_checkpoint=str(hf)))
    qwen2 = make_tiny_model(tmp_path / "qwen2", TinySpec("qwen2", hidden_size=64, num_attention_heads=2, head_dim=32))
    with pytest.raises(ConfigError, match=r"--train-backend torchtitan has no qwen2 model"):
        make_backend(BackendConfig(name="torchtitan", hf_checkpoint=str(qwen2)), allow_cpu=True)


def test_allow_cpu_without_triton_says_torchtitan_does_not_import(tmp_path):
    if tt.torchtitan_import_error() is None:
        pytest.skip("torchtitan imports here (triton present)")
    hf = make_tiny_model(tmp_path / "hf", TinySpec("qwen3"))
    with pytest.raises(ConfigError, match=r"--train-backend torchtitan: torchtitan does not import here "
                                          r"\(ModuleNotFoundError: No module named 'triton'\)"):
        make_backend(BackendConfig(name="torchtitan", hf_checkpoint=str(hf)), allow_cpu=True)


SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


@pytest.mark.slow
@pytest.mark.parametrize("family, tied", [("qwen3", True), ("llama", False)])
def test_two_ranks_on_cpu_match_hf_reference_where_triton_imports(tmp_path, family, tied):
    """The real torchtitan model under FSDP2 on two gloo ranks, checked as the fsdp backend is
    (``check_two_ranks_match_hf_reference``); runs only where triton imports (not in the CPU CI, where
    the Makefile removes it; run with PYTHONPATH=<folder with triton> to exercise it)."""
    if tt.torchtitan_import_error() is not None:
        pytest.skip(f"torchtitan does not import here: {tt.torchtitan_import_error()}")
    hf = make_tiny_model(tmp_path / "hf", TinySpec(family, num_attention_heads=4, num_key_value_heads=2,
                                                   tie_word_embeddings=tied))
    check_two_ranks_match_hf_reference("torchtitan", hf, tmp_path, SGD, vocab=300, seed=20, allow_cpu=True)
