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
    def __init__(self, who, log, gib, readings=None):
        self.who, self.log, self.gib, self.readings = who, log, gib, dict(readings or {})

    def _call(self, method, **kwargs):
        import ray

        ray.get(self.log.add.remote(self.who, method if not kwargs else (method, tuple(sorted(kwargs.items())))))
        if method == "sleep_pool":
            return {k: v for k, v in self.readings.items() if k in ("weights_gb", "kv_cache_gb")}
        out = {"seconds": 0.0, "resident_gb": self.gib, "peak_gb": self.gib + 1, "device_used_gb": 100.0,
               **{k: v for k, v in self.readings.items() if k not in ("weights_gb", "kv_cache_gb")}}
        if method in ("offload_to_host", "reload_from_host"):
            out.update(bytes=self.gib * (1 << 30), copy_seconds=0.0)
        if method == "offload_to_host":
            import time

            out.update(started_at=time.time(), finished_at=time.time() + 0.25)
            if self.readings.get("offload_s"):  # takes that long, and says when it ended
                time.sleep(self.readings["offload_s"])
                ray.get(self.log.add.remote(self.who, "offload_to_host ended"))
        return out


@pytest.fixture(scope="module")
def ray_local():
    import ray

    from tests import shared_ray

    shared_ray.join({"env_vars": {"PYTHONPATH": shared_ray.REPO, "RAY_AUTH_MODE": "disabled"}})
    yield ray
    ray.shutdown()


def _stand_ins(ray, log, n, role, gib, readings=None):
    # every method the hand-off calls, each recording its own name
    methods = ("offload_to_host", "reload_from_host", "gpu_memory", "release_memory", "resume_weights",
               "resume_kv_cache", "resume_all", "unmap_trainer_memory", "sleep_pool", "reserve_host_memory")
    cls = type(f"Recording{role}", (_RecordingStandIn,),
               {m: (lambda m: lambda self, **kwargs: self._call(m, **kwargs))(m) for m in methods})
    return [ray.remote(cls).options(num_cpus=0).remote(f"{role}{i}", log, gib, readings) for i in range(n)]


def _moves(log_actor, ray, with_args=False):
    """Calls in order, one entry per move (every rank of a role makes the same move at once)."""
    out = []
    for who, method in ray.get(log_actor.get.remote()):
        if not with_args and isinstance(method, tuple):
            method = method[0]
        move = (who.rstrip("0123456789"), method)
        if not out or out[-1] != move:
            out.append(move)
    return out


def _hand_off(ray, *, ranks=1, offload_train=True, offload_rollout=True, trainer=None, engine=None, **kwargs):
    """(hand-off, call log) over ``ranks`` recording trainer ranks (30 GiB each) and engines (60 GiB);
    ``trainer``/``engine``: extra readings they report (GPU free/total; the engine's sleep pool)."""
    log = ray.remote(_Log).options(num_cpus=0).remote()
    trainers = _stand_ins(ray, log, ranks, "trainer", 30.0, trainer)
    engines = _stand_ins(ray, log, ranks, "engine", 60.0, engine)
    return ColocatedHandOff(trainers, engines, offload_train=offload_train, offload_rollout=offload_rollout,
                            timeout_s=60, trainer_names=[f"trainer rank {r}" for r in range(ranks)], **kwargs), log


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
    assert sorted(k for k in parts if k.endswith("_time")) == sorted(f"perf/handoff_{p}_time" for p in (
        "engine_sleep", "engine_unmap", "engine_wake", "engine_wake_worker", "trainer_offload",
        "trainer_offload_copy", "trainer_offload_dispatch", "trainer_offload_return", "trainer_offload_worker",
        "trainer_reload"))
    assert m["perf/handoff_trainer_offload_worker_time"] == pytest.approx(0.5, abs=1e-3)  # two offloads of 0.25 s
    parts = {f"perf/handoff_{p}_time": parts[f"perf/handoff_{p}_time"]
             for p in ("engine_sleep", "engine_wake", "trainer_offload", "trainer_reload")}
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


TIGHT = {"device_free_gb": 10.0, "device_total_gb": 140.0}  # the engines' wake-up does not fit beside the trainer
ROOMY = {"device_free_gb": 80.0, "device_total_gb": 140.0}  # it does: 80 >= 30 + 16 + 4.2 headroom
POOL = {"weights_gb": 16.0, "kv_cache_gb": 30.0}


def _two_steps_of_moves(ray, h, log) -> list:
    """The moves (not the readings) of a start and two loop steps: rollout, train, update."""
    h.reserve_host_memory()
    for _ in range(2):
        h.to_rollout()
        h.to_train()
        h.train_step_runs()  # as RLJob.train says before each step
        h.before_update()
    return [m for m in _moves(log, ray) if m[1] not in ("gpu_memory", "sleep_pool")]


