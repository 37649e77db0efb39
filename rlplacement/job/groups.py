"""The group assembler: samples finishing in any order -> whole GRPO groups (the samples of one prompt) in the
order they complete. ``--fully-async`` (:mod:`.fully_async`) and ``--train-during-rollout``
(:func:`finished_groups`) both hand the trainer groups through it, so a group's advantages are computed over
all of its samples and never over part of one."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from rlplacement.job.rollout import PendingRollout, RolloutSample


@dataclasses.dataclass
class Group:
    """One prompt's samples as they finish."""

    prompt: list[int]
    lengths: list[int]
    """Each member's token budget (its max_tokens)."""
    members: list[RolloutSample | None]
    pieces: list[list[RolloutSample]]
    """Per member, what earlier requests generated before an update cut them short (--partial-rollout)."""

    @property
    def complete(self) -> bool:
        return all(m is not None for m in self.members)

    def place(self, member: int, sample: RolloutSample) -> bool:
        """``sample`` as member ``member``; whether that completed the group."""
        self.members[member] = sample
        return self.complete


def finished_groups(job, pending: PendingRollout, group_size: int) -> Iterator[list[RolloutSample]]:
    """The groups of one generate call (``n_samples_per_prompt = group_size``, so sample ``i`` is member
    ``i % group_size`` of prompt ``i // group_size``), each yielded, in sample order, as its last sample
    finishes (``RLJob.stream``).

    A group is used whole or not at all: one with a member cut short (aborted) is left out and counted in
    ``pending.dropped_groups``. Under ``--use-fault-tolerance`` an engine that dies or hangs meanwhile is
    restarted and the samples it had not returned are generated again with their own seeds
    (``pending.generated_again``); the restart's reconcile gives them the trainer's same weights under a fresh
    version number. Without it the engine's failure is raised."""
    from rlplacement.job.rollout import generate_lost_again

    groups: dict[int, Group] = {}
    while True:
        try:
            for sample in job.stream(pending):
                which, member = divmod(sample.index, group_size)
                group = groups.setdefault(which, Group(list(sample.prompt_ids), [], [None] * group_size,
                                                       [[] for _ in range(group_size)]))
                if not group.place(member, sample):
                    continue
                if any(m.aborted for m in group.members):
                    pending.dropped_groups += 1
                else:
                    yield list(group.members)
            return
        except Exception as exc:
            before = list(job.engines)
            if job.ft is None or not job.ft.on_engine_failure(exc):
                raise
            replaced = {i for i, engine in enumerate(job.engines) if engine is not before[i]}
            pending.generated_again += generate_lost_again(job.engines, pending, replaced, job.timeout_s)
