"""Megatron trains a mixture-of-experts model (Qwen3-MoE) with its own MoE layer, router, token dispatcher
and load-balancing loss, DDP and optimizer: two gloo ranks (data-parallel, and expert-parallel with EP=2),
one step each equal to the HF reference with megatron's loss, and the experts streamed under the
checkpoint's per-expert names by every way of sending (rank 0 alone, every rank its share, every rank all:
at EP=2 each rank's share holds only its own experts, and every rank all is refused)."""

import dataclasses

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.backends.hf_reference import (hf_log_probs, hf_reference_step, load_hf,
                                               megatron_load_balancing_loss, random_batch)
from rlplacement.config import BackendConfig, MoEConfig, OptimConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.reference_checks import assert_streamed_match_reference

SPEC = TinySpec(family="qwen3_moe", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                mlp_only_layers=(1,))
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
AUX = 0.5


def _step_and_streams(rank, world, hf, streamed_path, dispatcher, ep, pp=1):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.families import megatron_mapping as mapping
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

    moe = MoEConfig(aux_loss_coeff=AUX, token_dispatcher_type=dispatcher, router_dtype="fp32")
    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf, moe=moe,
                                                        expert_model_parallel_size=ep,
                                                        pipeline_model_parallel_size=pp), SGD)
    from rlplacement.backends.megatron.model_build import global_named_parameters

    experts_marked = {getattr(p, "allreduce", True) for n, p in global_named_parameters(backend.model) if ".experts." in n}
    batch = random_batch(SPEC.vocab_size, seed=10 + rank % (world // pp))  # one batch per pipeline
    logp = backend.log_probs(batch)
    metrics = backend.train_step(batch)
    planned = backend.update_shares()
    streams, collectives = {}, {}
    for share in (RANK0, SHARES, OWN_GPU):
        streams[share] = {n: t.clone() for n, t in backend.iter_update_tensors(share)}
        collectives[share] = backend.last_stream_collectives
    if rank == 0:
        torch.save(streams[RANK0], streamed_path)
    torch.distributed.barrier()
    whole = torch.load(streamed_path)
    own_gpu_equal = all(torch.equal(t, whole[n]) for n, t in streams[OWN_GPU].items())
    # every rank's megatron parameters are what the stream says, experts by their global index
    mismatched = [m for m, held in backend.local_megatron_parameters()
                  if not torch.equal(mapping.hf_to_megatron(m, whole.__getitem__, backend.shape, backend.family), held)]
    backend.close()
    return {"logp": logp, "metrics": metrics, "mismatched": mismatched, "experts_allreduce": experts_marked,
            "own_gpu_equal": own_gpu_equal, "shares": streams[SHARES], "collectives": collectives[SHARES], "planned": planned,
            "names": {share: sorted(s) for share, s in streams.items()}}


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher, ep, pp, world", [("allgather", 1, 1, 2), ("alltoall", 2, 1, 2),
                                                       ("alltoall", 1, 2, 2), ("alltoall", 2, 2, 4)])
