"""Megatron at TP=2 in two real gloo processes: convert, reshard TP=2 <-> TP=1, logits and one step vs HF."""

import pytest
import torch
import torch.distributed as dist

from rlplacement.config import BackendConfig, OptimConfig
from rlplacement.backends import launch
from rlplacement.families import megatron_mapping as mapping
from rlplacement.backends.hf_reference import hf_log_probs, hf_reference_step, load_hf, random_batch
from rlplacement.cli import main
from rlplacement.models.tiny import TinySpec, make_tiny_model
from tests.reference_checks import assert_streamed_match_reference
from tests.test_convert import assert_same_tensors

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


def _tp2_worker(rank, world, hf, td2, td1, out_from_td1, streamed_path):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.convert.hf_to_megatron import convert
    from rlplacement.convert.megatron_to_hf import export

    assert convert(hf, td2, tp=2, progress=False) == "converted"
    export(td1, out_from_td1, tp=2)  # a TP=1 checkpoint read at TP=2
    backend = MegatronBackend.from_config(BackendConfig(name="megatron", load=td2, tensor_model_parallel_size=2), SGD)
    batch = random_batch(SPEC.vocab_size, seed=3)
    logp = backend.log_probs(batch)
    metrics = backend.train_step(batch)
    streamed = dict(backend.iter_hf_tensors())
    if rank == 0:
        torch.save(streamed, streamed_path)
    dist.barrier()
    streamed = torch.load(streamed_path)
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    mismatched = []
    for mname, held in backend.local_megatron_parameters():
        full = mapping.hf_to_megatron(mname, streamed.__getitem__, backend.shape, backend.family)
        shard = mapping.tp_shard(mname, full, mapping.tp_partition_dim(mname), 2, tp_rank)
        if not torch.equal(shard, held):
            mismatched.append(mname)
    backend.close()
    return {"logp": logp, "metrics": metrics, "mismatched": mismatched}


@pytest.mark.slow
def test_tp2_convert_reshard_logits_and_step(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", SPEC)
    assert main(["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "td1"), "--no-progress"]) == 0
    results = launch.spawn(_tp2_worker, 2, str(hf), str(tmp_path / "td2"), str(tmp_path / "td1"),
                           str(tmp_path / "out_td1_at_tp2"), str(tmp_path / "streamed.pt"), timeout_s=300)
    # TP=1 checkpoint read at TP=2, and TP=2 checkpoint read at TP=1: both give back the HF bytes
    assert_same_tensors(hf, tmp_path / "out_td1_at_tp2")
    assert main(["export-hf", "--load", str(tmp_path / "td2"), "--save", str(tmp_path / "out_td2")]) == 0
    assert_same_tensors(hf, tmp_path / "out_td2")

    ref = load_hf(hf)
    batch = random_batch(SPEC.vocab_size, seed=3)
    expected_logp = hf_log_probs(ref, batch.input_ids)
    for r in results:
        assert (r["logp"] - expected_logp).abs().max().item() <= 1e-5
        assert r["mismatched"] == [], "streamed tensors differ from the shards the backend holds"
    ref_metrics = hf_reference_step(ref, [batch], SGD)
    assert results[0]["metrics"]["loss"] == pytest.approx(ref_metrics["loss"], abs=1e-5)
    assert results[0]["metrics"]["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
    assert_streamed_match_reference(tmp_path / "streamed.pt", ref)
