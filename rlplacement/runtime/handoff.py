"""Colocated memory hand-off (``--offload-train``, ``--offload-rollout``): who holds the GPU when.

Under ``--colocate`` the trainer and the engines share each GPU, and a model that does not fit
twice fits only if each side lets go while the other works:

* to train (before ``log_probs``/``train``): the engines sleep (KV cache released; weights discarded at
  vLLM's level 2, or copied to host memory at level 1 with ``--offload-rollout-keep-weights``), and the
  trainer's weights and optimizer state come back from pinned host memory: at once where they fit
  beside the engines still awake, else after;
* to update (before ``update_weights``): the trainer is resident (it is the source), and the
  engines' weights are mapped again, so the update writes into them while the KV cache stays released;
* to rollout (before ``generate``): the trainer moves weights and optimizer state to host memory
  (gradients dropped), then the engines' KV cache comes back and scheduling resumes; where the KV
  cache fits beside the trainer's state, it comes back while that state is still leaving.

With a flag left unset, that side moves only when the other's next phase would not fit beside it
(``handoff_plan``); a flag that is set is obeyed. Each transition happens only when needed (a state
machine per side), so a loop that calls the job's methods in any order stays correct, and each is
timed, counted in bytes and followed by a memory reading per role, reported as ``perf/*`` keys (see
:data:`KEYS`). Where there is no GPU the hand-off is off and says so once: there is no GPU memory to give.

What survives a failed update: at level 2 the engines' previous weights are gone, so after a failed
update they refuse to generate (``WeightsUnavailableError``) until a full update lands; at level 1 they
keep serving the previous version.

The engines are actors of any ``engines.base.RolloutEngine`` kind: this calls only that protocol's
memory methods (``release_memory`` by level, ``resume_*``, ``sleep_pool``, ``gpu_memory``,
``unmap_trainer_memory``).
"""

from __future__ import annotations

import time
from typing import Sequence

from rlplacement.runtime import handoff_plan
from rlplacement.runtime.waits import get_all

TRAIN, ROLLOUT = "train", "rollout"
GIB = float(1 << 30)
KEYS = {
    "perf/handoff_to_train_time": "seconds per step: engines sleep, trainer state back from host memory",
    "perf/handoff_to_rollout_time": "seconds per step: engine weights mapped again (before the update), trainer "
                                    "state to host memory, engine KV cache back",
    "perf/handoff_{part}_time": "seconds per step of each part of both hand-offs, {part} one of trainer_offload "
                                "(the engines unmapping the trainer's memory, then its offload), trainer_reload, "
                                "engine_sleep, engine_wake; parts that overlap both count their own seconds",
    "perf/handoff_trainer_offload_copy_time": "seconds of the trainer's offload spent copying to host memory",
    "perf/handoff_trainer_offload_{dispatch,worker,return}_time": "seconds from the offload's call to its start on "
                                                                 "the trainer (slowest rank), inside it, and from "
                                                                 "its end to its answer here",
    "perf/handoff_trainer_offload_{prepare,collect,free,reading}_time": "seconds of the trainer's offload spent "
        "dropping gradients and derived buffers, finding its storages, freeing them, and reading its memory",
    "perf/handoff_engine_unmap_time": "seconds the engines took to unmap the trainer's memory before its offload",
    "perf/handoff_engine_wake_worker_time": "seconds an engine spent waking (largest engine), apart from waiting "
                                            "for its turn or overlapping the trainer's offload",
    "perf/handoff_trainer_offload_release_time": "seconds of the trainer's offload spent giving its freed GPU memory "
                                                 "back to the driver (empty_cache), where the engines allocate",
    "perf/handoff_bytes_to_host": "bytes per step that crossed PCIe to host memory, on the busiest GPU (the "
                                  "trainer's state less its frozen part, copied once: LoRA's base, the KL "
                                  "reference; plus the engine's weights at level 1)",
    "perf/handoff_bytes_to_device": "bytes per step that crossed PCIe back to the GPU, on the busiest GPU",
    "perf/handoff_engine_weight_bytes": "bytes per step of engine weights that crossed PCIe (level 1 only; 0 at "
                                        "level 2, where the update refills them from the trainer's GPU memory)",
    "perf/handoff_trainer_left": "1 when the trainer's state went to host memory for this rollout, else 0",
    "perf/handoff_engines_slept": "1 when the engines slept for this training phase, else 0",
    "perf/handoff_setup_time": "seconds, once, at the job's start: the trainer's pinned host buffer made",
    "perf/trainer_gpu_resident_gb_in_{phase}": "GiB the trainer holds on its GPU once the phase starts (largest rank)",
    "perf/trainer_gpu_peak_gb_in_{phase}": "GiB the trainer held at most during the phase (torch's peak, largest rank)",
    "perf/rollout_gpu_resident_gb_in_{phase}": "GiB an engine holds once the phase starts (largest engine)",
    "perf/rollout_gpu_peak_gb_in_rollout": "GiB an engine held at most while generating",
    "perf/gpu_used_gb_in_{phase}": "GiB used on trainer rank 0's GPU (every process on it) once both sides moved",
}


