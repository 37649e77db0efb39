"""Weight transfer into real vLLM CPU engines (Ray actors): broadcast, broadcast_packed and p2p
(Mooncake over loopback TCP), 1 and 2 engines, failures.

One module-wide cluster: a trainer actor holding a real HF model and two engines, started once
(engine start-up dominates). Tests run in file order and each one brings the engines to a state
it checks; the engine-kill tests go last: each starts a new engine (booting while the kill runs),
kills engine 1 mid-update and puts the new one in its place.
"""


import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402
from tests.transfer_helpers.cluster import (  # noqa: E402
    BUCKET, PROMPTS, TIMEOUT_S, cluster_fixture, outputs, start_replacement_engine)
from tests.transfer_helpers.killing import kill_engine_mid_update  # noqa: E402
from rlplacement.transfer.base import WeightUpdateError  # noqa: E402

pytestmark = pytest.mark.slow

# tied embeddings (as Qwen3-0.6B..4B): the head must follow the embedding; the IPC and loop tests cover untied
cluster = cluster_fixture(TinySpec(tie_word_embeddings=True))


def _connect(cluster, mode, engines, *, check_equal=True, timeout_s=TIMEOUT_S):
    trainer = cluster["trainer"]
    ray.get(trainer.transfer_setup.remote(mode, BUCKET, check_equal=check_equal, timeout_s=timeout_s))
    driver.connect(trainer, engines, timeout_s=TIMEOUT_S)


def _update(cluster, mode, engines, *, seed, check_equal=True, timeout_s=TIMEOUT_S, connect=True):
    """Connect ``engines`` in ``mode``, perturb the trainer, send the next version; return it."""
    trainer = cluster["trainer"]
    if connect:
        _connect(cluster, mode, engines, check_equal=check_equal, timeout_s=timeout_s)
    if seed is not None:
        ray.get(trainer.perturb.remote(seed))
    version = cluster["version"] + 1
    cluster["version"] = version  # burnt even if the update fails: an engine may already serve it
    driver.run_update(trainer, engines, version, timeout_s=timeout_s, check_equal=check_equal)
    return version


@pytest.mark.parametrize("mode,n_engines", [("broadcast", 1), ("broadcast", 2),
                                            ("broadcast_packed", 1), ("broadcast_packed", 2),
                                            ("p2p", 1), ("p2p", 2)])  # p2p: real Mooncake over loopback TCP
def test_update_lands_bit_exact(cluster, mode, n_engines):
    engines = cluster["engines"][:n_engines]
    before = ray.get([e.generate.remote(PROMPTS, max_tokens=6) for e in engines])
    version = _update(cluster, mode, engines, seed=cluster["version"] + 1)
    want = ray.get(cluster["trainer"].checksums.remote())
    for i, engine in enumerate(engines):
        assert ray.get(engine.weight_version.remote()) == version
        got = ray.get(engine.received_checksums.remote())
        assert got == want, f"engine {i}: tensors differ from the trainer's"
        after = ray.get(engine.generate.remote(PROMPTS, max_tokens=6))
        assert [r["weight_version"] for r in after] == [version] * len(PROMPTS)
        assert [r["logprobs"].tolist() for r in after] != [r["logprobs"].tolist() for r in before[i]]  # the weights really changed


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed"])
def test_staging_let_go_before_a_sleep_is_rebuilt_and_the_next_update_is_bit_exact(cluster, mode):
    """What a sleeping colocated engine frees (--offload-rollout): the kept staging buffers."""
    engines = cluster["engines"]
    _update(cluster, mode, engines, seed=cluster["version"] + 1)
    freed = ray.get([e.call_workers.remote("rlplacement_release_staging") for e in engines])
    assert all(b > 0 for per_worker in freed for b in per_worker), freed
    assert ray.get([e.call_workers.remote("rlplacement_release_staging") for e in engines]) == [[0], [0]]  # nothing left
    version = _update(cluster, mode, engines, seed=cluster["version"] + 1, connect=False)
    want = ray.get(cluster["trainer"].checksums.remote())
    assert ray.get([e.weight_version.remote() for e in engines]) == [version, version]
    assert all(got == want for got in ray.get([e.received_checksums.remote() for e in engines]))


