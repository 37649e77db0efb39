"""Step time and staleness of sync, one-step-off, training during rollout and fully async rollout, predicted
from one measured run.

Inputs, from a run's telemetry rows (steps after ``skip_steps``): every sample's finish time from the
start of its step's rollout (``rollout/sample_finish_times``: its generation time when it shares the
engines with one step's samples), the train time and the update time per step (medians), the group size and
the samples per step. Scale factors move them to another split (``rollout_scale``, ``train_scale``: the
step model's predicted over measured phases).

* **sync**: the trainer waits for the whole batch: step = R + T + U, with R the slowest sample of a step
  (the median over the measured steps). Staleness 0.
* **one-step-off**: step k+1 generates while step k trains, and the update waits for that batch:
  step = max(R, T) + U; every sample one version behind.
* **train-during-rollout**: each group trains as soon as it is ready (its slowest sample) and the trainer is
  free, taking T x group size / samples of training; the update follows the last group's training:
  step = end of the last chunk + U (the median over the measured steps). Staleness 0. The optimizer's own
  step, which runs once after the last chunk, is counted as spread over the chunks (T is not split in the
  telemetry), so the prediction is low by at most that step. On GPUs that train and generate at once (a
  colocated layout with both resident) ``overlap_slowdown`` s says what the shared GPU costs: each second of
  a chunk's training delays the groups still generating by s seconds (0: separate GPUs; 1: the GPU serves
  one side at a time); :func:`measured_overlap_slowdown` reads s off a sync run and a run with the flag.
* **fully async**: an event simulation. Groups of the measured samples (cycled in order) are submitted
  while fewer than ``max_concurrent`` samples are in flight or ready; a group is ready when its slowest
  sample is; the trainer takes ``prompts_per_step`` ready groups, trains T, updates U (the version goes up
  at the update's end). A group's staleness is the version when the trainer takes it minus the version it
  started under (its oldest token: every sample starts with the group); a group over
  ``max_staleness`` is recycled (submitted again). Step time is the steady interval between train starts.

What the model leaves out, named so that a miss can be read: a sample's generation time does not depend on
how many run beside it (under fully async up to ``max_concurrent`` do, more than in the measured sync run);
an update does not slow the generation in flight (``retract`` recomputes the KV of every running request);
training beside generation does not slow it unless ``overlap_slowdown`` says by how much.
"""

from __future__ import annotations

import dataclasses
import heapq
import statistics
from typing import Sequence

MODES = ("sync", "one-step-off", "train-during-rollout", "fully-async")
FLAGS = {"sync": "", "one-step-off": "--one-step-off", "train-during-rollout": "--train-during-rollout",
         "fully-async": "--fully-async --partial-rollout --use-tis"}


