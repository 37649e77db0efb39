"""Colocated (``--colocate``, ``cuda_ipc``: /dev/shm here) with an FSDP trainer of two ranks and a TP=2 vLLM CPU
engine on the same two logical GPUs, through ``RLJob``: each engine worker takes every update from the trainer
rank on its own GPU and reads no byte of another GPU's trainer memory (bytes per source GPU asserted), every
update checked tensor by tensor; a failure on one rank's stream leaves the engine serving its previous version
on both workers, and the next update lands."""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.errors import WeightUpdateError  # noqa: E402
from rlplacement.transfer.spec import OWN_GPU  # noqa: E402
from tests.transfer_helpers.tiny_job import tiny_job, two_sample_batch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with tiny_job(tmp_path_factory, [
            "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
            "--rollout-num-gpus-per-engine", "2", "--num-gpus-per-node", "2", "--train-backend", "fsdp",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--check-weight-update-equal"],
            timeout_s=180) as started:
        yield started


def _load_paths(job) -> list[dict]:
    return ray.get(job.engines[0].call_workers.remote("rlplacement_load_path"), timeout=60)


def test_each_worker_reads_only_the_trainer_rank_on_its_own_gpu(job):
    assert job.update_share == OWN_GPU and job.sender_ranks == [0, 1]
    for seed in (1, 2):
        job.train(two_sample_batch(seed))
        result = job.update_weights()  # checked: every tensor equal to the trainer's, on both workers
        assert result.checked and job.served_versions() == [job.version]
        report = result.trainer
        # each rank sent the whole model once; the report counts the update once
        assert report.bytes_per_sender == (report.bytes, report.bytes) and report.bytes > 0
        paths = _load_paths(job)
        gpus = [p["gpu"] for p in paths]
        assert len(set(gpus)) == 2 and all(gpus), gpus
        for p in paths:  # every byte read came from the trainer memory on the worker's own GPU
            assert set(p["read_from"]) == {p["gpu"]}, paths
            assert p["read_from"][p["gpu"]] >= report.bytes


def test_a_failed_rank_leaves_the_engine_on_its_version_and_the_next_update_lands(job):
    job.train(two_sample_batch(3))
    before = job.served_versions()
    ray.get(job.trainers[1].inject_update_fault.remote(1, "injected gather failure on rank 1"), timeout=60)
    with pytest.raises(WeightUpdateError, match="injected gather failure on rank 1"):
        job.update_weights()
    assert job.served_versions() == before  # worker 0's group finished, yet neither worker loaded it
    result = job.update_weights()  # the job rebuilds both groups and sends the weights again
    assert result.checked and job.served_versions() == [job.version] and job.version > before[0]
    out = job.generate([[5, 6, 7, 8]], max_tokens=3, exact_lengths=True)
    assert len(out) == 2 and all(len(s.token_ids) == 3 and s.weight_version == job.version for s in out)
