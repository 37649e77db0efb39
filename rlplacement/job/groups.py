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
    finishes (``RLJob.stream``)."""
    groups: dict[int, Group] = {}
    for sample in job.stream(pending):
        which, member = divmod(sample.index, group_size)
        group = groups.setdefault(which, Group(list(sample.prompt_ids), [], [None] * group_size,
                                               [[] for _ in range(group_size)]))
        if group.place(member, sample):
            yield list(group.members)
