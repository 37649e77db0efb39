"""FSDP2 backend over two real gloo processes: one step on each rank's share equals the HF reference."""

import pytest
import torch

from rlplacement.args import BackendConfig
from rlplacement.backends import launch
from rlplacement.backends.base import OptimConfig
from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.reference_checks import assert_streamed_match_reference, step_and_share_stream

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


def _worker(rank, world, hf, streamed_path):
    from rlplacement.backends import make_backend

    backend = make_backend(BackendConfig("fsdp", hf, None, 1, 1), SGD)
    batch = random_batch(SPEC.vocab_size, seed=10 + rank)  # each rank its own data-parallel share
    logp, metrics, streamed = step_and_share_stream(backend, batch, streamed_path, rank)
    mismatched = [n for n, p in backend.model.named_parameters()
                  if not torch.equal(p.to_local(), streamed[n].chunk(world, 0)[rank])]
    return {"logp": logp, "metrics": metrics, "mismatched": mismatched}


@pytest.mark.slow
def test_fsdp_two_ranks_step_matches_hf_reference(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    results = launch.spawn(_worker, 2, str(hf), str(tmp_path / "streamed.pt"), timeout_s=300)
    ref = load_hf(hf)
    batches = [random_batch(SPEC.vocab_size, seed=10 + r) for r in range(2)]
    for r, res in enumerate(results):
        assert (res["logp"] - hf_log_probs(ref, batches[r].input_ids)).abs().max().item() <= 1e-5
        assert res["mismatched"] == [], "streamed tensors differ from the shards FSDP holds"
    ref_metrics = hf_reference_step(ref, batches, SGD)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    assert_streamed_match_reference(tmp_path / "streamed.pt", ref)
