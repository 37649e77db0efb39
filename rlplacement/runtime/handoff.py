"""Colocated memory hand-off (``--offload-train``, ``--offload-rollout``): who holds the GPU when.

Under ``--colocate`` the trainer and the engines share each GPU, and a model that does not fit
twice fits only if each side lets go while the other works:

* to train (before ``log_probs``/``train``): the engines sleep (weights to host memory, KV cache
  dropped), then the trainer's weights and optimizer state come back from host memory;
* to update (before ``update_weights``): the trainer is resident (it is the source), and the
  engines' weights come back, so the update writes into them while the KV cache stays released;
* to rollout (before ``generate``): the trainer moves weights and optimizer state to host memory
  (gradients dropped), then the engines' KV cache comes back and scheduling resumes.

Each transition happens only when needed (a state machine per side), so a loop that calls the
job's methods in any order stays correct, and each is timed and followed by a memory reading per
role, reported as ``perf/*`` keys (see :data:`KEYS`). Where there is no GPU the hand-off is off
and says so once: there is no GPU memory to give.
"""

from __future__ import annotations

import time
from typing import Sequence

from rlplacement.runtime.waits import get_all

TRAIN, ROLLOUT = "train", "rollout"
KEYS = {
    "perf/handoff_to_train_time": "seconds per step: engines sleep, trainer state back from host memory",
    "perf/handoff_to_rollout_time": "seconds per step: engine weights back (before the update), trainer state "
                                    "to host memory, engine KV cache back",
    "perf/handoff_{part}_time": "seconds per step of each part of both hand-offs, {part} one of trainer_offload "
                                "(the engines unmapping the trainer's memory, then its offload), trainer_reload, "
                                "engine_sleep, engine_wake (the rest is memory readings)",
    "perf/trainer_gpu_resident_gb_in_{phase}": "GiB the trainer holds on its GPU once the phase starts (largest rank)",
    "perf/trainer_gpu_peak_gb_in_{phase}": "GiB the trainer held at most during the phase (torch's peak, largest rank)",
    "perf/rollout_gpu_resident_gb_in_{phase}": "GiB an engine holds once the phase starts (largest engine)",
    "perf/rollout_gpu_peak_gb_in_rollout": "GiB an engine held at most while generating",
    "perf/gpu_used_gb_in_{phase}": "GiB used on trainer rank 0's GPU (every process on it) once both sides moved",
}


PARTS = {"unmap_trainer_memory": "trainer_offload", "offload_to_host": "trainer_offload",
         "reload_from_host": "trainer_reload", "release_memory": "engine_sleep",
         "resume_weights": "engine_wake", "resume_kv_cache": "engine_wake", "resume_all": "engine_wake"}


OOM_MARKERS = ("out of memory", "outofmemoryerror", "no available memory for the cache blocks",
               "insufficient memory")


def offload_hint(placement, message: str) -> str | None:
    """The flag to turn on when ``message`` is a GPU out-of-memory error in a colocated job that kept a
    side resident; None otherwise (the error is not about memory, or nothing more can be handed off)."""
    if not placement.colocate or not any(m in message.lower() for m in OOM_MARKERS):
        return None
    off = [f for f, on in (("--offload-train", placement.offload_train),
                           ("--offload-rollout", placement.offload_rollout)) if not on]
    if not off:
        return None
    return (f"Out of GPU memory under --colocate with {' and '.join('--no-' + f[2:] for f in off)}: the trainer and "
            f"the engines were resident on the same GPUs at once. Turn on {' and '.join(off)} (drop "
            f"{' and '.join('--no-' + f[2:] for f in off)}) so each side releases its memory while the other works.")


def skipped_reason(offload_train: bool, offload_rollout: bool, trainer_device: str) -> str | None:
    """Why the hand-off is off for this job, or None when it runs."""
    if not (offload_train or offload_rollout):
        return None
    if not trainer_device.startswith("cuda"):
        flags = " and ".join(f for f, on in (("--offload-train", offload_train), ("--offload-rollout", offload_rollout))
                             if on)
        return (f"rlplacement: {flags}: the trainer runs on {trainer_device}, so there is no GPU memory to hand "
                f"off; the hand-off is skipped (it runs where trainer and engines share a GPU).")
    return None