def test_a_training_phase_without_a_step_leaves_the_peak_unknown_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=None, offload_rollout=None, trainer=ROOMY, engine=POOL)
    for _ in range(2):  # an update alone (no train step): its peak says nothing about a step's
        h.to_train()
        h.before_update()
        h.to_rollout()
    sleeps = [m for m in _moves(log, ray) if m == ("engine", "release_memory")]
    assert len(sleeps) == 2  # the engines slept before each training phase: no step's peak was measured


def test_unset_flags_keep_a_trainer_that_fits_beside_the_engines_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=None, offload_rollout=None, trainer=ROOMY, engine=POOL)
    moves = _two_steps_of_moves(ray, h, log)
    # the engines sleep before the first step (its peak is unknown); after it, the trainer's measured
    # growth (31 - 30 GiB, x1.25 + 4.2 headroom) fits in 80 GiB free, so they stay awake; the trainer
    # never leaves, since the engines' wake-up (46 GiB) fits beside it
    assert moves == [("trainer", "reserve_host_memory"), ("engine", "release_memory"), ("engine", "resume_weights"),
                     ("engine", "resume_kv_cache")]
    m = h.pop_metrics()
    assert m["perf/handoff_trainer_left"] == 0.0 and m["perf/handoff_engines_slept"] == 0.0  # the last step's
    assert "perf/handoff_bytes_to_host" not in m and m["perf/handoff_setup_time"] > 0


def test_unset_flags_move_a_trainer_that_does_not_fit_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=None, offload_rollout=None, trainer=TIGHT, engine=POOL)
    h.to_rollout()  # the engines hold everything: nothing to make room for
    h.to_train()
    h.before_update()
    h.to_rollout()
    moves = [m for m in _moves(log, ray) if m[1] not in ("gpu_memory", "sleep_pool")]
    assert moves == [("engine", "release_memory"), ("engine", "resume_weights"), ("engine", "unmap_trainer_memory"),
                     ("trainer", "offload_to_host"), ("engine", "resume_kv_cache")]
    m = h.pop_metrics()
    assert m["perf/handoff_trainer_left"] == 1.0 and m["perf/handoff_bytes_to_host"] == 30.0 * (1 << 30)


def test_an_explicit_flag_wins_over_the_readings_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=True, offload_rollout=False, trainer=ROOMY, engine=POOL)
    assert _two_steps_of_moves(ray, h, log) == [("trainer", "reserve_host_memory"), ("engine", "unmap_trainer_memory"),
                     ("trainer", "offload_to_host"), ("trainer", "reload_from_host"),
                     ("engine", "unmap_trainer_memory"), ("trainer", "offload_to_host"), ("trainer", "reload_from_host")]
    h, log = _hand_off(ray, offload_train=False, offload_rollout=None, trainer=TIGHT, engine=POOL)
    h.reserve_host_memory()  # a trainer that never leaves pins nothing
    h.to_rollout()
    h.to_train()
    h.before_update()
    h.to_rollout()
    assert [m for m in _moves(log, ray) if m[1] not in ("gpu_memory", "sleep_pool")] == [
        ("engine", "release_memory"), ("engine", "resume_weights"), ("engine", "resume_kv_cache")]
    assert "perf/handoff_setup_time" not in h.pop_metrics()


def _second_hand_off_to_rollout(ray, h, log) -> list:
    """The moves of the hand-off to rollout after a first loop step (the trainer's state to leave)."""
    h.to_rollout()
    h.to_train()
    h.before_update()
    ray.get(log.add.remote("marker", "step 2"))
    h.to_rollout()
    calls = [m for m in _moves(log, ray) if m[1] not in ("gpu_memory", "sleep_pool")]
    return calls[calls.index(("marker", "step 2")) + 1:]


def test_the_kv_cache_wakes_while_the_trainer_leaves_when_it_fits_beside_it_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=True, offload_rollout=True, trainer=ROOMY, engine=POOL)
    after = _second_hand_off_to_rollout(ray, h, log)
    assert after[0] == ("engine", "unmap_trainer_memory")
    assert sorted(after[1:]) == [("engine", "resume_kv_cache"), ("trainer", "offload_to_host")]  # issued together
    m = h.pop_metrics()
    assert m["perf/handoff_engine_wake_time"] > 0 and m["perf/rollout_gpu_resident_gb_in_rollout"] == 60.0


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_off_moves_each_side_after_the_other_with_recording_stand_ins(ray_local, overlap):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=True, offload_rollout=True, trainer={**ROOMY, "offload_s": 0.5},
                       engine=POOL, overlap=overlap)
    after = _second_hand_off_to_rollout(ray, h, log)
    woke, ended = after.index(("engine", "resume_kv_cache")), after.index(("trainer", "offload_to_host ended"))
    assert (woke < ended) == overlap
    assert h.pop_metrics()["perf/handoff_engine_unmap_time"] > 0


