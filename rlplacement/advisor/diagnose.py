"""What limits the step: ``sync-bound``, ``long-tail``, ``rollout-bound``, ``train-bound``, ``balanced``.

Checked in that order. Sync first: when the transfer is a large share, moving GPUs between
roles cannot fix it. Long-tail before rollout-bound: both have rollout dominating, but in a
long tail the engines idle while a few sequences decode, so more rollout GPUs would not help.
Rollout vs train compares their phase times, which works for every loop shape (the waits follow
from them: in a split the faster side waits, colocated each waits for the other).
"""

from __future__ import annotations

import dataclasses

from rlplacement.advisor.measure import Measurement
from rlplacement.advisor.thresholds import Thresholds

DIAGNOSES = ("rollout-bound", "train-bound", "sync-bound", "long-tail", "balanced")


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    label: str
    why: str  # one clause with the numbers that decided it


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def diagnose(m: Measurement, t: Thresholds = Thresholds()) -> Diagnosis:
    sync_share = _share(m.sync_time, m.step_time)
    if sync_share >= t.sync_share:
        return Diagnosis("sync-bound", f"weight transfer takes {sync_share:.0%} of the step "
                                       f"({m.sync_time:.3g} s of {m.step_time:.3g} s)")
    tail_ratio = (m.finish_p99 / m.finish_p50) if m.finish_p50 else 0.0
    if m.rollout_time >= m.train_time and tail_ratio >= t.tail_ratio and m.tail_share >= t.tail_share:
        return Diagnosis("long-tail", f"p99 sample finish time is {tail_ratio:.1f}x p50 and {m.tail_share:.0%} of "
                                      f"rollout runs after {t.bulk_quantile:.0%} of samples finished, so more "
                                      f"rollout GPUs would not help")
    if m.rollout_time >= t.imbalance * m.train_time:
        return Diagnosis("rollout-bound", f"rollout takes {m.rollout_time:.3g} s vs train {m.train_time:.3g} s "
                                          f"(trainer waits {_share(m.train_wait, m.step_time):.0%} of the step)")
    if m.train_time >= t.imbalance * m.rollout_time:
        return Diagnosis("train-bound", f"train takes {m.train_time:.3g} s vs rollout {m.rollout_time:.3g} s "
                                        f"(rollout waits {_share(m.rollout_wait, m.step_time):.0%} of the step)")
    return Diagnosis("balanced", f"rollout {m.rollout_time:.3g} s and train {m.train_time:.3g} s are within "
                                 f"{t.imbalance:g}x of each other")
