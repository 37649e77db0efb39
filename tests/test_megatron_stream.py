"""Megatron's weight stream bucket by bucket, in real gloo processes (TP=2, PP=2, TP=2 x PP=2): the
HF tensors global rank 0 yields equal the HF folder the model was loaded from, bit for bit, and the
collectives each rank issues in its TP and PP groups follow the buckets and stages, not the parameters."""

import dataclasses
from pathlib import Path

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.config import BackendConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.transfer.spec import OWN_GPU, SHARES

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, vocab_size=300, num_hidden_layers=4)
BUCKET = 40 * 1024  # a few parameters per bucket: the ~120 KB layers make several buckets per stage


def _stream_worker(rank, world, hf, tp, pp):
    from megatron.core import parallel_state as ps

    from rlplacement.backends.megatron import update_streams as mm
    from rlplacement.backends.megatron.backend import MegatronBackend

    mm.GATHER_BUCKET_BYTES = BUCKET  # this process's own copy of the module
    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf,
                                                        tensor_model_parallel_size=tp,
                                                        pipeline_model_parallel_size=pp))
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    # megatron's own rule for what a gradient norm counts on this rank: every split weight's shard, and the
    # replicated ones on TP rank 0 only (megatron-core leaves split weights unmarked when it does not
    # initialise them, so its norm would miss TP rank 1's shards)
    counted = {n for n, p in mm.global_named_parameters(backend.model) if param_is_not_tensor_parallel_duplicate(p)}
    split = {n for n, _ in mm.global_named_parameters(backend.model) if mm.mapping.tp_partition_dim(n) is not None}
    streamed = {n: t.clone() for n, t in backend.iter_hf_tensors()}
    first = backend.last_stream_collectives
    again = dict(backend.iter_hf_tensors())  # the next update streams the same, with the same count
    stage_meta = [(n, tuple(p.shape), p.dtype, mm.mapping.tp_partition_dim(n))
                  for n, p in mm.global_named_parameters(backend.model)]
    out = {"streamed": streamed if rank == 0 else None, "same_again": all(
        torch.equal(streamed[n], again[n]) for n in streamed) and set(streamed) == set(again),
           "collectives": first, "again": backend.last_stream_collectives,
           "counted_right": counted == (split if ps.get_tensor_model_parallel_rank() else counted) and split <= counted,
           "my_buckets": len(mm.cut_into_buckets(stage_meta, BUCKET)), "my_params": len(stage_meta),
           "stage": ps.get_pipeline_model_parallel_rank(), "device": str(next(backend.model.parameters()).device)}
    backend.close()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_bucketed_stream_is_bit_exact_and_issues_a_collective_per_bucket_not_per_parameter(tmp_path, tp, pp):
    from safetensors.torch import load_file

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    results = launch.spawn(_stream_worker, tp * pp, str(hf), tp, pp, timeout_s=600)
    want = {}
    for f in sorted(hf.glob("*.safetensors")):
        want.update(load_file(str(f)))
    got = results[0]["streamed"]
    assert set(got) == set(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    assert all(r["counted_right"] for r in results)
    assert all(r["same_again"] for r in results) and all(r["collectives"] == r["again"] for r in results)
    buckets = sum(r["my_buckets"] for r in results) // tp  # every TP rank counts its stage's
    params = sum(r["my_params"] for r in results) // tp
    # global rank 0: one gather (TP > 1) or receive (a later stage) per bucket, one name table per later stage
    assert results[0]["collectives"] <= buckets + (pp - 1 if pp > 1 else 0) + (pp > 1)
    assert results[0]["collectives"] < params  # one per parameter was the stream before (37 at TP=2 x PP=2)
    # any rank: its stage's buckets gathered and, at a later stage's first rank, sent on
    for r in results:
        assert r["collectives"] <= 2 * r["my_buckets"] + pp * (pp > 1)


def _spread_worker(rank, world, hf, tp, pp):
    from megatron.core import parallel_state as ps

    from rlplacement.backends.megatron import update_streams as mm
    from rlplacement.backends.megatron.backend import MegatronBackend

    mm.GATHER_BUCKET_BYTES = BUCKET
    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf,
                                                        tensor_model_parallel_size=tp,
                                                        pipeline_model_parallel_size=pp))
    planned = backend.update_shares()  # before any byte moves
    sent = {n: t.clone() for n, t in backend.iter_update_tensors(SHARES)}
    shares_collectives = backend.last_stream_collectives
    # colocated: every rank yields the whole model, for the engine worker on its GPU
    from safetensors.torch import load_file

    want = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        want.update(load_file(str(f)))
    everywhere = {n: t.clone() for n, t in backend.iter_update_tensors(OWN_GPU)}
    everywhere_ok = set(everywhere) == set(want) and all(torch.equal(everywhere[n], want[n]) for n in want)
    held = [(n, tuple(p.shape), p.dtype, mm.mapping.tp_partition_dim(n)) for n, p in
            mm.global_named_parameters(backend.model)]
    full = [mm.byte_size(mm.full_shape(row, tp), row[2]) for row in held]
    out = {"sent": sent, "planned": planned, "stage": ps.get_pipeline_model_parallel_rank(),
           "collectives": shares_collectives,
           "stage_bytes": sum(full), "largest": max(full), "held": [row[0] for row in held],
           "everywhere_ok": everywhere_ok, "everywhere_collectives": backend.last_stream_collectives,
           "buckets": [len(mm.cut_into_buckets(rows, BUCKET)) for rows in _stage_rows(
               backend.model, pp, frozenset({"output_layer.weight"}) if backend.shape.tied else frozenset())]}
    backend.close()
    return out


