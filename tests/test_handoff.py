"""The colocated hand-off's order of moves and its telemetry, and the out-of-memory hint.

vLLM's sleep mode and GPU memory exist only with CUDA, so the trainer ranks and engines here are
recording stand-ins (Ray actors that log each call and report fixed GiB): the names say so. What
is real is the state machine RLJob runs on a GPU and the Ray calls it makes."""

import os

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.runtime.handoff import ColocatedHandOff, offload_hint, skipped_reason


class _Log:
    def __init__(self):
        self.calls = []

    def add(self, who, method):
        self.calls.append((who, method))

    def get(self):
        return list(self.calls)


class _RecordingStandIn:
    def __init__(self, who, log, gib):
        self.who, self.log, self.gib = who, log, gib

    def _call(self, method):
        import ray

        ray.get(self.log.add.remote(self.who, method))
        return {"seconds": 0.0, "resident_gb": self.gib, "peak_gb": self.gib + 1, "device_used_gb": 100.0}


@pytest.fixture(scope="module")
def ray_local():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _stand_ins(ray, log, n, role, gib):
    # every method the hand-off calls, each recording its own name
    methods = ("offload_to_host", "reload_from_host", "gpu_memory", "release_memory", "resume_weights",
               "resume_kv_cache", "resume_all", "unmap_trainer_memory")
    cls = type(f"Recording{role}", (_RecordingStandIn,),
               {m: (lambda m: lambda self, **kwargs: self._call(m))(m) for m in methods})
    return [ray.remote(cls).options(num_cpus=0).remote(f"{role}{i}", log, gib) for i in range(n)]


def _moves(log_actor, ray):
    """Calls in order, one entry per move (every rank of a role makes the same move at once)."""
    out = []
    for who, method in ray.get(log_actor.get.remote()):
        move = (who.rstrip("0123456789"), method)
        if not out or out[-1] != move:
            out.append(move)
    return out


def _hand_off(ray, *, ranks=1, offload_train=True, offload_rollout=True):
    """(hand-off, call log) over ``ranks`` recording trainer ranks (30 GiB each) and engines (60 GiB)."""
    log = ray.remote(_Log).options(num_cpus=0).remote()
    trainers, engines = _stand_ins(ray, log, ranks, "trainer", 30.0), _stand_ins(ray, log, ranks, "engine", 60.0)
    return ColocatedHandOff(trainers, engines, offload_train=offload_train, offload_rollout=offload_rollout,
                            timeout_s=60, trainer_names=[f"trainer rank {r}" for r in range(ranks)]), log


def test_handoff_order_with_recording_stand_ins_for_gpu_sleep_mode(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, ranks=2)
    for _ in range(2):  # the loop: generate, train (twice: log-probs then the step), update
        h.to_rollout()
        h.to_train()
        h.to_train()  # already training: no move
        h.before_update()
    assert [m for m in _moves(log, ray) if m[1] != "gpu_memory"] == [
        ("engine", "unmap_trainer_memory"), ("trainer", "offload_to_host"),
        ("engine", "release_memory"), ("trainer", "reload_from_host"),
        ("engine", "resume_weights"),
        ("engine", "unmap_trainer_memory"), ("trainer", "offload_to_host"), ("engine", "resume_kv_cache"),
        ("engine", "release_memory"), ("trainer", "reload_from_host"),
        ("engine", "resume_weights"),
    ]
    m = h.pop_metrics()
    assert m["perf/handoff_to_train_time"] > 0 and m["perf/handoff_to_rollout_time"] > 0
    assert m["perf/trainer_gpu_resident_gb_in_train"] == 30.0 and m["perf/trainer_gpu_resident_gb_in_rollout"] == 30.0
    assert m["perf/rollout_gpu_resident_gb_in_train"] == 60.0 and m["perf/rollout_gpu_peak_gb_in_rollout"] == 61.0
    assert m["perf/trainer_gpu_peak_gb_in_train"] == 31.0 and m["perf/gpu_used_gb_in_rollout"] == 100.0
    parts = {k: v for k, v in m.items() if k.startswith("perf/handoff_") and k not in (
        "perf/handoff_to_train_time", "perf/handoff_to_rollout_time")}
    assert sorted(parts) == [f"perf/handoff_{p}_time" for p in
                             ("engine_sleep", "engine_wake", "trainer_offload", "trainer_reload")]
    assert all(v > 0 for v in parts.values())
    assert sum(parts.values()) <= m["perf/handoff_to_train_time"] + m["perf/handoff_to_rollout_time"]
    assert h.pop_metrics() == {}


def test_only_the_side_asked_for_moves_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=False)
    h.to_rollout()
    h.to_train()
    h.to_rollout()  # no update in between: the engines come back whole
    assert [m for m in _moves(log, ray) if m[1] != "gpu_memory"] == [
        ("engine", "release_memory"), ("engine", "resume_all")]


def test_an_update_outside_the_loop_order_still_ends_with_the_right_side_resident_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray)
    h.to_rollout()
    h.before_update()  # an update between two rollouts: the trainer comes back as the source ...
    h.to_rollout()  # ... and must leave again before generating
    h.to_train()
    h.before_update()
    h.to_train()  # an update between log-probs and the step: the engine weights woke and must sleep again
    assert [m for m in _moves(log, ray) if m[1] != "gpu_memory"] == [
        ("engine", "unmap_trainer_memory"), ("trainer", "offload_to_host"),
        ("trainer", "reload_from_host"),
        ("engine", "unmap_trainer_memory"), ("trainer", "offload_to_host"),
        ("engine", "release_memory"), ("trainer", "reload_from_host"),
        ("engine", "resume_weights"),
        # the engine sleeps whole: its KV cache comes back first, with the trainer out of the way
        ("engine", "unmap_trainer_memory"), ("trainer", "offload_to_host"), ("engine", "resume_kv_cache"),
        ("engine", "release_memory"),
        ("trainer", "reload_from_host"),
    ]


def _placement(*argv):
    return config_from_args(build_parser().parse_args(list(argv))).placement


def test_out_of_memory_names_the_offload_flag_to_turn_on_with_a_fake_cuda_oom_message():
    oom = "train step failed: trainer rank 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    hint = offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--no-offload-train"), oom)
    assert "Turn on --offload-train (drop --no-offload-train)" in hint
    both = offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--no-offload-train",
                                   "--no-offload-rollout"), "ValueError: No available memory for the cache blocks")
    assert "Turn on --offload-train and --offload-rollout" in both
    assert offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1"), oom) is None  # nothing left to free
    assert offload_hint(_placement("--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1"), oom) is None
    assert offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--no-offload-train"),
                        "ValueError: bad shape") is None


def test_the_hand_off_is_skipped_on_cpu_and_says_why():
    assert "the trainer runs on cpu, so there is no GPU memory" in skipped_reason(True, False, "cpu")
    assert skipped_reason(True, True, "cuda:0") is None and skipped_reason(False, False, "cpu") is None