class ColocatedHandOff:
    def __init__(self, trainers: Sequence, engines: Sequence, *, offload_train: bool, offload_rollout: bool,
                 timeout_s: float, trainer_names: Sequence[str]):
        # the job's own lists: an engine it replaces (restarted, or a fresh one in a benchmark) is the one moved
        self.trainers, self.engines = trainers, engines
        self.offload_train, self.offload_rollout = offload_train, offload_rollout
        self.timeout_s = timeout_s
        self.trainer_names = list(trainer_names)
        self.trainer_on_host = False
        self.engines_hold = "all"  # all | weights | nothing
        self.phase: str | None = None
        self._metrics: dict[str, float] = {}

    # ---- transitions -----------------------------------------------------------------------
    # Each decides from where the two sides are (not from the last phase), so an update between
    # two rollouts, or between log-probs and the step, still ends with the right side resident.
    def to_train(self) -> None:
        engines_must_sleep = self.offload_rollout and self.engines_hold != "nothing"
        if not engines_must_sleep and not self.trainer_on_host:
            self.phase = TRAIN
            return
        start = time.perf_counter()
        self._record_peaks(ending=self.phase)
        if engines_must_sleep:
            if self.engines_hold == "weights":
                # updated but never generated: vLLM sleeps only a whole engine, so the KV cache comes
                # back first, with the trainer's state out of the way while it does
                self._trainer_to_host(None)
                self._engines("resume_kv_cache", "engine KV cache back")
            self._record("rollout", TRAIN, self._engines("release_memory", "engine sleep"))
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
            self.engines_hold = "weights"
        self._add("perf/handoff_to_rollout_time", time.perf_counter() - start)

    def to_rollout(self) -> None:
        trainer_must_leave = self.offload_train and not self.trainer_on_host
        if not trainer_must_leave and self.engines_hold == "all":
            self.phase = ROLLOUT
            return
        start = time.perf_counter()
        self._record_peaks(ending=self.phase)
        self._trainer_to_host(ROLLOUT)
        if self.engines_hold != "all":
            method = "resume_kv_cache" if self.engines_hold == "weights" else "resume_all"
            self._record("rollout", ROLLOUT, self._engines(method, "engine wake-up"))
            self.engines_hold = "all"
        self._device_reading(ROLLOUT)
        self._add("perf/handoff_to_rollout_time", time.perf_counter() - start)
        self.phase = ROLLOUT

    def pop_metrics(self) -> dict[str, float]:
        """What the hand-offs since the last call cost and the memory each role held."""
        out, self._metrics = self._metrics, {}
        return out

    # ---- parts ------------------------------------------------------------------------------
    def _trainer_to_host(self, phase: str | None) -> None:
        if self.offload_train and not self.trainer_on_host:
            # cuda_ipc keeps the trainer's weights mapped in the engines between updates: they let go
            # first, since freeing memory another process still maps is undefined (the trainer refuses)
            self._engines("unmap_trainer_memory", "engines unmapping the trainer's memory")
            reports = self._trainers("offload_to_host", "trainer offload", engines_unmapped=True)
            self.trainer_on_host = True
            if phase:
                self._record("trainer", phase, reports)

    def _trainer_resident(self, phase: str | None) -> None:
        if self.trainer_on_host:
            reports = self._trainers("reload_from_host", "trainer reload")
            self.trainer_on_host = False
            if phase:
                self._record("trainer", phase, reports)

    def _trainers(self, method: str, what: str, **kwargs) -> list[dict]:
        return self._call(self.trainers, self.trainer_names, method, what, **kwargs)

    def _engines(self, method: str, what: str) -> list[dict]:
        return self._call(self.engines, [f"engine {i}" for i in range(len(self.engines))], method, what)

    def _call(self, actors: Sequence, names: Sequence[str], method: str, what: str, **kwargs) -> list[dict]:
        """``method`` on every actor, bounded; a move (not a memory reading) adds its seconds to its part."""
        start = time.perf_counter()
        out = get_all([getattr(a, method).remote(**kwargs) for a in actors], self.timeout_s, what, names)
        part = PARTS.get(method)
        if part is not None:
            self._add(f"perf/handoff_{part}_time", time.perf_counter() - start)
        return out

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
        if ending == ROLLOUT and self.engines_hold == "all":
            self._put("perf/rollout_gpu_peak_gb_in_rollout", self._engines("gpu_memory", "engine memory"), "peak_gb")

    def _put(self, key: str, reports: list[dict], field: str) -> None:
        """``key`` = the largest ``field`` over the ranks or engines that report it (none without CUDA)."""
        values = [r[field] for r in reports if r.get(field) is not None]
        if values:
            self._metrics[key] = max(values)

    def _add(self, key: str, seconds: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + seconds
