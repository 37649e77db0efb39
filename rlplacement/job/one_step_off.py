"""One-step-off rollout (``--one-step-off``, split layouts): step k+1's batch generates on the weights the
engines serve while the trainer trains on step k's.

:class:`OneStepOffRollout` (``RLJob.one_step_off``) owns the order that makes it so: each
:meth:`OneStepOffRollout.next_samples` collects the batch started before, then starts the next one before it
returns, so the next batch generates while the caller trains. The caller's update (``RLJob.update_weights``) then waits for that batch to finish
(an engine applies an update only between batches), so every sample comes from one version and is at most one
version behind the trainer (``RolloutSample.weight_version``). The loss should take the engine's log-probs as
the behaviour policy (``Batch.old_logprobs``, or ``--use-tis``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from rlplacement.errors import ConfigError
from rlplacement.job.rollout import PendingRollout, RolloutSample


class OneStepOffRollout:
    """See the module docstring."""

    def __init__(self, job, prompts: Callable[[int], Sequence[Sequence[int]]], prompts_per_step: int, *,
                 sampling: dict[str, Any] | None = None,
                 max_tokens: Callable[[int], Sequence[int]] | int | None = None, exact_lengths: bool = False):
        """``job``: a started ``RLJob`` of ``--one-step-off``; ``prompts(n)``: the next ``n`` prompts;
        ``max_tokens``: one budget for every sample, or ``max_tokens(n)`` giving a batch's ``n`` samples'
        (called once per batch, in batch order); ``exact_lengths``: each sample exactly its budget."""
        if not job.config.placement.one_step_off:
            raise ConfigError("RLJob.one_step_off needs the job started with --one-step-off (a split layout)")
        self.job = job
        self._prompts, self._per_step = prompts, int(prompts_per_step)
        self._sampling, self._max_tokens, self._exact = dict(sampling or {}), max_tokens, exact_lengths
        self._next: tuple[float, PendingRollout] | None = None
        self.started_at: float | None = None
        """When the batch the last :meth:`next_samples` returned was started (``time.time()``)."""
        self.batches_started = 0

    def next_samples(self, *, start_next: bool = True) -> list[RolloutSample]:
        """This step's samples, in index order (started by the previous call, or now on the first), once the
        next step's batch has been started on the engines' current weights (``start_next`` False: the last
        step, nothing more to generate)."""
        if self._next is None:
            self._start()
        (self.started_at, pending), self._next = self._next, None
        samples = self.job.collect(pending)
        if start_next:  # before returning to the caller's training, which it overlaps
            self._start()
        return samples

    def _start(self) -> None:
        n_samples = self._per_step * self.job.config.rollout.n_samples_per_prompt
        prompts = self._prompts(self._per_step)
        budget = self._max_tokens(n_samples) if callable(self._max_tokens) else self._max_tokens
        self.job.prepare_rollout()
        self._next = (time.time(), self.job.generate_async(prompts, self._sampling, max_tokens=budget,
                                                           exact_lengths=self._exact))
        self.batches_started += 1