def test_p2p_five_versions_bit_exact_into_two_engines(cluster):
    engines, trainer = cluster["engines"], cluster["trainer"]
    _connect(cluster, "p2p", engines)
    for step in range(5):
        version = _update(cluster, "p2p", engines, seed=500 + step, connect=False)
        want = ray.get(trainer.checksums.remote())
        assert ray.get([e.weight_version.remote() for e in engines]) == [version, version]
        assert all(got == want for got in ray.get([e.received_checksums.remote() for e in engines]))


def test_updated_engines_match_a_fresh_engine_from_the_same_weights(cluster):
    """Also through the prefix cache: a long prompt generated before the update must not reuse the KV
    computed with the old weights afterwards."""
    e0, e1 = cluster["engines"]
    trainer = cluster["trainer"]
    long_prompt = [(7 * i) % 250 + 3 for i in range(200)]  # whole cache blocks of it are kept
    ray.get([e.generate.remote([long_prompt], max_tokens=2) for e in (e0, e1)])
    ray.get(trainer.perturb.remote(1234))
    version = cluster["version"] + 1
    # same weights, one mode each; then both take them again over p2p as the next version
    for mode, engines, v in (("broadcast", [e0], version), ("broadcast_packed", [e1], version),
                             ("p2p", [e0, e1], version + 1)):
        ray.get(trainer.transfer_setup.remote(mode, BUCKET, check_equal=True, timeout_s=TIMEOUT_S))
        driver.connect(trainer, engines, timeout_s=TIMEOUT_S)
        driver.run_update(trainer, engines, v, timeout_s=TIMEOUT_S, check_equal=True)
    cluster["version"] = version + 1
    saved = ray.get(trainer.save_hf.remote(str(cluster["tmp"] / "step")))
    fresh = create_engine_actor(9, saved)
    try:
        ref = ray.get(fresh.generate.remote(PROMPTS + [long_prompt], max_tokens=8))
        ref_sums = ray.get(fresh.model_checksums.remote())
        for engine in (e0, e1):
            got = ray.get(engine.generate.remote(PROMPTS + [long_prompt], max_tokens=8))
            assert [r["token_ids"].tolist() for r in got] == [r["token_ids"].tolist() for r in ref]
            assert [r["logprobs"].tolist() for r in got] == [r["logprobs"].tolist() for r in ref]  # exactly, not approximately
            assert ray.get(engine.model_checksums.remote()) == ref_sums
    finally:
        ray.kill(fresh)


@pytest.mark.parametrize("fail_at", [0, 7])  # 0: refused before the first tensor (e.g. weights offloaded)
def test_trainer_abort_leaves_every_engine_on_the_old_version(cluster, fail_at):
    engines, trainer = cluster["engines"], cluster["trainer"]
    old = ray.get([e.weight_version.remote() for e in engines])  # a failed update before this one burnt its number
    before = [outputs(e, PROMPTS, 6) for e in engines]
    ray.get(trainer.set_fail_after.remote(fail_at))
    try:
        with pytest.raises(WeightUpdateError, match=f"simulated gather failure at tensor {fail_at}") as info:
            _update(cluster, "broadcast_packed", engines, seed=77 + fail_at)
        assert {"engine 0", "engine 1", "trainer"} == set(info.value.failures)
        # every engine raised the abort itself: none was still waiting for bytes when the driver gave up
        assert not any(("no answer" in str(f) or "did not finish" in str(f)) for f in info.value.failures.values()), \
            info.value.failures
    finally:
        ray.get(trainer.set_fail_after.remote(None))
    assert ray.get([e.weight_version.remote() for e in engines]) == old
    assert [outputs(e, PROMPTS, 6) for e in engines] == before


