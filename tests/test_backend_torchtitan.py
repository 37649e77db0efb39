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
from rlplacement.backends.torchtitan import backend as tt
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


LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=80,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=96,
             tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu")


def _stand_in_torchtitan_llama(hf_config):
    """A module with torchtitan's Llama parameter names and shapes, not its model (which imports triton, absent
    on CPU): what the stream walks."""
    import types

    from torch import nn

    h, hd, v, i = hf_config.hidden_size, hf_config.head_dim, hf_config.vocab_size, hf_config.intermediate_size
    shapes = {"tok_embeddings.weight": (v, h), "layers.0.attention.qkv_linear.wq.weight": (4 * hd, h),
              "layers.0.attention.qkv_linear.wk.weight": (2 * hd, h), "layers.0.attention.qkv_linear.wv.weight": (2 * hd, h),
              "layers.0.attention.wo.weight": (h, 4 * hd), "layers.0.feed_forward.w1.weight": (i, h),
              "layers.0.feed_forward.w3.weight": (i, h), "layers.0.feed_forward.w2.weight": (h, i),
              "layers.0.attention_norm.weight": (h,), "layers.0.ffn_norm.weight": (h,), "norm.weight": (h,),
              "lm_head.weight": (v, h)}
    root = nn.Module()
    root.layers = nn.ModuleDict({"0": nn.Module()})
    g = torch.Generator().manual_seed(7)
    for name, shape in shapes.items():
        owner = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(torch.randn(shape, generator=g)))
    return root, types.SimpleNamespace(**LLAMA)


def _torchtitan_streams(rank, world):
    import types

    from rlplacement.backends.fsdp.sharded_model import TorchtitanRoot, shard
    from rlplacement.backends.torchtitan.backend import TorchtitanBackend
    from rlplacement.config import TrainConfig
    from rlplacement.transfer.spec import OWN_GPU, SHARES

    model, hf_config = _stand_in_torchtitan_llama(types.SimpleNamespace(**LLAMA))
    whole = {names.torchtitan_to_hf_name(n): names.torchtitan_to_hf_tensor(n, p.detach().to(torch.bfloat16),
                                                                           hf_config)
             for n, p in model.named_parameters()}
    root = TorchtitanRoot(model)
    shard(root, model.layers.values(), "cpu", False)
    backend = TorchtitanBackend(root, hf_config, OptimConfig(), TrainConfig(), torch.bfloat16)
    out = {}
    for share in (SHARES, OWN_GPU):
        out[share] = {n: t.clone() for n, t in backend.iter_update_tensors(share)}
        out[share + " gathered"] = backend.last_stream_gathered_bytes
    out["planned"] = backend.update_shares()
    return {**out, "whole": whole}


@pytest.mark.parametrize("world", [2, 4])
def test_torchtitan_ranks_send_their_rows_in_hf_layout_with_a_stand_in_module(world):
    """torchtitan shards with FSDP2 as FSDP does, so where every rank sends, each sends its own rows of every
    tensor (pieces) in HF's layout: a Llama q/k weight's rows unpermuted per head, where they are whole heads;
    a weight whose rows at some rank split a head (k at 4 ranks: 16 of its 32-row heads) is gathered onto one
    rank instead. The pieces tile every HF tensor bit-exact; colocated (every rank everything), HF names too.
    Two and four gloo ranks over a stand-in module of torchtitan's names (its model needs triton)."""
    from rlplacement.backends import launch
    from rlplacement.transfer.pieces import parse_piece
    from rlplacement.transfer.spec import OWN_GPU, SHARES

    got = launch.spawn(_torchtitan_streams, world, timeout_s=300)
    whole = got[0]["whole"]
    rebuilt = {name: torch.zeros_like(t) for name, t in whole.items()}
    covered = {name: 0 for name in whole}
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    for r in range(world):
        for key, t in got[r][SHARES].items():
            parsed = parse_piece(key)
            if parsed is None:  # a whole tensor: only where rows would split a head
                assert key == k_proj and world == 4, key
                rebuilt[key].copy_(t)
                covered[key] += t.numel()
                continue
            name, box, shape = parsed
            assert shape == tuple(whole[name].shape) and t.dtype == torch.bfloat16, key
            rebuilt[name][box[0][0]:box[0][1]] = t
            covered[name] += t.numel()
        assert set(got[r][OWN_GPU]) == set(whole)
        assert all(torch.equal(got[r][OWN_GPU][n], whole[n]) for n in whole)
    assert covered == {name: t.numel() for name, t in whole.items()}  # each tensor exactly once
    assert all(torch.equal(rebuilt[n], whole[n]) for n in whole)
    k_bytes = whole[k_proj].numel() * 4  # gathered as trained: fp32 master weights
    assert [got[r][SHARES + " gathered"] for r in range(world)] == (  # the other ranks' rows of k, onto its owner
        [0] * world if world == 2 else [k_bytes * 3 // 4 if r == 0 else 0 for r in range(world)])
    # the plan's shares are what streamed: a piece or whole tensor per rank, with its bytes
    streamed = {(key, r): t.numel() * 2 for r in range(world) for key, t in got[r][SHARES].items()}
    assert {(key, r): nbytes for key, nbytes, r in got[0]["planned"]} == streamed
