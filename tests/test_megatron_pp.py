"""Megatron at PP=2 in two real gloo processes (tied embeddings on both stages): convert, reshard
PP=2 -> PP=1, log-probs and one step vs HF, streamed tensors equal to what each stage holds."""

import pytest
import torch
import torch.distributed as dist

from rlplacement.config import BackendConfig, OptimConfig
from rlplacement.backends import launch
from rlplacement.families import megatron_mapping as mapping
from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch
from rlplacement.cli import main
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.test_convert import assert_same_tensors

SPEC = TinySpec(family="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


def _pp2_worker(rank, world, hf, td, streamed_path):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.convert.hf_to_megatron import convert

    assert convert(hf, td, tp=1, pp=2, progress=False) == "converted"
    backend = MegatronBackend.from_config(BackendConfig(name="megatron", load=td, pipeline_model_parallel_size=2), SGD)
    batch = random_batch(SPEC.vocab_size, seed=7)
    logp = backend.log_probs(batch)
    metrics = backend.train_step(batch)
    streamed = dict(backend.iter_hf_tensors())
    assert (len(streamed) > 0) == (rank == 0)
    if rank == 0:
        torch.save(streamed, streamed_path)
    dist.barrier()
    streamed = torch.load(streamed_path)
    held = backend.local_megatron_parameters()
    mismatched = [m for m, t in held
                  if not torch.equal(mapping.hf_to_megatron(m, streamed.__getitem__, backend.shape, backend.family), t)]
    backend.close()
    return {"logp": logp, "metrics": metrics, "mismatched": mismatched, "held": [m for m, _ in held]}


@pytest.mark.slow
def test_pp2_convert_logits_and_step(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    results = launch.spawn(_pp2_worker, 2, str(hf), str(tmp_path / "td"), str(tmp_path / "streamed.pt"),
                           timeout_s=300)
    assert "decoder.layers.1.mlp.linear_fc2.weight" in results[1]["held"]  # stage 1 holds the global layer 1
    assert "output_layer.weight" in results[1]["held"] and "embedding.word_embeddings.weight" in results[0]["held"]
    assert main(["export-hf", "--load", str(tmp_path / "td"), "--save", str(tmp_path / "out")]) == 0
    assert_same_tensors(hf, tmp_path / "out")

    ref = load_hf(hf)
    batch = random_batch(SPEC.vocab_size, seed=7)
    expected_logp = hf_log_probs(ref, batch.input_ids)
    for r in results:
        assert (r["logp"] - expected_logp).abs().max().item() <= 1e-5
        assert r["mismatched"] == [], "streamed tensors differ from what the stages hold"
    ref_metrics = hf_reference_step(ref, [batch], SGD)
    for r in results:
        assert r["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
        assert r["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    streamed = torch.load(tmp_path / "streamed.pt")
    expected = dict(ref.named_parameters())
    assert set(streamed) == set(expected)
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, expected[name].detach(), atol=2e-6, rtol=1e-5, msg=name)