def test_receiver_failing_mid_update_leaves_no_engine_half_updated(cluster):
    e0, e1 = cluster["engines"]
    old = ray.get(e1.weight_version.remote())
    old_out = outputs(e1, PROMPTS, 6)
    _connect(cluster, "broadcast", [e0, e1], timeout_s=15)
    ray.get(e1.call_workers.remote("hook_fail_receive_after_buckets", 2))
    with pytest.raises(WeightUpdateError, match="engine 1: .*injected receiver fault after 2 buckets"):
        _update(cluster, "broadcast", [e0, e1], seed=88, timeout_s=15, connect=False)
    new = cluster["version"]
    v0, v1 = ray.get([e0.weight_version.remote(), e1.weight_version.remote()])
    assert v1 == old and outputs(e1, PROMPTS, 6) == old_out
    assert v0 in (old, new)
    if v0 == new:  # engine 0 finished: it holds exactly the trainer's tensors
        assert ray.get(e0.received_checksums.remote()) == ray.get(cluster["trainer"].checksums.remote())
    # a new group brings both engines to the next version
    version = _update(cluster, "broadcast", [e0, e1], seed=None)
    assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [version, version]
    assert outputs(e1, PROMPTS, 6) == outputs(e0, PROMPTS, 6)


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed", "p2p"])
def test_a_corrupted_byte_reaches_the_driver_naming_the_tensor(cluster, mode):
    """The engine's WeightMismatchError crosses vLLM's RPC and Ray whole: the driver's error names
    the engine and the tensor, and the engine stays on its version."""
    e0 = cluster["engines"][0]
    old = ray.get(e0.weight_version.remote())
    _connect(cluster, mode, [e0])
    ray.get(e0.call_workers.remote("hook_flip_first_byte_of_next_update"))
    with pytest.raises(WeightUpdateError, match=r"engine 0: .*weight mismatch.*tensor 'model\.embed_tokens\.weight'"):
        _update(cluster, mode, [e0], seed=55, connect=False)
    assert ray.get(e0.weight_version.remote()) == old
    version = _update(cluster, mode, [e0], seed=None)  # the next update lands
    assert ray.get(e0.weight_version.remote()) == version


def _connect_staged(cluster, mode, staging_by_engine: dict, **setup):
    """One group of ``mode`` in which each engine takes updates under its own ``--update-weight-staging``."""
    trainer = cluster["trainer"]
    engines = list(staging_by_engine)
    ray.get(trainer.transfer_setup.remote(mode, BUCKET, check_equal=True, timeout_s=TIMEOUT_S, **setup))
    infos = driver.engine_infos(engines, TIMEOUT_S)
    endpoint = ray.get(trainer.transfer_listen.remote(driver.group_size(infos)))
    refs, offset = {"trainer": trainer.transfer_connect.remote()}, 1
    for i, (engine, info) in enumerate(zip(engines, infos)):
        refs[f"engine {i}"] = engine.init_transfer.remote(endpoint, offset, staging_by_engine[engine])
        offset += info["num_workers"]
    driver.wait_all(refs, TIMEOUT_S)


def _load_path(engine) -> dict:
    return ray.get(engine.call_workers.remote("rlplacement_load_path"))[0]


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed", "p2p"])
def test_bucket_staging_serves_what_full_staging_serves_over_versions(cluster, mode):
    """Engine 1 loads each bucket as it arrives and keeps two buckets; engine 0 stages the whole update:
    over three versions both serve the same tokens and log-probs, exactly, and hold the trainer's bytes."""
    e0, e1 = cluster["engines"]
    _connect_staged(cluster, mode, {e0: "full", e1: "bucket"})
    model_bytes = sum(ray.get(cluster["trainer"].tensor_bytes.remote()).values())
    for _ in range(3):
        version = _update(cluster, mode, [e0, e1], seed=cluster["version"] + 300, connect=False)
        assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [version, version]
        assert outputs(e1, PROMPTS, 6) == outputs(e0, PROMPTS, 6)
        assert ray.get(e1.received_checksums.remote()) == ray.get(cluster["trainer"].checksums.remote())
    full, bucket = _load_path(e0), _load_path(e1)
    assert (full["staging"], bucket["staging"], bucket["path"]) == ("full", "bucket", "bucketwise")
    assert full["staging_bytes"] >= model_bytes  # the whole model, kept between updates
    largest = max(BUCKET, max(ray.get(cluster["trainer"].fused_group_bytes.remote()).values()))
    assert bucket["staging_bytes"] <= 2 * largest < model_bytes / 2
    # buckets are cut between vLLM's layers; only the embedding waits for the end: vLLM pads its 300 rows to
    # 320, so the layer never counts as whole and is processed when the update finishes
    assert bucket["copied_out"] == 1


