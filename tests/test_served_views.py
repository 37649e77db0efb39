"""The GPU peers' check builds what vLLM serves from the trainer's HF tensors (benchmarks/gpu/served_views.py):
fused names, fusion order, experts stacked, and a missing member reported rather than checked."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
import served_views  # noqa: E402

sys.path.pop(0)


def _hf(experts: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(10, 4, generator=g),
         "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4, generator=g),
         "model.layers.0.self_attn.k_proj.weight": torch.randn(2, 4, generator=g),
         "model.layers.0.self_attn.v_proj.weight": torch.randn(2, 4, generator=g),
         "model.layers.0.self_attn.q_norm.weight": torch.randn(2, generator=g)}
    if experts:
        t["model.layers.0.mlp.gate.weight"] = torch.randn(experts, 4, generator=g)
        for e in reversed(range(experts)):  # order of arrival must not matter
            for p, shape in (("gate", (3, 4)), ("up", (3, 4)), ("down", (4, 3))):
                t[f"model.layers.0.mlp.experts.{e}.{p}_proj.weight"] = torch.randn(*shape, generator=g)
    else:
        for p, shape in (("up", (6, 4)), ("gate", (6, 4)), ("down", (4, 6))):
            t[f"model.layers.0.mlp.{p}_proj.weight"] = torch.randn(*shape, generator=g)
    return t


def test_dense_fusions_in_vllm_order():
    t = _hf()
    groups = served_views.served_groups(list(t))
    assert set(groups) == {"model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                           "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.gate_up_proj.weight",
                           "model.layers.0.mlp.down_proj.weight"}
    qkv = served_views.build(*groups["model.layers.0.self_attn.qkv_proj.weight"], t)
    assert torch.equal(qkv[:4], t["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(qkv[6:], t["model.layers.0.self_attn.v_proj.weight"])
    gate_up = served_views.build(*groups["model.layers.0.mlp.gate_up_proj.weight"], t)
    assert torch.equal(gate_up[:6], t["model.layers.0.mlp.gate_proj.weight"])  # gate first though up came first
    assert served_views.covered(groups) == set(t)


def test_experts_stacked_by_index_gate_rows_then_up_rows():
    t = _hf(experts=3)
    groups = served_views.served_groups(list(t))
    w13 = served_views.build(*groups["model.layers.0.mlp.experts.w13_weight"], t)
    w2 = served_views.build(*groups["model.layers.0.mlp.experts.w2_weight"], t)
    assert w13.shape == (3, 6, 4) and w2.shape == (3, 4, 3)
    assert torch.equal(w13[1, :3], t["model.layers.0.mlp.experts.1.gate_proj.weight"])
    assert torch.equal(w13[1, 3:], t["model.layers.0.mlp.experts.1.up_proj.weight"])
    assert torch.equal(w2[2], t["model.layers.0.mlp.experts.2.down_proj.weight"])
    assert "model.layers.0.mlp.gate.weight" in groups  # the router keeps its name
    assert served_views.covered(groups) == set(t)


def test_compare_reports_differences_missing_members_and_unexpected_parameters():
    t = _hf()
    names = list(t)
    expected = {"a": "1", "b": "2"}
    ok = served_views.compare(expected, {"a": "1", "b": "2"}, names)
    assert ok["bit_exact"] and ok["checked"] == 2
    bad = served_views.compare(expected, {"a": "1", "b": "3", "c": "4"}, names)
    assert not bad["bit_exact"] and bad["differing"] == ["b"] and bad["unexpected"] == ["c"]
    del t["model.layers.0.self_attn.k_proj.weight"]  # q and v alone make no qkv_proj: reported, never checked
    partial = served_views.compare({}, {}, list(t))
    assert not partial["bit_exact"]
    assert partial["uncovered"] == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"]


def test_compare_reads_vllm_026_routed_experts_names():
    # vLLM 0.26 serves FusedMoE's stacks under mlp.experts.routed_experts. (seen on the H100 run, 2026-12-07)
    names = list(_hf(experts=2))
    expected = {"model.layers.0.mlp.experts.w13_weight": "1", "model.layers.0.mlp.experts.w2_weight": "2"}
    served = {"model.layers.0.mlp.experts.routed_experts.w13_weight": "1",
              "model.layers.0.mlp.experts.routed_experts.w2_weight": "2"}
    out = served_views.compare(expected, served, names)
    assert out["checked"] == 2 and not out["missing"] and not out["unexpected"] and not out["differing"]
    served["model.layers.0.mlp.experts.routed_experts.w2_weight"] = "3"
    assert served_views.compare(expected, served, names)["differing"] == ["model.layers.0.mlp.experts.w2_weight"]