def test_megatron_moe_step_matches_the_reference_with_megatrons_router_loss(tmp_path, dispatcher, ep, pp, world):
    """Two ranks as data-parallel (EP=1), expert-parallel (EP=2) or pipeline stages (PP=2: one pipeline, the
    sparse layers 0 and 2 on different stages); four as two stages of two expert-parallel ranks."""
    from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

    hf = make_tiny_model(tmp_path / "hf", SPEC if pp == 1 else dataclasses.replace(SPEC, num_hidden_layers=4,
                                                                                     mlp_only_layers=(1, 3)))
    streamed = tmp_path / "streamed.pt"
    results = launch.spawn(_step_and_streams, world, str(hf), str(streamed), dispatcher, ep, pp, timeout_s=300)
    # under EP, DDP reduces each expert's gradient over its expert-data-parallel ranks only (megatron marks them)
    assert all(r["experts_allreduce"] == {ep == 1} for r in results)
    ref = load_hf(hf)
    ref.config.output_router_logits = True  # the reference computes the router logits; the loss is megatron's
    batches = [random_batch(SPEC.vocab_size, seed=10 + r) for r in range(world // pp)]
    for r, res in enumerate(results):
        assert (res["logp"] - hf_log_probs(ref, batches[r % len(batches)].input_ids)).abs().max().item() <= 1e-5
        assert res["mismatched"] == []
    expected = hf_reference_step(ref, batches, SGD, router_loss=megatron_load_balancing_loss(AUX, 4, 2))
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert_streamed_match_reference(streamed, ref)
    every = set(results[0]["names"][RANK0])
    assert all(r["names"][RANK0] == [] for r in results[1:])
    # every rank sends the parts of the HF tensors its shards are (pieces), experts too: together every tensor,
    # each element once, bit for bit as rank 0's whole stream
    from tests.transfer_helpers.pieces_check import each_element_once, tiled

    whole = torch.load(streamed)
    rebuilt, covered, sent_boxes = tiled([result["shares"] for result in results], whole)
    assert each_element_once(covered) == []
    assert [n for n in whole if not torch.equal(rebuilt[n], whole[n])] == []
    assert all(r["collectives"] == 0 for r in results)  # nothing gathered, experts included
    shares = [{name for name, _ in boxes} for boxes in sent_boxes]
    # the OWN_GPU stream (every rank everything, colocated) is the whole model under EP too
    assert all(r["own_gpu_equal"] for r in results)
    if ep > 1:  # each expert-parallel rank sends its own experts: EP rank q (rank % 2) holds experts 2q, 2q + 1
        for r, share in enumerate(shares):
            sent = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in share if ".experts." in n}
            assert sent == {2 * (r % 2), 2 * (r % 2) + 1} if world // pp == 2 else sent <= {2 * (r % 2), 2 * (r % 2) + 1}
    # the simulator's running plan (plan --simulate-transfer) gives each rank the boxes it sent
    from rlplacement.transfer.plan.tensors import ModelTensors
    from rlplacement.transfer.plan.trainer_shards import megatron_piece_holdings

    planned = megatron_piece_holdings(ModelTensors.from_hf_config(str(hf / "config.json")), 1, pp, world // pp, ep)
    assert [set(p.items()) for p in planned] == sent_boxes
    # and every rank knew its share before any byte moved (update_shares), name, bytes and rank
    streamed = {(key, t.numel() * t.element_size(), r) for r, res in enumerate(results) for key, t in res["shares"].items()}
    assert all(set(res["planned"]) == streamed for res in results)
    sparse = (0, 2)
    assert {n for n in every if ".experts." in n} == {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
                                                      for i in sparse for e in range(4) for p in ("gate", "up", "down")}
    if pp == 2:  # each stage shares out its own layers: stage 0 layers 0-1, stage 1 layers 2-3
        for r in range(world // 2, world):
            assert {int(n.split("layers.")[1].split(".")[0]) for n in shares[r] if "layers." in n} <= {2, 3}


def test_moe_flags_are_checked_against_config_json(tmp_path):
    from rlplacement.backends.preflight import preflight
    from rlplacement.errors import ConfigError

    hf = str(make_tiny_model(tmp_path / "hf", SPEC))
    dense = str(make_tiny_model(tmp_path / "dense", TinySpec()))

    def refused(message, **fields):
        with pytest.raises(ConfigError, match=message):
            preflight(BackendConfig(**{"name": "megatron", "hf_checkpoint": hf, **fields}))

    preflight(BackendConfig(name="megatron", hf_checkpoint=hf, moe=MoEConfig(num_experts=4, router_topk=2,
                                                                             ffn_hidden_size=64)))
    refused(r"--num-experts 8 differs from .*config.json's num_experts 4: the architecture comes from config.json",
            moe=MoEConfig(num_experts=8))
    refused(r"--moe-router-topk 1 differs from .*num_experts_per_tok 2", moe=MoEConfig(router_topk=1))
    refused(r"--moe-ffn-hidden-size 32 differs from .*moe_intermediate_size 64", moe=MoEConfig(ffn_hidden_size=32))
    refused(r"--expert-model-parallel-size 3 does not divide num_experts 4", expert_model_parallel_size=3)
    refused(r"--expert-tensor-parallel-size 1 with --tensor-model-parallel-size 2: experts run at the dense layers' "
            r"tensor parallelism", tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1)
    refused(r"--tensor-model-parallel-size 2 with a mixture-of-experts model: megatron trains MoE layers under tensor "
            r"parallelism only with --sequence-parallel", tensor_model_parallel_size=2)
    refused(r"--num-experts and the other MoE flags configure a mixture-of-experts model; .* is the dense qwen3",
            hf_checkpoint=dense, moe=MoEConfig(num_experts=4))
    # megatron's own defaults of the others (what a Megatron parser carrying these flags sets) do nothing there
    preflight(BackendConfig(name="megatron", hf_checkpoint=dense, moe=MoEConfig(router_topk=2, aux_loss_coeff=0.0)))
    refused(r"--expert-model-parallel-size 2: expert parallelism needs a mixture-of-experts model, and .* is the dense",
            hf_checkpoint=dense, expert_model_parallel_size=2)


def _bf16_step(rank, world, hf):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.config import TrainConfig
    from rlplacement.transfer.spec import OWN_GPU, SHARES

    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf, expert_model_parallel_size=2,
                                                        moe=MoEConfig(token_dispatcher_type="alltoall")),
                                          SGD, TrainConfig(bf16=True))
    batch = random_batch(SPEC.vocab_size, seed=10 + rank)
    logp = backend.log_probs(batch)
    metrics = backend.train_step(batch)
    streams = {share: {n: t.clone() for n, t in backend.iter_update_tensors(share)} for share in (SHARES, OWN_GPU)}
    backend.close()
    return {"logp": logp, "metrics": metrics, **streams}


@pytest.mark.slow
def test_megatron_moe_trains_in_bf16_under_expert_parallelism(tmp_path):
    """``--bf16`` (fp32 main weights in megatron's optimizer, bf16 compute) at EP=2: log-probs within bf16's
    reach of the fp32 HF model's, the step's gradient norm within 2% of the fp32 reference step's, bf16
    streamed, and each rank's share (its pieces, its own experts) equal to that part of what every rank hands
    its own GPU's worker."""
    from rlplacement.transfer.pieces import parse_piece
    from rlplacement.transfer.spec import OWN_GPU, SHARES

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    results = launch.spawn(_bf16_step, 2, str(hf), timeout_s=300)
    ref = load_hf(hf)
    batches = [random_batch(SPEC.vocab_size, seed=10 + r) for r in range(2)]
    for r, res in enumerate(results):
        assert (res["logp"] - hf_log_probs(ref, batches[r].input_ids)).abs().max().item() <= 2e-2
        assert {t.dtype for t in res[OWN_GPU].values()} == {torch.bfloat16}
        for key, t in res[SHARES].items():
            name, box, _ = parse_piece(key) or (key, None, None)
            whole = results[0][OWN_GPU][name]
            assert t.dtype == torch.bfloat16 and torch.equal(
                t, whole if box is None else whole[tuple(slice(a, b) for a, b in box)]), key
    assert all(torch.equal(t, results[1][OWN_GPU][n]) for n, t in results[0][OWN_GPU].items())
    expected = hf_reference_step(ref, batches, SGD)["grad_norm"]
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(expected, rel=2e-2)