@dataclasses.dataclass(frozen=True)
class AsyncInputs:
    """What the prediction reads off a run."""

    sample_times: tuple[tuple[float, ...], ...]
    """Per measured step, each sample's generation time (s), in sample order (groups consecutive)."""
    train_time: float
    update_time: float
    group_size: int

    @property
    def samples_per_step(self) -> int:
        return len(self.sample_times[0]) if self.sample_times else 0

    @property
    def prompts_per_step(self) -> int:
        return max(1, self.samples_per_step // self.group_size)


@dataclasses.dataclass(frozen=True)
class AsyncPrediction:
    mode: str
    step_time: float
    train_wait_time: float
    """The trainer's idle time per step: step time minus training and the update."""
    mean_staleness: float
    max_staleness: int
    stale_groups_filtered_per_step: float = 0.0


def inputs_from_rows(rows: Sequence[dict], skip_steps: int = 1) -> AsyncInputs:
    """The inputs of a run that recorded each sample's finish time (a sync or one-step-off run of the example
    loop, or any loop that calls ``StepRecorder.record_samples`` with finish times)."""
    used = [r for r in rows if r.get("step", 0) >= skip_steps] or list(rows)
    times = tuple(tuple(float(t) for t in r["rollout/sample_finish_times"]) for r in used
                  if r.get("rollout/sample_finish_times"))
    if not times:
        raise ValueError("the rows have no rollout/sample_finish_times: predict from a run that records each "
                         "sample's finish time (the example loop without --fully-async)")
    group = int(used[0].get("group_size") or 1)
    return AsyncInputs(times, statistics.median(r["perf/train_time"] for r in used),
                       statistics.median(r["perf/update_weights_time"] for r in used), group)


def predict_modes(x: AsyncInputs, *, other: float = 0.0, max_staleness: int | None = 2,
                  **scales: float) -> list[AsyncPrediction]:
    """Every mode's prediction, each step plus ``other`` (the measured run's step beyond its phases: driver
    time the phases miss, which every mode pays once a step)."""
    out = []
    for mode in MODES:
        p = predict(x, mode, max_staleness=max_staleness if mode == "fully-async" else None, **scales)
        out.append(dataclasses.replace(p, step_time=p.step_time + other))
    return out


def recommend_mode(predictions: Sequence[AsyncPrediction], max_staleness: int | None = 2, *,
                   colocate: bool = False) -> tuple[AsyncPrediction, str]:
    """The fastest mode whose staleness stays within ``max_staleness`` (ties go to the less stale, then to the
    earlier in :data:`MODES`), and the flags that select it. ``colocate``: the run time-shares its GPUs, where
    training during rollout and fully async need both sides resident (the offload flags off)."""
    allowed = [p for p in predictions if max_staleness is None or p.max_staleness <= max_staleness]
    best = min(allowed, key=lambda p: (round(p.step_time, 6), p.mean_staleness))
    flags = FLAGS[best.mode]
    if best.mode == "fully-async" and max_staleness is not None:
        flags += f" --max-weight-staleness {max_staleness}"
    if best.mode in ("train-during-rollout", "fully-async") and colocate:
        flags += " --no-offload-train --no-offload-rollout"
    return best, flags


def predict(x: AsyncInputs, mode: str, *, rollout_scale: float = 1.0, train_scale: float = 1.0,
            max_concurrent: int | None = None, max_staleness: int | None = None,
            steps: int = 200, overlap_slowdown: float = 0.0) -> AsyncPrediction:
    """``mode``'s steady step (see the module docstring); ``max_concurrent``: samples in flight or ready at
    most (default two steps', as ``--async-max-concurrent-samples``); ``max_staleness``: the bound;
    ``overlap_slowdown``: training during rollout on GPUs the engines share (module docstring)."""
    t, u, slowest, cap = _phases(x, rollout_scale, train_scale, max_concurrent)
    if mode == "sync":
        step = slowest + t + u
        return AsyncPrediction(mode, step, step - t - u, 0.0, 0)
    if mode == "one-step-off":
        step = max(slowest, t) + u
        return AsyncPrediction(mode, step, step - t - u, 1.0, 1)
    if mode == "train-during-rollout":
        step = statistics.median(_chunks(times, x.group_size, t, rollout_scale, overlap_slowdown)[-1][1]
                                 for times in x.sample_times) + u
        return AsyncPrediction(mode, step, step - t - u, 0.0, 0)
    if mode != "fully-async":
        raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    return _simulate(x, t, u, rollout_scale, cap, max_staleness, steps)


def _phases(x: AsyncInputs, rollout_scale: float, train_scale: float,
            max_concurrent: int | None) -> tuple[float, float, float, int]:
    """(train, update, a step's slowest sample, samples in flight or ready at most), scaled to the split."""
    slowest = statistics.median(max(s) for s in x.sample_times) * rollout_scale
    return x.train_time * train_scale, x.update_time, slowest, max_concurrent or 2 * x.samples_per_step


def _chunks(times: Sequence[float], g: int, t: float, scale: float,
            slowdown: float = 0.0) -> list[tuple[float, float]]:
    """One step's training during rollout: each group's (start, end) of training, in the order the groups are
    ready; a group trains once ready and the trainer is free, for ``t`` x its share of the step's samples. A
    chunk that starts before the next group is ready delays the groups after it by ``slowdown`` x its length."""
    per_group = t * g / len(times)
    readies = sorted(max(times[i:i + g]) * scale for i in range(0, len(times), g))
    chunks, free, delay = [], 0.0, 0.0
    for i, ready in enumerate(readies):
        start = max(free, ready + delay)
        free = start + per_group
        chunks.append((start, free))
        if i + 1 < len(readies) and readies[i + 1] + delay > start:
            delay += slowdown * per_group
    return chunks


def _simulate(x: AsyncInputs, t: float, u: float, scale: float, cap: int, bound: int | None,
              steps: int, timeline: dict | None = None) -> AsyncPrediction:
    g, per_step = x.group_size, x.prompts_per_step
    pool = [times[i:i + g] for times in x.sample_times for i in range(0, len(times), g)]
    drawn = 0
    ready: list[tuple[float, int, int]] = []  # (ready at, submit order, version at start)
    in_flight = 0  # groups submitted and not yet taken (flight or ready)
    now, version = 0.0, 0
    starts, staleness, filtered = [], [], 0

    def top_up(at: float) -> None:
        nonlocal drawn, in_flight
        while (in_flight + 1) * g <= cap:
            done = at + max(pool[drawn % len(pool)]) * scale  # a group is ready with its slowest sample
            heapq.heappush(ready, (done, drawn, version))
            if timeline is not None:
                timeline["rollout"].append(("rollout", at, done))
            drawn += 1
            in_flight += 1

    top_up(0.0)
    for _ in range(steps):
        taken = 0
        while taken < per_step:
            at, _, started = heapq.heappop(ready)
            now = max(now, at)
            in_flight -= 1
            if bound is not None and version - started > bound:
                filtered += 1
            else:
                staleness.append(version - started)
                taken += 1
            top_up(now)
        starts.append(now)
        if timeline is not None:
            timeline["trainer"] += [("train", now, now + t), ("sync", now + t, now + t + u)]
        now += t + u
        version += 1
        top_up(now)
    half = len(starts) // 2  # steady state: the second half
    step = (starts[-1] - starts[half]) / max(1, len(starts) - 1 - half)
    late = staleness[len(staleness) // 2:]
    return AsyncPrediction("fully-async", step, max(0.0, step - t - u), statistics.fmean(late), max(late),
                           filtered / steps)


def measured(rows: Sequence[dict], skip_steps: int = 2) -> dict:
    """A run's own figures to hold a prediction against: median step, the trainer's mean idle per step, and
    staleness as the loop records it."""
    used = [r for r in rows if r.get("step", 0) >= skip_steps]
    out = {"step_time": statistics.median(r["perf/step_time"] for r in used),
           "train_wait_time": statistics.fmean(r["perf/train_wait_time"] for r in used)}
    if any("rollout/fully_async/avg_staleness" in r for r in used):
        out["mean_staleness"] = statistics.fmean(r["rollout/fully_async/avg_staleness"] for r in used)
        out["max_staleness"] = max(r["rollout/fully_async/max_staleness"] for r in used)
    elif any("rollout/staleness" in r for r in used):
        out["mean_staleness"] = statistics.fmean(r["rollout/staleness"] for r in used)
        out["max_staleness"] = max(r["rollout/staleness"] for r in used)
    else:
        out["mean_staleness"], out["max_staleness"] = 0.0, 0
    return out


def measured_overlap_slowdown(sync_rows: Sequence[dict], flag_rows: Sequence[dict], skip_steps: int = 2) -> float:
    """``overlap_slowdown`` as two runs of the same samples show it, one sync and one with training during
    rollout: how much longer the rollout took per second of training that ran beside it (medians over the
    steps after ``skip_steps``; 0 where no training overlapped)."""
    def median(rows: Sequence[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows if r.get("step", 0) >= skip_steps)

    overlap = median(flag_rows, "perf/train_overlap_time")
    if overlap <= 0:
        return 0.0
    return max(0.0, (median(flag_rows, "perf/rollout_time") - median(sync_rows, "perf/rollout_time")) / overlap)


def timeline(x: AsyncInputs, mode: str, steps: int = 4, *, rollout_scale: float = 1.0, train_scale: float = 1.0,
             max_concurrent: int | None = None, max_staleness: int | None = None) -> dict[str, list]:
    """The predicted first ``steps`` steps of ``mode`` as ``{role: [(phase, start, end), ...]}`` (roles
    ``trainer`` and ``rollout``; the rollout's intervals may overlap: groups generating at once), what the
    plot of predicted bubbles draws."""
    t, u, slowest, cap = _phases(x, rollout_scale, train_scale, max_concurrent)
    out: dict[str, list] = {"trainer": [], "rollout": []}
    if mode == "fully-async":
        _simulate(x, t, u, rollout_scale, cap, max_staleness, steps, out)
        return out
    now = 0.0
    if mode == "one-step-off":
        out["rollout"].append(("rollout", 0.0, slowest))
        now = slowest
    for _ in range(steps):
        if mode == "sync":
            out["rollout"].append(("rollout", now, now + slowest))
            now += slowest
            out["trainer"] += [("train", now, now + t), ("sync", now + t, now + t + u)]
            now += t + u
        elif mode == "train-during-rollout":  # the groups train as they are ready; the update after the last
            times = x.sample_times[len(out["rollout"]) % len(x.sample_times)]
            out["rollout"].append(("rollout", now, now + max(times) * rollout_scale))
            chunks = _chunks(times, x.group_size, t, rollout_scale)
            out["trainer"] += [("train", now + start, now + end) for start, end in chunks]
            now += chunks[-1][1]
            out["trainer"].append(("sync", now, now + u))
            now += u
        elif mode == "one-step-off":  # the next batch generates while this one trains; the update waits for it
            out["rollout"].append(("rollout", now, now + slowest))
            out["trainer"].append(("train", now, now + t))
            now = max(now + slowest, now + t)
            out["trainer"].append(("sync", now, now + u))
            now += u
        else:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
    return out
