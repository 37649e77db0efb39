"""FSDP2 trains a mixture-of-experts model (Qwen3-MoE, transformers' own MoE blocks): two gloo ranks, each
holding half the experts of every sparse layer, take one step equal to the HF reference's, and stream the
experts under the checkpoint's per-expert names."""

import pytest

from rlplacement.config import OptimConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.reference_checks import check_two_ranks_match_hf_reference

# the middle layer dense (mlp_only_layers), the others sparse: 4 experts, top-2
SPEC = TinySpec(family="qwen3_moe", num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                mlp_only_layers=(1,))
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


@pytest.mark.slow
def test_fsdp_two_ranks_moe_step_matches_hf_reference(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    check_two_ranks_match_hf_reference("fsdp", hf, tmp_path, SGD, vocab=SPEC.vocab_size, seed=10)


@pytest.mark.slow
def test_fsdp_moe_trains_the_router_load_balancing_loss_when_the_config_asks(tmp_path):
    """``output_router_logits`` on: each micro-batch's HF load-balancing loss times ``router_aux_loss_coef``
    joins the loss, token-weighted; the two ranks' step equals the HF reference's with the same loss, and
    differs from the step without it (the loss moves the routers)."""
    import dataclasses

    from rlplacement.backends.hf_reference import hf_reference_step, load_hf, random_batch

    hf = make_tiny_model(tmp_path / "hf", dataclasses.replace(SPEC, router_aux_loss_coef=0.5))
    check_two_ranks_match_hf_reference("fsdp", hf, tmp_path, SGD, vocab=SPEC.vocab_size, seed=10)
    batches = [random_batch(SPEC.vocab_size, seed=10 + r) for r in range(2)]
    with_router = hf_reference_step(load_hf(hf), batches, SGD)["grad_norm"]
    plain = load_hf(hf)
    plain.config.output_router_logits = False
    assert hf_reference_step(plain, batches, SGD)["grad_norm"] != pytest.approx(with_router, rel=1e-3)


def _moe_streams(rank, world, hf):
    import torch

    from rlplacement.backends import make_backend
    from rlplacement.config import BackendConfig
    from rlplacement.transfer.spec import RANK0, SHARES

    backend = make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf), SGD, stream_dtype=torch.bfloat16)
    out = {share: {n: t.clone() for n, t in backend.iter_update_tensors(share)} for share in (RANK0, SHARES)}
    return {**out, "gathered": backend.last_stream_gathered_bytes, "planned": backend.update_shares()}


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp_ranks_send_their_own_experts_whole_and_their_rows_of_the_rest(tmp_path, world):
    """Where every rank sends, each FSDP rank sends the experts FSDP2 gave it (a fused experts parameter is
    sharded by expert) whole under the checkpoint's per-expert names, and its rows of every other tensor as
    pieces: nothing gathered, every tensor exactly once, bit-exact with rank 0's whole stream, as planned.
    Three ranks split 4 experts 2, 2, 0."""
    import torch

    from rlplacement.backends import launch
    from rlplacement.transfer.pieces import parse_piece
    from rlplacement.transfer.plan.tensors import ModelTensors
    from rlplacement.transfer.plan.trainer_shards import fsdp_holdings
    from rlplacement.transfer.spec import RANK0, SHARES

    hf = make_tiny_model(tmp_path / "hf", SPEC)
    got = launch.spawn(_moe_streams, world, str(hf), timeout_s=300)
    whole = got[0][RANK0]
    rebuilt, covered = {n: torch.zeros_like(t) for n, t in whole.items()}, {n: 0 for n in whole}
    for r in range(world):
        assert got[r]["gathered"] == 0
        for key, t in got[r][SHARES].items():
            parsed = parse_piece(key)
            if parsed is None:
                assert ".mlp.experts." in key, key  # only experts go whole
                rebuilt[key].copy_(t)
            else:
                assert ".mlp.experts." not in key, key
                rebuilt[parsed[0]][parsed[1][0][0]:parsed[1][0][1]] = t
            covered[parsed[0] if parsed else key] += t.numel()
    assert covered == {n: t.numel() for n, t in whole.items()}
    assert all(torch.equal(rebuilt[n], whole[n]) for n in whole)
    experts_of = [{k.split(".mlp.experts.")[1].split(".")[0] for k in got[r][SHARES] if ".mlp.experts." in k}
                  for r in range(world)]
    assert experts_of == ([{"0", "1"}, {"2", "3"}] + [set()] * (world - 2))
    streamed = {(key, r): t.numel() * 2 for r in range(world) for key, t in got[r][SHARES].items()}
    assert {(key, r): nbytes for key, nbytes, r in got[0]["planned"]} == streamed
    # the transfer plan's FSDP holdings are the same: each expert whole on its rank, rows of the rest
    held = fsdp_holdings(ModelTensors.from_hf_config(str(hf / "config.json")), world)
    assert {(n, r) for r in range(world) for n in held[r] if ".mlp.experts." in n} == {
        (key, r) for (key, r) in streamed if ".mlp.experts." in key}
