"""Busy intervals of each role, and the idle time derived from them.

Every phase of a step is an :class:`Interval` on one role's timeline (``trainer`` or ``rollout``);
a weight sync occupies both roles at once (the trainer sends while the engines are paused). A
role's wait time in a step window is the part of the window covered by none of its intervals.
Deriving waits this way, instead of timing the barrier itself, gives the right answer in every
loop shape:

* colocated or synchronous split: the trainer is idle while rollout runs, rollout while the
  trainer trains;
* one-step-off async: rollout of step k+1 overlaps training of step k, so only the part of the
  window where a role had nothing to do counts as waiting.

Timestamps are ``time.time()`` seconds so intervals measured in other processes (Ray actors on
the same host, or NTP-synchronised hosts) line up with the driver's.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

ROLES = ("trainer", "rollout")
PHASES = ("rollout", "sync", "train")
# the role(s) a phase occupies when the caller does not say
DEFAULT_ROLES = {"rollout": ("rollout",), "train": ("trainer",), "sync": ROLES}


@dataclasses.dataclass(frozen=True, slots=True)
class Interval:
    """``[start, end]`` seconds during which ``role`` was busy with ``phase``; end >= start."""

    role: str
    phase: str
    start: float
    end: float

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is unknown: use one of {ROLES}")
        if self.end < self.start:
            raise ValueError(f"interval {self.phase}/{self.role} ends ({self.end}) before it starts ({self.start})")

    @property
    def duration(self) -> float:
        return self.end - self.start


def roles_for(phase: str, role: str | None) -> tuple[str, ...]:
    """The roles an interval of ``phase`` occupies: the one given, ``both``, or the phase's default."""
    if role is None:
        if phase not in DEFAULT_ROLES:
            raise ValueError(f"phase {phase!r} has no default role: pass role= one of {ROLES} or 'both'")
        return DEFAULT_ROLES[phase]
    if role == "both":
        return ROLES
    if role not in ROLES:
        raise ValueError(f"role {role!r} is unknown: use one of {ROLES} or 'both'")
    return (role,)


def union_length(spans: Iterable[tuple[float, float]], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Length of the union of ``spans`` clipped to ``[lo, hi]`` (overlaps counted once)."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in spans)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in clipped:
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def idle_time(intervals: Iterable[Interval], role: str, lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` in which ``role`` had no interval: its wait at the barrier."""
    busy = union_length(((i.start, i.end) for i in intervals if i.role == role), lo, hi)
    return max(0.0, (hi - lo) - busy)


def phase_time(intervals: Iterable[Interval], phase: str) -> float:
    """Wall time of ``phase`` over all roles and ranks (parallel engines or ranks counted once)."""
    return union_length((i.start, i.end) for i in intervals if i.phase == phase)


def overlap_time(intervals: Iterable[Interval], phase_a: str, phase_b: str, lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` in which ``phase_a`` and ``phase_b`` both ran (any roles): training that ran
    while the rollout was still generating, for example."""
    spans = [(i.phase, (i.start, i.end)) for i in intervals if i.phase in (phase_a, phase_b)]
    a = [span for phase, span in spans if phase == phase_a]
    b = [span for phase, span in spans if phase == phase_b]
    return max(0.0, union_length(a, lo, hi) + union_length(b, lo, hi) - union_length(a + b, lo, hi))