PARTS = {"unmap_trainer_memory": "trainer_offload", "offload_to_host": "trainer_offload",
         "reload_from_host": "trainer_reload", "release_memory": "engine_sleep",
         "resume_weights": "engine_wake", "resume_kv_cache": "engine_wake", "resume_all": "engine_wake"}
"""Method -> the hand-off part its seconds count towards (trainer and engine methods)."""


OOM_MARKERS = ("out of memory", "outofmemoryerror", "no available memory for the cache blocks",
               "insufficient memory")


def offload_hint(placement, message: str) -> str | None:
    """The flag to turn on when ``message`` is a GPU out-of-memory error in a colocated job where a side
    was not told to move (turned off, or left to the memory readings); None otherwise (the error is not
    about memory, or both flags were on already)."""
    if not placement.colocate or not any(m in message.lower() for m in OOM_MARKERS):
        return None
    chosen = (("--offload-train", placement.offload_train), ("--offload-rollout", placement.offload_rollout))
    off = [f for f, on in chosen if on is not True]
    if not off:
        return None
    said = " and ".join("--no-" + f[2:] if on is False else f"{f} unset (moved only when the readings said so)"
                        for f, on in chosen if on is not True)
    return (f"Out of GPU memory under --colocate with {said}: the trainer and the engines were resident on the "
            f"same GPUs at once. Turn on {' and '.join(off)} so each side releases its memory while the other "
            f"works.")


def skipped_reason(offload_train: bool | None, offload_rollout: bool | None, trainer_device: str) -> str | None:
    """Why the hand-off is off for this job, or None when it runs (or was turned off by both flags)."""
    if offload_train is False and offload_rollout is False:
        return None
    if not trainer_device.startswith("cuda"):
        flags = " and ".join(f for f, on in (("--offload-train", offload_train), ("--offload-rollout", offload_rollout))
                             if on is not False)  # given, or unset (decided from GPU memory)
        return (f"rlplacement: {flags}: the trainer runs on {trainer_device}, so there is no GPU memory to hand "
                f"off; the hand-off is skipped (it runs where trainer and engines share a GPU).")
    return None


