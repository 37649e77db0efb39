"""``--colocate`` across nodes, through ``RLJob`` on a real two-node Ray cluster (``ray.cluster_utils.Cluster``:
two raylets of one logical GPU each, so node boundaries are Ray's own): an FSDP trainer of two ranks, one on
each node, and a vLLM CPU engine on each rank's GPU. Each engine lands on its trainer rank's node and GPU, its
worker takes every update from that rank alone (``cuda_ipc``; /dev/shm here), every update is checked tensor
by tensor, and the engines generate with the new version."""

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.transfer.spec import OWN_GPU  # noqa: E402
from tests.transfer_helpers.tiny_job import tiny_job, two_sample_batch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.transfer_helpers.cluster import REPO, two_node_ray

    with two_node_ray(gpus_per_node=1, runtime_env={"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}}):
        with tiny_job(tmp_path_factory, [
                "--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
                "--rollout-num-gpus-per-engine", "1", "--train-backend", "fsdp", "--n-samples-per-prompt", "2",
                "--rollout-max-response-len", "4", "--check-weight-update-equal"], timeout_s=240) as started:
            yield started


def _node_and_gpu(actor) -> tuple[str, str | None]:
    """The Ray node an actor runs on and the GPUs its process sees."""
    return ray.get(actor.__ray_call__.remote(
        lambda self: (ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES"))), timeout=60)


def test_each_engine_sits_on_its_trainer_ranks_node_and_gpu(job):
    layout = job.placement.layout
    assert layout.colocate and layout.num_nodes == 2 and len(layout.engines) == 2
    nodes = [job.placement.node_id_of[gpu[0]] for gpu in layout.trainer_gpus]
    assert len(set(nodes)) == 2
    for index, engine_gpus in enumerate(layout.engines):
        assert engine_gpus == (layout.trainer_gpus[index],)
        assert job.placement.engine_node(index) == nodes[index]
        where, trainer = _node_and_gpu(job.engines[index]), _node_and_gpu(job.trainers[index])
        assert where == trainer and where[0] == nodes[index], (index, where, trainer)


def test_each_worker_reads_the_trainer_rank_on_its_own_node_and_gpu_and_serves_every_update(job):
    assert job.update_share == OWN_GPU and job.sender_ranks == [0, 1]
    for seed in (1, 2):
        job.train(two_sample_batch(seed))
        result = job.update_weights()  # checked: every tensor equal to the trainer's, on both engines
        assert result.checked and job.served_versions() == [job.version, job.version]
        report = result.trainer
        assert report.bytes_per_sender == (report.bytes, report.bytes) and report.bytes > 0
        for engine in job.engines:
            (path,) = ray.get(engine.call_workers.remote("rlplacement_load_path"), timeout=60)
            assert set(path["read_from"]) == {path["gpu"]} and path["read_from"][path["gpu"]] >= report.bytes, path
    out = job.generate([[5, 6, 7, 8]], max_tokens=3, exact_lengths=True)
    assert len(out) == 2 and all(len(s.token_ids) == 3 and s.weight_version == job.version for s in out)
