"""``StepRecorder``: phase timers per role -> one telemetry row per step (JSONL + the same dict).

Usage in a loop (colocated, split, or one-step-off async alike)::

    tel = StepRecorder("run.jsonl", trainer_gpus=4, rollout_gpus=4, rollout_gpus_per_engine=2)
    h = tel.open("rollout")                       # prompts dispatched to the engines
    for step in range(n):
        batch = ray.get(futures, timeout=600)
        tel.close(h, end=max(b.finished_at for b in batch))  # each engine stamps its batch end
        tel.record_samples(lengths, finish_times)
        with tel.phase("sync"):                   # both roles busy (pause, send, resume)
            push_weights()
        h = tel.open("rollout")                   # one-step-off: next rollout overlaps training
        for start, end in ray.get(train_refs, timeout=600):    # timestamps from trainer ranks
            tel.record_interval("train", start, end)
        tel.record_logprobs(trainer_lp, engine_lp)
        logger.log(tel.end_step(step))           # trackers=... given: also logged to W&B / TensorBoard

Invariants:

* Step ``k``'s window runs from the end of step ``k-1`` (for the first step: the earliest interval
  it saw) to ``end_step``. Waits are the window minus each role's busy time (see
  :mod:`.intervals`); an interval still open at ``end_step`` counts as busy up to that moment and
  the rest of it lands in later windows, so async overlap is never counted twice or lost. When it
  is closed with an end stamp earlier than a window that counted it busy, the idle time that
  follows is credited to the step that closes it (waits add up over the run; in one-step-off the
  rollout's idle appears one step late). The trainer's phases close within their step, so its
  identity ``step_time = train_time + update_weights_time + train_wait_time`` holds per step
  whenever its phases do not overlap each other.
* Phase times (``perf/rollout_time`` ...) are the wall time of the intervals *closed* during the
  step, whole (not clipped to the window): in one-step-off, step k reports the rollout whose
  batch it trained on, though that rollout started in step k-1's window.
* Timestamps are ``time.time()`` so other processes' timestamps can be recorded directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

from rlplacement.telemetry.gpu_util import PhaseUtilSampler
from rlplacement.telemetry.intervals import ROLES, Interval, idle_time, overlap_time, phase_time, roles_for
from rlplacement.telemetry.jsonl import append_row
from rlplacement.telemetry.trackers import Tracker

# names of the telemetry contract (docs/telemetry.md)
STEP_TIME = "perf/step_time"
ROLLOUT_TIME = "perf/rollout_time"
SYNC_TIME = "perf/update_weights_time"
TRAIN_TIME = "perf/train_time"
TRAIN_WAIT = "perf/train_wait_time"
ROLLOUT_WAIT = "perf/rollout_wait_time"
TRAIN_OVERLAP = "perf/train_overlap_time"
RESPONSE_LENGTHS = "rollout/response_lengths"
FINISH_TIMES = "rollout/sample_finish_times"
LOGPROB_DIFF = "rollout/logprob_abs_diff"
LOGPROB_DIFF_MAX = "rollout/logprob_abs_diff_max"
SYNC_BYTES = "perf/update_weights_bytes"
GPU_UTIL = {"trainer": "perf/trainer_gpu_util", "rollout": "perf/rollout_gpu_util"}
PHASE_TIME = {"rollout": ROLLOUT_TIME, "sync": SYNC_TIME, "train": TRAIN_TIME}


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """The layout fields every row carries, so the advisor needs nothing but the file."""

    trainer_gpus: int
    rollout_gpus: int
    rollout_gpus_per_engine: int = 1
    colocate: bool = False
    num_gpus_per_node: int = 8
    transfer_mode: str | None = None
    max_response_len: int | None = None
    group_size: int | None = None
    kv_cache_tokens: int | None = None  # per engine (the smallest): caps how many sequences decode at once
    max_num_seqs: int | None = None
    prompt_len: int | None = None  # mean prompt tokens: a sequence holds prompt + response in the KV cache
    # placement flags that refuse some layouts (rlplacement/args/placement.py), so the advisor never
    # recommends a layout the run's own flags would refuse: --colocate refuses --one-step-off, a split
    # refuses --offload-train, --offload-rollout and --offload-rollout-keep-weights (None: not given)
    one_step_off: bool = False
    offload_train: bool | None = None
    offload_rollout: bool | None = None
    offload_rollout_keep_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("trainer_gpus", "rollout_gpus", "rollout_gpus_per_engine", "num_gpus_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.rollout_gpus % self.rollout_gpus_per_engine:
            raise ValueError(f"rollout_gpus {self.rollout_gpus} is not a multiple of rollout_gpus_per_engine "
                             f"{self.rollout_gpus_per_engine}")

    @classmethod
    def from_placement(cls, placement, transfer_mode: str | None = None, **workload) -> "RunLayout":
        """From :class:`rlplacement.config.PlacementConfig` (and the transfer mode actually used)."""
        return cls(placement.trainer_num_gpus, placement.rollout_num_gpus, placement.rollout_num_gpus_per_engine,
                   placement.colocate, placement.num_gpus_per_node, transfer_mode, **workload,
                   one_step_off=placement.one_step_off, offload_train=placement.offload_train,
                   offload_rollout=placement.offload_rollout,
                   offload_rollout_keep_weights=placement.offload_rollout_keep_weights)


@dataclasses.dataclass
class _Open:
    phase: str
    roles: tuple[str, ...]
    start: float
    counted_until: float | None = None  # end of the last window that counted it busy
    samplers: dict[str, PhaseUtilSampler] = dataclasses.field(default_factory=dict)


def _flat_floats(values: Any) -> list[float]:
    """Numbers from a flat or nested sequence, or anything with ``tolist()`` (a tensor, an array)."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (int, float)):
        return [float(values)]
    return [x for v in values for x in _flat_floats(v)]