def test_the_trainer_comes_back_while_the_engines_sleep_when_it_fits_beside_them_with_recording_stand_ins(ray_local):
    ray = ray_local
    h, log = _hand_off(ray, offload_train=True, offload_rollout=True, trainer=ROOMY, engine=POOL)
    h.to_rollout()  # the trainer leaves: 30 GiB, which fit in 80 GiB free beside the awake engines
    ray.get(log.add.remote("marker", "to train"))
    h.to_train()
    calls = [m for m in _moves(log, ray) if m[1] not in ("gpu_memory", "sleep_pool")]
    after = calls[calls.index(("marker", "to train")) + 1:]
    assert sorted(after) == [("engine", "release_memory"), ("trainer", "reload_from_host")]  # issued together
    h, log = _hand_off(ray, offload_train=True, offload_rollout=True, trainer=TIGHT, engine=POOL)
    h.to_rollout()
    ray.get(log.add.remote("marker", "to train"))
    h.to_train()  # 30 GiB do not fit in 10: the engines sleep first
    calls = [m for m in _moves(log, ray) if m[1] not in ("gpu_memory", "sleep_pool")]
    assert calls[calls.index(("marker", "to train")) + 1:] == [("engine", "release_memory"),
                                                               ("trainer", "reload_from_host")]


@pytest.mark.parametrize("keep", [False, True])
def test_engine_weights_cross_pcie_only_at_level_1_with_recording_stand_ins(ray_local, keep):
    ray = ray_local
    h, log = _hand_off(ray, trainer=TIGHT, engine=POOL, keep_engine_weights=keep)
    h.to_rollout()
    h.pop_metrics()
    h.to_train()
    h.before_update()
    h.to_rollout()
    m = h.pop_metrics()
    sleeps = [c for who, c in ray.get(log.get.remote()) if isinstance(c, tuple) and c[0] == "release_memory"]
    assert sleeps == [("release_memory", (("keep_weights", keep),))]
    weights = 16.0 * (1 << 30) if keep else 0.0
    trainer = 30.0 * (1 << 30)
    assert m["perf/handoff_engine_weight_bytes"] == 2 * weights
    assert m["perf/handoff_bytes_to_host"] == trainer + weights
    assert m["perf/handoff_bytes_to_device"] == trainer + weights


def _placement(*argv):
    return config_from_args(build_parser().parse_args(list(argv))).placement


def test_out_of_memory_names_the_offload_flag_to_turn_on_with_a_fake_cuda_oom_message():
    oom = "train step failed: trainer rank 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    hint = offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--no-offload-train"), oom)
    assert "with --no-offload-train and --offload-rollout unset (moved only when the readings said so)" in hint
    assert "Turn on --offload-train and --offload-rollout so each side releases" in hint
    both = offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--no-offload-train",
                                   "--no-offload-rollout"), "ValueError: No available memory for the cache blocks")
    assert "Turn on --offload-train and --offload-rollout" in both
    assert offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--offload-train",
                                   "--offload-rollout"), oom) is None  # nothing left to free
    assert offload_hint(_placement("--rollout-num-gpus", "1", "--actor-num-gpus-per-node", "1"), oom) is None
    assert offload_hint(_placement("--colocate", "--actor-num-gpus-per-node", "1", "--no-offload-train"),
                        "ValueError: bad shape") is None


def test_the_hand_off_is_skipped_on_cpu_and_says_why():
    assert "the trainer runs on cpu, so there is no GPU memory" in skipped_reason(True, False, "cpu")
    assert skipped_reason(True, True, "cuda:0") is None and skipped_reason(False, False, "cpu") is None
    assert "rlplacement: --offload-rollout: the trainer runs on cpu" in skipped_reason(False, None, "cpu")


def test_the_plan_moves_a_side_only_when_the_other_would_not_fit():
    from rlplacement.runtime import handoff_plan as plan

    assert plan.headroom_gb(140.0) == pytest.approx(4.2) and plan.headroom_gb(24.0) == 2.0
    assert not plan.trainer_must_leave(free_gb=50.3, engine_wake_gb=46.0, total_gb=140.0)
    assert plan.trainer_must_leave(free_gb=50.1, engine_wake_gb=46.0, total_gb=140.0)
    assert plan.fits(free_gb=50.2, need_gb=46.0, total_gb=140.0) and not plan.fits(50.1, 46.0, 140.0)
    assert plan.engines_must_sleep(free_gb=500.0, trainer_growth_gb=None, total_gb=140.0)  # no step measured yet
    assert not plan.engines_must_sleep(free_gb=30.0, trainer_growth_gb=20.0, total_gb=140.0)  # 25 + 4.2 <= 30
    assert plan.engines_must_sleep(free_gb=29.0, trainer_growth_gb=20.0, total_gb=140.0)
    assert plan.engine_wake_gb(POOL, "weights") == 30.0 and plan.engine_wake_gb(POOL, "nothing") == 46.0