def _stage_rows(model, pp, skip=frozenset()):
    """Every stage's (name, local shape, dtype, partition dim) rows, as each rank's stream cuts them (``skip``:
    names the stream leaves out, a tied output layer)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlplacement.backends.megatron import update_streams as mm

    mine = [(n, tuple(p.shape), p.dtype, mm.mapping.tp_partition_dim(n)) for n, p in mm.global_named_parameters(model)
            if n not in skip]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (ps.get_pipeline_model_parallel_rank(), mine))
    return [next(rows for stage, rows in every if stage == s) for s in range(pp)]


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp, world, tied", [(2, 2, 8, False), (1, 2, 4, True)], ids=["tp2-pp2-dp2", "pp2-dp2-tied"])
def test_every_rank_sends_its_share_of_its_own_stage_and_the_union_is_the_model(tmp_path, tp, pp, world, tied):
    """TP=2 x PP=2 x DP=2 (8 gloo ranks), and PP=2 x DP=2 with tied embeddings (the last stage's output layer
    is the embedding, which HF does not hold twice), ``iter_update_tensors(SHARES)``: each rank sends the parts
    of the HF tensors its own shards are (pieces), which together are every HF tensor, each element once, bit
    for bit as the folder holds it; each rank sends only tensors of its own stage, with no collective at all
    (nothing gathered, no byte crosses a pipeline stage); the 4 ranks of a stage share its bytes to within one
    parameter of their mean, and the simulator's plan sends what ran, rank by rank.
    ``iter_update_tensors(OWN_GPU)`` (colocated: each rank hands the worker on its GPU the whole model): every rank yields every tensor, bit for bit, with one all-gather per bucket of
    its own stage and one broadcast per bucket (and name table) of every stage in its pipeline group."""
    from safetensors.torch import load_file

    hf = make_tiny_model(tmp_path / "hf", dataclasses.replace(SPEC, tie_word_embeddings=tied))
    results = launch.spawn(_spread_worker, world, str(hf), tp, pp, timeout_s=600)
    want = {}
    for f in sorted(hf.glob("*.safetensors")):
        want.update(load_file(str(f)))
    # every rank sends the parts of the HF tensors its shards are (pieces; a replicated tensor whole): together
    # they are every tensor, each element once, bit for bit
    from rlplacement.transfer.pieces import parse_piece
    from tests.transfer_helpers.pieces_check import each_element_once, tiled

    rebuilt, covered, sent_boxes = tiled([r["sent"] for r in results], want)
    for rank, r in enumerate(results):
        for name, box in sent_boxes[rank]:
            if name.startswith("model.layers."):  # a rank's tensors are its stage's parameters, in HF names
                own_layers = {n.split(".")[2] for n in r["held"] if n.startswith("decoder.layers.")}
                assert name.split(".")[2] in own_layers, (rank, name, box)
            elif name == "model.embed_tokens.weight":
                assert r["stage"] == 0, (rank, name, box)
            else:
                assert r["stage"] == pp - 1, (rank, name, box)
    assert each_element_once(covered) == []
    assert [n for n in want if not torch.equal(rebuilt[n], want[n])] == []
    assert sum(t.numel() * t.element_size() for r in results for t in r["sent"].values()) == \
        sum(t.numel() * t.element_size() for t in want.values())
    # what every rank computed before any byte moved (update_shares) is what each rank sent, rank by rank
    streamed = {(key, t.numel() * t.element_size(), rank) for rank, r in enumerate(results) for key, t in r["sent"].items()}
    assert all(set(r["planned"]) == streamed for r in results)
    # TP and the data-parallel replicas split tensors into pieces: every rank of a stage sends about its share
    for r in results:
        assert all(parse_piece(k) for k in r["sent"]), [k for k in r["sent"] if not parse_piece(k)]
    for stage in range(pp):
        ranks = [r for r in results if r["stage"] == stage]
        sent = [sum(t.numel() * t.element_size() for t in r["sent"].values()) for r in ranks]
        assert sum(sent) <= ranks[0]["stage_bytes"]  # megatron pads the vocabulary; HF tensors are unpadded
        assert max(sent) <= sum(sent) / len(sent) + ranks[0]["largest"], sent
        assert min(sent) > 0, f"stage {stage}: a rank sent nothing ({sent})"
    # the simulator's plan of this trainer sends what ran, rank by rank
    from rlplacement.advisor.thresholds import ModelAssumptions
    from rlplacement.placement.layout import Layout
    from rlplacement.transfer.plan.for_layout import plans_for
    from rlplacement.transfer.plan.tensors import ModelTensors

    layout = Layout(False, tuple((0, g) for g in range(world)), (((1, 0),),), 8)
    pair = plans_for(ModelTensors.from_hf_config(str(hf / "config.json")), layout, backend="megatron", tp=tp, pp=pp,
                     mode="broadcast", assumptions=ModelAssumptions())
    assert pair.runs == "spread"
    assert pair.spread.bytes_per_sender() == {
        rank: sum(t.numel() * t.element_size() for t in r["sent"].values()) for rank, r in enumerate(results)}
    # nothing gathered: no collective at all
    assert all(r["collectives"] == 0 for r in results)
    assert all(r["everywhere_ok"] for r in results), [r["everywhere_ok"] for r in results]
    for r in results:  # each stage's name table and one broadcast per bucket, plus its own stage's all-gathers
        broadcasts = pp + sum(r["buckets"])
        assert broadcasts <= r["everywhere_collectives"] <= broadcasts + r["buckets"][r["stage"]], r