class ColocatedHandOff:
    def __init__(self, trainers: Sequence, engines: Sequence, *, offload_train: bool | None,
                 offload_rollout: bool | None, timeout_s: float, trainer_names: Sequence[str],
                 keep_engine_weights: bool = False, overlap: bool = True):
        """``offload_train``/``offload_rollout``: True or False as the flags say, None where the flag was
        left unset (decided before each phase from memory readings); ``keep_engine_weights``: engines
        sleep at level 1 (``--offload-rollout-keep-weights``) instead of 2; ``overlap``: a side's move
        runs beside the other's where it fits (off only to measure what overlapping saves)."""
        # the job's own lists: an engine it replaces (restarted, or a fresh one in a benchmark) is the one moved
        self.trainers, self.engines = trainers, engines
        self.offload_train, self.offload_rollout = offload_train, offload_rollout
        self.keep_engine_weights = keep_engine_weights
        self.overlap = overlap
        self.timeout_s = timeout_s
        self.trainer_names = list(trainer_names)
        self.engine_names = [f"engine {i}" for i in range(len(engines))]
        self.trainer_on_host = False
        self.engines_hold = "all"  # all | weights | nothing
        self.phase: str | None = None
        self._metrics: dict[str, float] = {}
        self._pool: dict | None = None  # the largest engine worker's sleep pool, GiB by tag
        self._train_peak_gb: float | None = None  # the trainer's largest peak in a phase that ran a train step
        self._stepped = False  # a train step ran in this training phase
        self._trainer_state_gb: float | None = None  # GiB its last offload moved (largest rank)

    def reserve_host_memory(self) -> None:
        """At start, where the trainer may leave: its pinned host buffer, made before any step."""
        if self.offload_train is False:
            return
        start = time.perf_counter()
        self._trainers("reserve_host_memory", "trainer host memory reserved")
        self._metrics["perf/handoff_setup_time"] = time.perf_counter() - start

    # ---- transitions -----------------------------------------------------------------------
    # Each decides from where the two sides are (not from the last phase), so an update between
    # two rollouts, or between log-probs and the step, still ends with the right side resident.
    def to_train(self) -> None:
        sleep = self.engines_hold != "nothing" and self._engines_should_sleep()
        if self.engines_hold != "nothing":  # decided now (a second call in the same phase finds them asleep)
            self._metrics["perf/handoff_engines_slept"] = float(sleep)
        if not sleep and not self.trainer_on_host:
            self.phase = TRAIN
            return
        start = time.perf_counter()
        self._record_peaks(ending=self.phase)
        if sleep:
            if self.engines_hold == "weights":
                # updated but never generated: vLLM sleeps only a whole engine, so the KV cache comes
                # back first, with the trainer's state out of the way if it does not fit beside it
                self._make_room_for_engines(None, "weights")
                self._engines("resume_kv_cache", "engine KV cache back")
            beside = (lambda: self._trainer_resident(TRAIN)) if (
                self.overlap and self.trainer_on_host and self._reload_fits_beside_engines()) else None  # comes back meanwhile
            reports, _ = self._engines_beside(beside, "release_memory", "engine sleep",
                                              keep_weights=self.keep_engine_weights)
            self._record("rollout", TRAIN, reports)
            self._count_engine_weights("perf/handoff_bytes_to_host")
            self.engines_hold = "nothing"
        self._trainer_resident(TRAIN)
        self._device_reading(TRAIN)
        self._add("perf/handoff_to_train_time", time.perf_counter() - start)
        self.phase = TRAIN

    def before_update(self) -> None:
        """The trainer is the source and the engines' weights the destination: both resident; the
        KV cache stays released while the bytes arrive."""
        if not self.trainer_on_host and self.engines_hold != "nothing":
            return
        start = time.perf_counter()
        self._trainer_resident(None)
        if self.engines_hold == "nothing":
            self._engines("resume_weights", "engine weights back")
            self._count_engine_weights("perf/handoff_bytes_to_device")
            self.engines_hold = "weights"
        self._add("perf/handoff_to_rollout_time", time.perf_counter() - start)

    def to_rollout(self) -> None:
        if self.engines_hold == "all" and (self.trainer_on_host or self.offload_train is not True):
            # nothing to wake, and the trainer is away or may stay (auto: the engines hold all they need)
            if not self.trainer_on_host:
                self._metrics["perf/handoff_trainer_left"] = 0.0
            self.phase = ROLLOUT
            return
        start = time.perf_counter()
        self._record_peaks(ending=self.phase)
        holds = self.engines_hold
        wake = None if holds == "all" else ("resume_kv_cache" if holds == "weights" else "resume_all")
        overlapped = self._make_room_for_engines(ROLLOUT, holds, wake=wake)
        if wake and not overlapped:
            self._woken(self._engines(wake, "engine wake-up"))
            if wake == "resume_all":
                self._count_engine_weights("perf/handoff_bytes_to_device")
        self.engines_hold = "all"
        self._device_reading(ROLLOUT)
        self._add("perf/handoff_to_rollout_time", time.perf_counter() - start)
        self.phase = ROLLOUT

    def train_step_runs(self) -> None:
        """A train step runs in this training phase: its peak is what the engines' decision to stay awake
        needs (a phase of log-probs, an update or a checkpoint alone peaks lower, and must not count)."""
        self._stepped = True

    def pop_metrics(self) -> dict[str, float]:
        """What the hand-offs since the last call cost and the memory each role held."""
        out, self._metrics = self._metrics, {}
        return out

    # ---- decisions --------------------------------------------------------------------------
    def _engines_should_sleep(self) -> bool:
        if self.offload_rollout is not None:
            return self.offload_rollout
        room = self._room()
        if room is None:
            return True
        free, total, resident = room
        growth = None if self._train_peak_gb is None else self._train_peak_gb - (0.0 if self.trainer_on_host else resident)
        return handoff_plan.engines_must_sleep(free, growth, total)

    def _make_room_for_engines(self, phase: str | None, holds: str, wake: str | None = None) -> bool:
        """The trainer leaves if it must (its flag, else when the engines' wake-up would not fit beside
        it); with ``wake``, the engines wake while it leaves when their wake-up fits beside its state.
        Returns whether the wake-up ran here."""
        if self.trainer_on_host or self.offload_train is False:
            self._metrics.setdefault("perf/handoff_trainer_left", 0.0)
            return False
        if self.offload_train is True and wake is None:
            self._metrics["perf/handoff_trainer_left"] = 1.0
            self._trainer_to_host(phase)
            return False
        room = self._room(empty_cache=True)
        fits = room is not None and not handoff_plan.trainer_must_leave(
            room[0], handoff_plan.engine_wake_gb(self._sleep_pool(), holds), room[1])
        leave = self.offload_train is True or not fits
        self._metrics["perf/handoff_trainer_left"] = float(leave)
        if not leave:
            return False
        overlap = wake if fits and self.overlap else None
        self._trainer_to_host(phase, overlap=overlap)
        return overlap is not None

    def _reload_fits_beside_engines(self) -> bool:
        """Whether the trainer's state (its last offload's bytes) fits beside the engines still awake."""
        room = self._room() if self._trainer_state_gb is not None else None
        return room is not None and handoff_plan.fits(room[0], self._trainer_state_gb, room[1])

    def _room(self, empty_cache: bool = False) -> tuple[float, float, float] | None:
        """(GiB free on the tightest trainer GPU, GiB of a GPU, GiB the largest trainer rank holds), read
        without restarting the peaks the phases report; None without CUDA. ``empty_cache``: the trainer's
        unused cached blocks go back to the driver first, as they must before an engine can take them."""
        readings = self._trainers("gpu_memory", "trainer memory", empty_cache=empty_cache, reset_peak=False)
        if not readings or "device_free_gb" not in readings[0]:
            return None
        return (min(r["device_free_gb"] for r in readings), readings[0]["device_total_gb"],
                max(r["resident_gb"] for r in readings))

    def _sleep_pool(self) -> dict:
        if self._pool is None:
            pools = self._engines("sleep_pool", "engine sleep pool")
            self._pool = {k: max(p.get(k, 0.0) for p in pools) for k in ("weights_gb", "kv_cache_gb")}
        return self._pool

    # ---- parts ------------------------------------------------------------------------------
    def _trainer_to_host(self, phase: str | None, overlap: str | None = None) -> None:
        """The trainer's state to host memory; ``overlap``: an engine wake-up issued beside it."""
        # cuda_ipc keeps the trainer's weights mapped in the engines between updates: they let go
        # first, since freeing memory another process still maps is undefined (the trainer refuses)
        unmap_start = time.perf_counter()
        self._engines("unmap_trainer_memory", "engines unmapping the trainer's memory")
        self._add("perf/handoff_engine_unmap_time", time.perf_counter() - unmap_start)
        issued_at = time.time()
        offload = lambda: self._trainers("offload_to_host", "trainer offload", engines_unmapped=True)  # noqa: E731
        if overlap:
            woken, reports = self._engines_beside(offload, overlap, "engine wake-up")
            self._woken(woken)
            if overlap == "resume_all":
                self._count_engine_weights("perf/handoff_bytes_to_device")
        else:
            reports = offload()
        returned_at = time.time()
        self.trainer_on_host = True
        if any(r.get("bytes") is not None for r in reports):  # what comes back: moved, and frozen kept on host
            self._trainer_state_gb = max((r.get("bytes") or 0.0) + (r.get("kept_bytes") or 0.0) for r in reports) / GIB
        if all("started_at" in r for r in reports):  # before the method ran (Ray, a turn), and inside it
            self._add("perf/handoff_trainer_offload_dispatch_time", max(r["started_at"] for r in reports) - issued_at)
            self._add("perf/handoff_trainer_offload_worker_time",
                      max(r["finished_at"] - r["started_at"] for r in reports))
            self._add("perf/handoff_trainer_offload_return_time", returned_at - max(r["finished_at"] for r in reports))
        self._add_largest("perf/handoff_bytes_to_host", reports, "bytes")
        for section in ("prepare", "collect", "copy", "free", "release", "reading"):
            self._add_largest(f"perf/handoff_trainer_offload_{section}_time", reports, f"{section}_seconds")
        if phase:
            self._record("trainer", phase, reports)

    def _trainer_resident(self, phase: str | None) -> None:
        if self.trainer_on_host:
            reports = self._trainers("reload_from_host", "trainer reload")
            self.trainer_on_host = False
            self._add_largest("perf/handoff_bytes_to_device", reports, "bytes")
            if phase:
                self._record("trainer", phase, reports)

    def _count_engine_weights(self, key: str) -> None:
        """Level 1 only: the engine's weights crossed PCIe (its weight pool, largest worker)."""
        if self.keep_engine_weights:
            nbytes = self._sleep_pool().get("weights_gb", 0.0) * GIB
            self._add(key, nbytes)
            self._add("perf/handoff_engine_weight_bytes", nbytes)
        else:
            self._metrics.setdefault("perf/handoff_engine_weight_bytes", 0.0)

    def _trainers(self, method: str, what: str, **kwargs) -> list[dict]:
        return self._call(self.trainers, self.trainer_names, method, what, **kwargs)

    def _engines(self, method: str, what: str, **kwargs) -> list[dict]:
        return self._call(self.engines, self.engine_names, method, what, **kwargs)

    def _engines_beside(self, beside, method: str, what: str, **kwargs) -> tuple[list[dict], object]:
        """``method`` on every engine while ``beside()`` (another side's move, or None) runs here: (the
        engines' answers, what ``beside`` returned). The engines' part counts from the call to their last
        answer."""
        if beside is None:
            return self._engines(method, what, **kwargs), None
        start = time.perf_counter()
        refs = [getattr(e, method).remote(**kwargs) for e in self.engines]
        result = beside()
        out = get_all(refs, self.timeout_s, what, self.engine_names)
        self._add(f"perf/handoff_{PARTS[method]}_time", time.perf_counter() - start)
        return out, result

    def _call(self, actors: Sequence, names: Sequence[str], method: str, what: str, **kwargs) -> list[dict]:
        """``method`` on every actor, bounded; a move (not a memory reading) adds its seconds to its part."""
        start = time.perf_counter()
        out = get_all([getattr(a, method).remote(**kwargs) for a in actors], self.timeout_s, what, names)
        part = PARTS.get(method)
        if part is not None:
            self._add(f"perf/handoff_{part}_time", time.perf_counter() - start)
        return out

    def _woken(self, reports: list[dict]) -> None:
        self._record("rollout", ROLLOUT, reports)
        self._add_largest("perf/handoff_engine_wake_worker_time", reports, "seconds")

    def _record(self, role: str, phase: str, reports: list[dict]) -> None:
        self._put(f"perf/{role}_gpu_resident_gb_in_{phase}", reports, "resident_gb")

    def _device_reading(self, phase: str) -> None:
        """The whole device once both sides have moved (trainer rank 0's GPU; its peak restarts here)."""
        reading = self._call(self.trainers[:1], self.trainer_names[:1], "gpu_memory", "trainer memory")[0]
        if "device_used_gb" in reading:
            self._metrics[f"perf/gpu_used_gb_in_{phase}"] = reading["device_used_gb"]

    def _record_peaks(self, ending: str | None) -> None:
        """The peak of the phase that ends (torch's peak since the previous reading, then reset)."""
        if ending is None:
            return
        if not self.trainer_on_host:  # offloaded, the trainer allocated nothing during the phase
            readings = self._trainers("gpu_memory", "trainer memory")
            self._put(f"perf/trainer_gpu_peak_gb_in_{ending}", readings, "peak_gb")
            peaks = [r["peak_gb"] for r in readings if r.get("peak_gb") is not None]
            if ending == TRAIN and self._stepped and peaks:  # the largest so far: one long batch is enough to OOM
                self._train_peak_gb = max(peaks + [self._train_peak_gb or 0.0])
        if ending == TRAIN:
            self._stepped = False
        if ending == ROLLOUT and self.engines_hold == "all":
            self._put("perf/rollout_gpu_peak_gb_in_rollout", self._engines("gpu_memory", "engine memory"), "peak_gb")

    def _put(self, key: str, reports: list[dict], field: str) -> None:
        """``key`` = the largest ``field`` over the ranks or engines that report it (none without CUDA)."""
        values = [r[field] for r in reports if r.get(field) is not None]
        if values:
            self._metrics[key] = max(values)

    def _add_largest(self, key: str, reports: list[dict], field: str) -> None:
        """``key`` += the largest ``field`` over the ranks (the busiest GPU's share of this move)."""
        values = [r[field] for r in reports if r.get(field) is not None]
        if values:
            self._add(key, max(values))

    def _add(self, key: str, seconds: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + seconds
