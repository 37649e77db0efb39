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