class StepRecorder:
    """Records one step's phases per role and emits the contract row. Not thread-safe: one driver."""

    def __init__(self, path: str | os.PathLike | None = None, layout: RunLayout | None = None, *,
                 gpu_devices: dict[str, Sequence[int]] | None = None,
                 clock: Callable[[], float] = time.time, trackers: Iterable[Tracker] = (),
                 **layout_fields: Any):
        """``layout`` or its fields as keywords (``trainer_gpus=..., rollout_gpus=...``).

        ``gpu_devices`` maps a role to the local device indices whose NVML utilization is sampled
        inside that role's phases (the driver must see them); absent on CPU either way.
        ``trackers`` (``rlplacement.telemetry.trackers.build_trackers(config.tracking)``, or any objects with
        ``log(step, row)``) each get every row ``end_step`` returns; closing them is their owner's business.
        """
        if layout is None:
            layout = RunLayout(**layout_fields)
        elif layout_fields:
            raise TypeError("pass layout= or its fields as keywords, not both")
        self.path = os.fspath(path) if path is not None else None
        self.layout = layout
        self.trackers = list(trackers)
        self._gpu_devices = {r: list(d) for r, d in (gpu_devices or {}).items()}
        self._clock = clock
        self._t0: float | None = None            # first timestamp seen, fixed; timeline times are relative to it
        self._window_start: float | None = None  # end of the previous step
        self._intervals: list[Interval] = []     # may still overlap the current window
        self._closed_this_step: list[Interval] = []
        self._open: dict[int, _Open] = {}
        self._late_idle: dict[str, float] = {r: 0.0 for r in ROLES}
        self._handles = itertools.count()
        self._util: dict[str, list[tuple[float, float]]] = {r: [] for r in ROLES}  # (value, weight)
        self._lengths: list[int] = []
        self._finish: list[float] = []
        self._logprob_diffs: list[float] = []

    # ---- recording ---------------------------------------------------------------------------
    def record_interval(self, phase: str, start: float, end: float, role: str | None = None,
                        gpu_util: float | None = None) -> None:
        """A finished phase measured elsewhere (e.g. start/end returned by a Ray actor).

        ``role`` defaults to the phase's own (sync: both). ``gpu_util`` is the utilization that
        process sampled inside the phase, if it did.
        """
        for r in roles_for(phase, role):
            iv = Interval(r, phase, float(start), float(end))
            self._intervals.append(iv)
            self._closed_this_step.append(iv)
            if gpu_util is not None:
                self._util[r].append((float(gpu_util), iv.duration))
        if self._t0 is None:
            self._t0 = float(start)

    def open(self, phase: str, role: str | None = None, start: float | None = None) -> int:
        """Start a phase that ends later, possibly after this step ends (async rollout); a handle.

        GPU utilization of the role's ``gpu_devices`` is sampled until :meth:`close` (NVML sees
        every GPU of the host, so the driver can watch an engine's GPU from outside its process).
        """
        start = self._clock() if start is None else float(start)
        handle = next(self._handles)
        roles = roles_for(phase, role)
        samplers = {r: PhaseUtilSampler(self._gpu_devices.get(r)).start() for r in roles}
        self._open[handle] = _Open(phase, roles, start, samplers=samplers)
        if self._t0 is None:
            self._t0 = start
        return handle

    def close(self, handle: int, end: float | None = None, gpu_util: float | None = None) -> None:
        try:
            op = self._open.pop(handle)
        except KeyError:
            raise ValueError(f"handle {handle} is not open (closed twice, or not from this recorder)") from None
        end = self._clock() if end is None else float(end)
        for r in op.roles:
            sampled = op.samplers[r].stop() if r in op.samplers else None
            self.record_interval(op.phase, op.start, end, role=r, gpu_util=gpu_util if gpu_util is not None else sampled)
        if op.counted_until is not None and end < op.counted_until:
            self._credit_late_idle(op, end)

    def _credit_late_idle(self, op: _Open, end: float) -> None:
        """Earlier windows counted ``op`` busy up to ``counted_until``; it really ended at ``end``.

        The part of ``[end, counted_until]`` that no other interval of the role covered was idle;
        it is added to this step's wait, so waits over a run add up though the end of a remote
        phase is learned late (one-step-off: the rollout's idle shows one step later).
        """
        others = [Interval(r, o.phase, o.start, max(o.start, o.counted_until or o.start))
                  for o in self._open.values() for r in o.roles]
        for r in op.roles:
            self._late_idle[r] += idle_time(self._intervals + others, r, end, op.counted_until)

    @contextlib.contextmanager
    def phase(self, phase: str, role: str | None = None) -> Iterator[None]:
        """Time a phase run by this process; GPU utilization is sampled inside it where NVML works."""
        roles = roles_for(phase, role)
        samplers = {r: PhaseUtilSampler(self._gpu_devices.get(r)).start() for r in roles}
        start = self._clock()
        try:
            yield
        finally:
            end = self._clock()
            for r in roles:
                self.record_interval(phase, start, end, role=r, gpu_util=samplers[r].stop())

    def record_samples(self, response_lengths: Iterable[int], finish_times: Iterable[float] | None = None) -> None:
        """Response lengths (tokens) and, where known, each sample's finish time in seconds after
        the batch was dispatched. Several calls in one step accumulate."""
        lengths = [int(x) for x in _flat_floats(list(response_lengths))]
        self._lengths.extend(lengths)
        if finish_times is not None:
            finish = _flat_floats(list(finish_times))
            if len(finish) != len(lengths):
                raise ValueError(f"{len(finish)} finish times for {len(lengths)} response lengths: pass one per sample")
            self._finish.extend(finish)

    def record_logprobs(self, trainer_logprobs: Any, engine_logprobs: Any) -> None:
        """Log-probs of the sampled tokens from the trainer and from the engine (same order, any
        nesting, lists or tensors); the row reports mean and max of their absolute difference."""
        t, e = _flat_floats(trainer_logprobs), _flat_floats(engine_logprobs)
        if len(t) != len(e):
            raise ValueError(f"{len(t)} trainer log-probs vs {len(e)} engine log-probs: they must cover the same tokens")
        self._logprob_diffs.extend(abs(a - b) for a, b in zip(t, e))

    # ---- the row -----------------------------------------------------------------------------
    def end_step(self, step: int, end: float | None = None, **extra: Any) -> dict:
        """Close the step window, write one JSONL row (if a path was given), log it to every tracker and
        return it.

        ``extra`` adds fields (reward, ``perf/update_weights_bytes`` ...); it may not overwrite a
        contract name.
        """
        end = self._clock() if end is None else float(end)
        open_now = [Interval(r, o.phase, o.start, max(o.start, end)) for o in self._open.values() for r in o.roles]
        if self._window_start is not None:
            start = self._window_start
        else:
            starts = [i.start for i in self._intervals + open_now]
            start = min(starts) if starts else end
        start = min(start, end)
        everything = self._intervals + open_now
        row: dict[str, Any] = {"step": step, STEP_TIME: end - start}
        for phase_name, key in PHASE_TIME.items():
            row[key] = phase_time(self._closed_this_step, phase_name)
        row[TRAIN_WAIT] = idle_time(everything, "trainer", start, end) + self._late_idle["trainer"]
        row[ROLLOUT_WAIT] = idle_time(everything, "rollout", start, end) + self._late_idle["rollout"]
        row[TRAIN_OVERLAP] = overlap_time(everything, "train", "rollout", start, end)
        row[RESPONSE_LENGTHS] = list(self._lengths)
        row[FINISH_TIMES] = list(self._finish) if self._finish else None
        diffs = self._logprob_diffs
        row[LOGPROB_DIFF] = sum(diffs) / len(diffs) if diffs else None
        row[LOGPROB_DIFF_MAX] = max(diffs) if diffs else None
        for role, key in GPU_UTIL.items():
            pairs = self._util[role]
            weight = sum(w for _, w in pairs)
            row[key] = (sum(v * w for v, w in pairs) / weight if weight > 0 else
                        (sum(v for v, _ in pairs) / len(pairs) if pairs else None))
        row.update({k: v for k, v in dataclasses.asdict(self.layout).items()})
        t0 = self._t0 if self._t0 is not None else start
        row["timeline"] = {"t0": t0, "step_start": start - t0, "step_end": end - t0,
                           "intervals": [[i.role, i.phase, i.start - t0, i.end - t0] for i in self._closed_this_step]}
        clash = set(extra) & set(row)
        if clash:
            raise ValueError(f"end_step extra fields {sorted(clash)} would overwrite recorded ones: rename them")
        row.update(extra)
        if self.path is not None:
            append_row(self.path, row)
        self._next_window(end)
        for tracker in self.trackers:
            tracker.log(step, row)
        return row

    def _next_window(self, end: float) -> None:
        self._window_start = end
        for op in self._open.values():
            op.counted_until = end
        # keep what a still-open interval's late close may need to look back over
        keep_from = min([end] + [o.start for o in self._open.values()])
        self._intervals = [i for i in self._intervals if i.end > keep_from]
        self._late_idle = {r: 0.0 for r in ROLES}
        self._closed_this_step = []
        self._util = {r: [] for r in ROLES}
        self._lengths, self._finish, self._logprob_diffs = [], [], []


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile of ``values`` (q in [0, 1]); NaN for an empty sequence."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
