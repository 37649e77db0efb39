"""Telemetry rows -> one :class:`Measurement`: the layout and the median step in phases.

Medians over steps (after the warm-up steps) rather than means: on a shared machine one slow
step should not move the advice. A file holding only warm-up steps is still measured (from
them), with a warning in ``Measurement.warnings``: warm-up steps load and compile, so advice
from them is not advice about the run. Rows must carry the layout fields of the telemetry contract;
a missing one is an error naming the field, because guessing the layout would make every
prediction wrong. ``transfer_transport`` (what carried the update) may be absent from rows recorded
before it existed: the transport is then assumed from the layout, with a warning. So may
``one_step_off``: rollout overlapping training in the timeline (or the loop's ``rollout/staleness``)
then says the run was one-step-off.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

from rlplacement.telemetry import quantile, union_length

PHASE_KEYS = {"step": "perf/step_time", "rollout": "perf/rollout_time", "sync": "perf/update_weights_time",
              "train": "perf/train_time", "train_wait": "perf/train_wait_time",
              "rollout_wait": "perf/rollout_wait_time"}
LAYOUT_KEYS = ("trainer_gpus", "rollout_gpus", "rollout_gpus_per_engine", "colocate")


@dataclasses.dataclass(frozen=True)
class Placement:
    """A layout the advisor compares: colocated on ``trainer_gpus`` (= rollout) or split."""

    colocate: bool
    trainer_gpus: int
    rollout_gpus: int

    @property
    def total_gpus(self) -> int:
        return self.trainer_gpus if self.colocate else self.trainer_gpus + self.rollout_gpus

    def to_json(self) -> dict:
        return {"colocate": self.colocate, "trainer_gpus": self.trainer_gpus, "rollout_gpus": self.rollout_gpus}

    def __str__(self) -> str:
        return f"colocated on {self.trainer_gpus}" if self.colocate else f"{self.trainer_gpus}:{self.rollout_gpus}"


@dataclasses.dataclass(frozen=True)
class Measurement:
    placement: Placement
    gpus_per_engine: int
    num_gpus_per_node: int
    transfer_mode: str | None
    steps: int                     # rows used (after warm-up)
    step_time: float
    rollout_time: float
    sync_time: float               # the update's time outside rollout (perf/update_weights_time less waiting for a batch)
    train_time: float
    train_wait: float
    rollout_wait: float
    rollout_tail: float            # seconds of rollout after the bulk quantile of samples finished
    rollout_scalable: float        # seconds of rollout that divide over engines (throughput-bound)
    rollout_fit: str               # how rollout_scalable was found: "decode-fit" or "quantile"
    finish_p50: float | None       # sample finish times, seconds after dispatch
    finish_p99: float | None
    tail_share: float              # rollout_tail / rollout_time
    samples_per_step: float
    max_response_len: float        # the cap recorded by the loop, else the longest response seen
    group_size: int | None
    sync_bytes: float | None
    sync_density: float | None     # disk-delta: changed bytes / all bytes (perf/update_weights_density)
    overlapped: bool               # rollout ran while the trainer trained (one-step-off async)
    response_lengths: tuple[int, ...]
    kv_cache_tokens: int | None = None  # per engine: with prompt + response length, caps sequences in flight
    max_num_seqs: int | None = None
    prompt_len: float | None = None
    handoff_time: float | None = None  # colocated --offload-*: seconds per step handing the GPU over (both ways)
    handoff_bytes: float | None = None  # of which bytes over PCIe per step, on the busiest GPU (perf/handoff_bytes_*)
    handoff_move_time: float | None = None  # and the seconds spent moving them (the rest does not scale with bytes)
    warnings: tuple[str, ...] = ()  # what makes this measurement a poor basis for advice, said to the user
    transport: str | None = None  # what carried the update (transfer_transport); None: not recorded
    one_step_off: bool = False  # the run's --one-step-off (recorded, else seen: rollout overlapped training)
    split_refused_by: tuple[str, ...] = ()  # flags this colocated run was given that a split layout refuses
    update_weights_time: float | None = None  # median perf/update_weights_time as the loop timed it


def _median(rows: Sequence[dict], key: str) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else 0.0


def _require_layout(rows: Sequence[dict], source: str) -> dict:
    first = rows[0]
    missing = [k for k in LAYOUT_KEYS if k not in first]
    if missing:
        raise ValueError(f"{source} lacks the layout field(s) {missing}: record telemetry with "
                         f"rlplacement.telemetry.StepRecorder (or add them to every row)")
    changed = [k for k in LAYOUT_KEYS if any(r.get(k) != first[k] for r in rows)]
    if changed:
        raise ValueError(f"{source} mixes layouts ({changed} change between steps): advise on one run at a time")
    for key in ("perf/step_time", "perf/rollout_time", "perf/train_time"):
        if first.get(key) is None:
            raise ValueError(f"{source} lacks {key!r}: the advisor needs the phase times of the telemetry contract")
    return first


def _intervals(rows: Sequence[dict], phase: str) -> list[tuple[float, float]]:
    """``phase``'s intervals in these rows' timelines (seconds after the run's t0, so rows line up);
    sync is recorded once per role: the trainer's copy."""
    return [(start, end) for r in rows for role, ph, start, end in (r.get("timeline") or {}).get("intervals", [])
            if ph == phase and (phase != "sync" or role == "trainer")]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return union_length(a) + union_length(b) - union_length(a + b)


def _overlapped(rows: Sequence[dict]) -> bool:
    """True when rollout and train intervals overlap in time somewhere in the run."""
    rollout, train = _intervals(rows, "rollout"), _intervals(rows, "train")
    if not rollout or not train:
        return False
    return _overlap(rollout, train) > 1e-3 * union_length(train)


def _sync_outside_rollout(used: Sequence[dict], rows: Sequence[dict]) -> float | None:
    """Median per step of the weight update's time outside every rollout of the run; None without timelines.

    An engine applies an update only after the batch it is generating (one-step-off: the next step's,
    dispatched before training), so the loop's timed sync includes waiting for that rollout. The wait
    is rollout, which the model already counts; left in, it would make a one-step-off run look
    sync-bound and the model's max(rollout, train) + sync count it twice. Rollouts of every row are used, since
    the rollout a step's sync waits for is closed (and recorded) in the next step's row.
    """
    rollout = _intervals(rows, "rollout")
    per_step = [union_length(sync) - _overlap(sync, rollout) for r in used if (sync := _intervals([r], "sync"))]
    return statistics.median(per_step) if per_step else None


def _tail_stats(rows: Sequence[dict], bulk_quantile: float) -> tuple[float, float | None, float | None]:
    tails, p50s, p99s = [], [], []
    for r in rows:
        finish = r.get("rollout/sample_finish_times")
        if not finish:
            continue
        bulk_done = quantile(finish, bulk_quantile)
        tails.append(max(0.0, float(r["perf/rollout_time"]) - bulk_done))
        p50s.append(quantile(finish, 0.5))
        p99s.append(quantile(finish, 0.99))
    if not tails:
        return 0.0, None, None
    return statistics.median(tails), statistics.median(p50s), statistics.median(p99s)


def cumulative_tokens(lengths: Sequence[int]) -> list[float]:
    """For each sample: tokens the whole batch decoded until it finished, sum_j min(L_j, L_i)."""
    order = sorted(lengths)
    prefix, acc = {}, 0
    n = len(order)
    for k, length in enumerate(order):  # sum_j min(L_j, L) = (sum of shorter) + L * (number not shorter)
        prefix.setdefault(length, acc + length * (n - k))
        acc += length
    return [float(prefix[length]) for length in lengths]


def _decode_fit(lengths: Sequence[int], finish: Sequence[float]) -> tuple[float, float] | None:
    """Least-squares ``finish_i ~ a * L_i + c * C_i`` with a, c >= 0.

    A decode step costs a fixed part (reading the weights: latency-bound, the same for 1 or 100
    running sequences) plus a part per running sequence (throughput-bound). Sample i finishes
    after L_i steps during which the batch decoded C_i tokens, so its finish time is
    a * L_i + c * C_i. ``c * total tokens`` is the part of rollout that more engines divide.
    """
    if len(lengths) < 3 or len(lengths) != len(finish):
        return None
    xs, ys, zs = [float(x) for x in lengths], cumulative_tokens(lengths), [float(f) for f in finish]
    sxx, syy, sxy = sum(x * x for x in xs), sum(y * y for y in ys), sum(x * y for x, y in zip(xs, ys))
    sxz, syz = sum(x * z for x, z in zip(xs, zs)), sum(y * z for y, z in zip(ys, zs))
    det = sxx * syy - sxy * sxy
    if det <= 1e-3 * sxx * syy:  # lengths (nearly) all equal: latency and throughput cannot be told apart
        return None
    a, c = (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det
    if a < 0 or c < 0:  # clamp to the better one-term fit
        only_a, only_c = sxz / sxx, syz / syy
        err_a = sum((z - only_a * x) ** 2 for x, z in zip(xs, zs))
        err_c = sum((z - only_c * y) ** 2 for y, z in zip(ys, zs))
        a, c = (max(only_a, 0.0), 0.0) if err_a <= err_c else (0.0, max(only_c, 0.0))
    return a, c


def _scalable_rollout(rows: Sequence[dict], tail: float, rollout_time: float) -> tuple[float, str]:
    scalable = []
    for r in rows:
        lengths, finish = r.get("rollout/response_lengths") or [], r.get("rollout/sample_finish_times") or []
        fitted = _decode_fit(lengths, finish)
        if fitted is None:
            continue
        scalable.append(min(float(r["perf/rollout_time"]), fitted[1] * sum(lengths)))
    if scalable:
        return statistics.median(scalable), "decode-fit"
    return max(0.0, rollout_time - tail), "quantile"


def measure(rows: Sequence[dict], skip_steps: int = 1, bulk_quantile: float = 0.9,
            num_gpus_per_node: int | None = None, source: str = "the telemetry") -> Measurement:
    """Summarise a run; ``num_gpus_per_node`` overrides the rows' value (default 8 when absent)."""
    if not rows:
        raise ValueError(f"{source} has no rows")
    first = _require_layout(rows, source)
    used = list(rows[skip_steps:]) if len(rows) > skip_steps else list(rows)
    colocate = bool(first["colocate"])
    placement = Placement(colocate, int(first["trainer_gpus"]), int(first["rollout_gpus"]))
    warnings = []
    if skip_steps and len(rows) <= skip_steps:
        warnings.append(
            f"{source} holds {len(rows)} row(s), all inside the warm-up (--skip-steps {skip_steps}): this advice is "
            f"from warm-up steps, which load and compile and are not the run's steady state; record at least "
            f"{skip_steps + 2} steps (a few after the warm-up give a median), or pass --skip-steps 0 to advise "
            f"on warm-up rows knowingly")
    transports = [r["transfer_transport"] for r in used if r.get("transfer_transport")]
    transport = transports[-1] if transports else None
    if transport is None:
        warnings.append(
            f"{source} does not say which transport carried the weight update (no transfer_transport: rows recorded "
            f"before it existed, or a loop that does not pass the update's metrics to end_step): sync paths are "
            f"assumed to be a GPU run's (NVLink inside a node, the network across nodes, CUDA IPC colocated)")
    overlapped = (not colocate) and _overlapped(rows)  # a property of the loop: warm-up steps show it too
    recorded = first.get("one_step_off")  # absent from rows recorded before it: the loop's shape tells
    one_step_off = bool(recorded) if recorded is not None else (overlapped or any("rollout/staleness" in r for r in rows))
    split_refused_by = tuple(f"--{name.replace('_', '-')}" for name in
                             ("offload_train", "offload_rollout", "offload_rollout_keep_weights")
                             if colocate and first.get(name))
    update_weights_time = _median(used, PHASE_KEYS["sync"])
    outside = _sync_outside_rollout(used, rows)
    tail, p50, p99 = _tail_stats(used, bulk_quantile)
    rollout_time = _median(used, PHASE_KEYS["rollout"])
    lengths = tuple(int(x) for r in used for x in (r.get("rollout/response_lengths") or []))
    scalable, how = _scalable_rollout(used, min(tail, rollout_time), rollout_time)
    caps = [r["max_response_len"] for r in used if r.get("max_response_len")]
    bytes_ = [r["perf/update_weights_bytes"] for r in used if r.get("perf/update_weights_bytes")]
    return Measurement(
        placement=placement,
        gpus_per_engine=int(first["rollout_gpus_per_engine"]),
        num_gpus_per_node=int(num_gpus_per_node or first.get("num_gpus_per_node") or 8),
        transfer_mode=first.get("transfer_mode"),
        steps=len(used),
        step_time=_median(used, PHASE_KEYS["step"]),
        rollout_time=rollout_time,
        sync_time=update_weights_time if outside is None else outside,
        train_time=_median(used, PHASE_KEYS["train"]),
        train_wait=_median(used, PHASE_KEYS["train_wait"]),
        rollout_wait=_median(used, PHASE_KEYS["rollout_wait"]),
        rollout_tail=min(tail, rollout_time),
        rollout_scalable=min(scalable, rollout_time),
        rollout_fit=how,
        finish_p50=p50,
        finish_p99=p99,
        tail_share=(min(tail, rollout_time) / rollout_time) if rollout_time > 0 else 0.0,
        samples_per_step=statistics.median([len(r.get("rollout/response_lengths") or []) for r in used]),
        max_response_len=float(max(caps) if caps else (max(lengths) if lengths else math.nan)),
        group_size=int(first["group_size"]) if first.get("group_size") else None,
        sync_bytes=float(statistics.median(bytes_)) if bytes_ else None,
        sync_density=(float(statistics.median(densities)) if (densities := [
            r["perf/update_weights_density"] for r in used if r.get("perf/update_weights_density")]) else None),
        overlapped=overlapped,
        response_lengths=lengths,
        kv_cache_tokens=int(first["kv_cache_tokens"]) if first.get("kv_cache_tokens") else None,
        max_num_seqs=int(first["max_num_seqs"]) if first.get("max_num_seqs") else None,
        prompt_len=float(first["prompt_len"]) if first.get("prompt_len") else None,
        handoff_time=_handoff_time(used),
        **_handoff_moves(used),
        warnings=tuple(warnings),
        transport=transport,
        one_step_off=one_step_off,
        split_refused_by=split_refused_by,
        update_weights_time=update_weights_time,
    )


HANDOFF_KEYS = ("perf/handoff_to_train_time", "perf/handoff_to_rollout_time")


def _handoff_moves(rows: Sequence[dict]) -> dict:
    """Median bytes per step the hand-off moved over PCIe and the seconds those moves took (the trainer's
    copies out and its reload; the engines' sleep and wake when they moved weights, at level 1); {} for
    a run that did not record them."""
    moved = [r for r in rows if r.get("perf/handoff_bytes_to_host") or r.get("perf/handoff_bytes_to_device")]
    if not moved:
        return {}

    def seconds(r: dict) -> float:
        keys = ["perf/handoff_trainer_offload_copy_time", "perf/handoff_trainer_reload_time"]
        if r.get("perf/handoff_engine_weight_bytes"):
            keys += ["perf/handoff_engine_sleep_time", "perf/handoff_engine_wake_time"]
        return sum(float(r.get(k) or 0.0) for k in keys)

    return {"handoff_bytes": statistics.median(float(r.get("perf/handoff_bytes_to_host") or 0.0)
                                               + float(r.get("perf/handoff_bytes_to_device") or 0.0) for r in moved),
            "handoff_move_time": statistics.median(seconds(r) for r in moved)}


def _handoff_time(rows: Sequence[dict]) -> float | None:
    """Median per step of both hand-offs; None when the run had none (split, or no GPU to hand over)."""
    per_step = [sum(float(r.get(k) or 0.0) for k in HANDOFF_KEYS) for r in rows if any(k in r for k in HANDOFF_KEYS)]
    return statistics.median(per_step) if per_step else None