def test_a_layer_split_across_buckets_is_copied_out_of_the_bucket_and_lands(cluster):
    """A sender that cuts buckets inside vLLM's fused layers (q/k/v in two buckets): what vLLM keeps of the
    part-loaded layer is copied out of the bucket before its memory is reused, and the engine still serves
    exactly what full staging serves."""
    e0, e1 = cluster["engines"]
    _connect_staged(cluster, "broadcast_packed", {e0: "full", e1: "bucket"}, group_of=_each_tensor_alone)
    _update(cluster, "broadcast_packed", [e0, e1], seed=cluster["version"] + 400, connect=False)
    assert outputs(e1, PROMPTS, 6) == outputs(e0, PROMPTS, 6)
    assert _load_path(e1)["copied_out"] > 1  # the embedding's (see above), and parts of fused layers


def _each_tensor_alone(name: str) -> str:
    return name


@pytest.mark.parametrize("after_buckets", [0, 3])
def test_a_failure_at_bucket_k_under_bucket_staging(cluster, after_buckets):
    """At bucket 0 nothing reached the model: the previous version is still served. After bucket 3 the
    weights are a mix: the engine refuses to generate, naming the flag, until a whole update lands."""
    from rlplacement.errors import WeightsUnavailableError

    e0, e1 = cluster["engines"]
    _connect_staged(cluster, "broadcast", {e0: "full", e1: "bucket"})
    old = ray.get(e1.weight_version.remote())
    old_out = outputs(e1, PROMPTS, 6)
    ray.get(e1.call_workers.remote("hook_fail_bucketwise_load_after_buckets", after_buckets))
    with pytest.raises(WeightUpdateError, match=f"engine 1: .*injected load fault after {after_buckets} buckets"):
        _update(cluster, "broadcast", [e0, e1], seed=cluster["version"] + 500, connect=False)
    if after_buckets == 0:
        assert ray.get(e1.weight_version.remote()) == old and outputs(e1, PROMPTS, 6) == old_out
    else:
        with pytest.raises(WeightsUnavailableError,
                           match=r"engine 1 cannot generate: version \d+ was being loaded bucket by bucket "
                                 r"\(--update-weight-staging bucket\) and did not complete.*"
                                 r"start with --update-weight-staging full"):
            ray.get(e1.generate.remote(PROMPTS, max_tokens=6), timeout=120)
    _connect_staged(cluster, "broadcast", {e0: "full", e1: "bucket"})  # a failed update leaves the group unusable
    version = _update(cluster, "broadcast", [e0, e1], seed=None, connect=False)
    assert ray.get(e1.weight_version.remote()) == version
    assert outputs(e1, PROMPTS, 6) == outputs(e0, PROMPTS, 6)


def test_an_engine_that_stops_answering_is_named_within_the_timeout(cluster):
    """A receiver that hangs (not dies): the driver gives up after its timeout naming every party that
    did not answer, no engine serves a mix of versions, and a new group carries the next update."""
    import time

    e0, e1 = cluster["engines"]
    old = ray.get([e.weight_version.remote() for e in (e0, e1)])
    _connect(cluster, "broadcast_packed", [e0, e1], check_equal=False, timeout_s=8.0)
    ray.get(e1.call_workers.remote("hook_stall_next_receive", 20.0))
    version = cluster["version"] + 1
    cluster["version"] = version
    start = time.monotonic()
    with pytest.raises(WeightUpdateError, match=r"engine 1: (no answer within 6s|did not finish after the failure)"):
        driver.run_update(cluster["trainer"], [e0, e1], version, timeout_s=6.0)
    assert time.monotonic() - start < 6.0 + 10
    time.sleep(16)  # let engine 1 come back from its stall (its side of the old group then fails)
    assert ray.get([e.weight_version.remote() for e in (e0, e1)], timeout=60) == old
    version = _update(cluster, "broadcast_packed", [e0, e1], seed=202)
    assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [version, version]


