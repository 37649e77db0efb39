"""A mixture-of-experts model (Qwen3-MoE) colocated (``--colocate``, ``cuda_ipc``: /dev/shm here): an FSDP
trainer of two ranks and a TP=2 vLLM CPU engine on the same two logical GPUs, through ``RLJob``; each worker
takes every update, experts under their per-expert checkpoint names, from the trainer rank on its own GPU,
every update checked tensor by tensor, and the engine samples with the trainer's log-probs."""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from tests.test_moe_job import SPEC  # noqa: E402
from tests.transfer_helpers.tiny_job import (assert_engine_samples_match_trainer, tiny_job,  # noqa: E402
                                             two_sample_batch)

pytestmark = pytest.mark.slow


def test_colocated_moe_updates_are_bit_exact_and_sampled_with_the_trainers_experts(tmp_path_factory):
    with tiny_job(tmp_path_factory, [
            "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
            "--rollout-num-gpus-per-engine", "2", "--num-gpus-per-node", "2", "--train-backend", "fsdp",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--check-weight-update-equal"],
            timeout_s=180, spec=SPEC) as job:
        assert job.transfer_mode == "cuda_ipc"
        for seed in (1, 2):
            job.train(two_sample_batch(seed))
            result = job.update_weights()
            assert result.checked and job.served_versions() == [job.version]
        assert any(".mlp.experts.3.down_proj.weight" in name for name in result.trainer.checksums)
        assert_engine_samples_match_trainer(job, ["the quick brown fox", "one two three"])