def test_updates_through_a_compiled_graph_land_bit_exact_and_a_failure_leaves_it_usable(cluster):
    """The dispatch RLJob uses on GPUs (a Ray Compiled Graph of the same calls): versions bit for bit,
    a trainer failing mid-stream named with every engine still on one whole version, then the same
    graph carries the next update."""
    from rlplacement.runtime.update_graph import CompiledUpdate

    engines, trainer = cluster["engines"], cluster["trainer"]
    _connect(cluster, "broadcast_packed", engines)
    graph = CompiledUpdate(trainer, engines, timeout_s=TIMEOUT_S)
    try:
        def update(seed):
            if seed is not None:
                ray.get(trainer.perturb.remote(seed))
            cluster["version"] += 1
            return driver.run_update(trainer, engines, cluster["version"], timeout_s=TIMEOUT_S, check_equal=True,
                                     graph=graph)

        for seed in (301, 302):
            report = update(seed)
            assert report.trainer.version == cluster["version"] and len(report.engines) == 2
            assert [e.version for e in report.engines] == [cluster["version"]] * 2
            assert ray.get([e.weight_version.remote() for e in engines]) == [cluster["version"]] * 2
            want = ray.get(trainer.checksums.remote())
            assert ray.get([e.received_checksums.remote() for e in engines]) == [want, want]
        old = cluster["version"]
        ray.get(trainer.set_fail_after.remote(5))
        try:
            with pytest.raises(WeightUpdateError, match="simulated gather failure at tensor 5") as info:
                update(303)
        finally:
            ray.get(trainer.set_fail_after.remote(None))
        assert list(info.value.failures) == ["engine 0", "engine 1", "trainer"]  # engines first, as plain calls
        assert graph.broken is None and ray.get([e.weight_version.remote() for e in engines]) == [old, old]
        update(None)
        assert ray.get([e.weight_version.remote() for e in engines]) == [cluster["version"]] * 2
    finally:
        graph.close()


def test_an_engine_that_stops_answering_a_compiled_graph_is_named_with_what_it_is_doing(cluster):
    """Every outcome of a graph's execution arrives at once, so who did not answer is asked apart:
    the stalled engine is named as still inside its update, the graph is torn down, and plain calls
    carry the next update."""
    import time

    from rlplacement.runtime.update_graph import CompiledUpdate

    e0, e1 = cluster["engines"]
    old = ray.get([e.weight_version.remote() for e in (e0, e1)])
    _connect(cluster, "broadcast_packed", [e0, e1], check_equal=False, timeout_s=6.0)
    graph = CompiledUpdate(cluster["trainer"], [e0, e1], timeout_s=4.0)
    ray.get(e1.call_workers.remote("hook_stall_next_receive", 10.0))
    cluster["version"] += 1
    start = time.monotonic()
    try:
        with pytest.raises(WeightUpdateError, match=r"engine 1: no answer within 4s \(still in update_weights for"):
            driver.run_update(cluster["trainer"], [e0, e1], cluster["version"], timeout_s=4.0, graph=graph)
        assert time.monotonic() - start < 4.0 + 10
        assert graph.broken == "no answer within 4s"
    finally:
        try:  # the teardown waits for engine 1's stall (10 s) to end: longer than the graph's bound of 4 s
            graph.close()
        except TimeoutError as exc:
            assert "teardown did not end within 4 s" in str(exc)
            graph.close()  # the teardown goes on meanwhile; waited for again, it ends
    assert ray.get([e.weight_version.remote() for e in (e0, e1)], timeout=60) == old
    version = _update(cluster, "broadcast_packed", [e0, e1], seed=402)
    assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [version, version]


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed", "p2p", "disk-delta"])
def test_engine_killed_mid_update_is_named_and_a_restarted_engine_rejoins(cluster, mode):
    """The fault matrix's "engine killed mid-update", per mode: the driver names the dead engine within
    the timeout, the other engine is on one whole version, and a restarted engine takes the next one."""
    e0, e1 = cluster["engines"]
    trainer = cluster["trainer"]
    restarted = start_replacement_engine(cluster, 1)
    old = ray.get(e0.weight_version.remote())
    options = {"transfer_timeout_s": 5.0} if mode == "p2p" else {}
    ray.get(trainer.transfer_setup.remote(mode, BUCKET, timeout_s=12.0, **options))
    driver.connect(trainer, [e0, e1], timeout_s=TIMEOUT_S)
    version = cluster["version"] + 1
    cluster["version"] = version
    kill_engine_mid_update(trainer, [e0, e1], version, 1, seed=101)
    v0 = ray.get(e0.weight_version.remote())
    if mode == "disk-delta":  # engines read the published version on their own: e0 may have taken it whole
        assert v0 in (old, version)
    else:  # a collective needs every member: e0 could not finish
        assert v0 == old
    cluster["engines"][1] = restarted
    version = _update(cluster, mode, [e0, restarted], seed=None)
    assert ray.get([e.weight_version.remote() for e in (e0, restarted)]) == [version, version]
    want = ray.get(trainer.checksums.remote())
    assert ray.get([e.received_checksums.remote() for e in (e0, restarted)]) == [want, want]
