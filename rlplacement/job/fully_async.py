"""Fully asynchronous rollout (``--fully-async``): the engines never wait for the trainer.

:class:`FullyAsyncRollout` (``RLJob.fully_async``) keeps the engines generating GRPO groups from a prompt
source on a thread of its own, and hands the trainer completed groups as they are ready
(:meth:`FullyAsyncRollout.next_groups`). Weight updates (:meth:`FullyAsyncRollout.update_weights`) land
between engine steps without draining the engines: each engine applies ``--pause-generation-mode`` to its
requests in flight (``engines.vllm.vllm_engine``), and every sample records the version that sampled each token.

Versions are the job's update numbers (``RLJob.version``, the one scheme recovery uses too). A group's
staleness is the engines' current version minus the oldest version that sampled any of its tokens (as Miles
measures it), taken when the trainer takes the group: a group staler than ``--max-weight-staleness`` is
recycled (its prompt generated again), never trained on.

A sample an update cut short (``abort``) is generated again from its prompt, or, under
``--partial-rollout``, continued: a new request whose prompt is the prompt and the tokens so far, its
result joined to them (tokens, log-probs and versions), so the sample's tokens carry two versions as under
``retract``. Requests are kept to ``--async-max-concurrent-samples`` in flight, topped up
``--over-sampling-batch-size`` prompts at a time.

Thread rule: every call into the job that changes its state (a submission, an update) runs under one lock,
so the generation thread's submissions wait for an update to commit; polls of finished samples go on
(they are the engines' control calls). The trainer's thread only waits on :meth:`next_groups` and calls
:meth:`update_weights`.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from rlplacement.errors import ConfigError
from rlplacement.job.groups import Group
from rlplacement.job.rollout import PendingRollout, RolloutSample, poll_ready

if TYPE_CHECKING:  # the job is not imported even here: it builds this (RLJob.fully_async), one way
    from rlplacement.transfer.base import UpdateResult

IDLE_POLL_S = 0.05
"""How long the generation thread waits for a finished sample before topping up again."""


@dataclasses.dataclass
class AsyncStepStats:
    """What :meth:`FullyAsyncRollout.next_groups` reports with the groups it hands out."""

    staleness: list[int]
    """Per sample handed out: the engines' version minus the oldest version that sampled any of its tokens."""
    stale_groups_filtered: int
    """Groups recycled since the last hand-out for exceeding ``--max-weight-staleness``."""
    tokens_by_lag: dict[int, int]
    """Tokens handed out, by how many versions behind the engines' their sampling version was."""
    train_wait_s: float
    """How long the trainer waited for the groups."""
    continued: int = 0
    """Samples an update cut short since the last hand-out that were continued (``--partial-rollout``)."""
    regenerated: int = 0
    """Samples an update cut short since the last hand-out that were started again from their prompt."""

    def metrics(self) -> dict[str, float]:
        """The telemetry keys (Miles' names where it has them)."""
        out = {"rollout/staleness": max(self.staleness, default=0),
               "rollout/fully_async/avg_staleness": sum(self.staleness) / max(len(self.staleness), 1),
               "rollout/fully_async/max_staleness": max(self.staleness, default=0),
               "rollout/fully_async/stale_groups_filtered": self.stale_groups_filtered,
               "rollout/fully_async/partial_samples_continued": self.continued,
               "rollout/fully_async/partial_samples_regenerated": self.regenerated}
        out.update({f"rollout/fully_async/tokens_lag_{lag}": n for lag, n in sorted(self.tokens_by_lag.items())})
        return out


class FullyAsyncRollout:
    """Continuous generation of groups for one job; see the module docstring. Use it as a context manager
    (or call :meth:`close`): the generation thread stops and every request in flight is aborted."""

    def __init__(self, job, prompts: Callable[[int], Sequence[Sequence[int]]], *,
                 sampling: dict[str, Any] | None = None,
                 max_tokens: Callable[[int], Sequence[int]] | int | None = None, exact_lengths: bool = False,
                 group_size: int | None = None):
        """``job``: a started ``RLJob`` of ``--fully-async``; ``prompts(n)``: the next ``n`` prompts (token ids) of the run's source; ``max_tokens``: one budget
        for every sample, or ``max_tokens(n)`` giving the next ``n`` samples' (a long-tailed workload);
        ``exact_lengths``: each sample exactly its budget; ``group_size``: samples per prompt (default
        ``--n-samples-per-prompt``)."""
        cfg = job.config.async_rollout
        if not cfg.fully_async:
            raise ConfigError("RLJob.fully_async needs the job started with --fully-async (the engines then take "
                              "updates while requests run)")
        self.job = job
        self.cfg = cfg
        self._prompts = prompts
        self._sampling = dict(sampling or {})
        self._max_tokens = max_tokens
        self._exact = exact_lengths
        self.group_size = int(group_size or job.config.rollout.n_samples_per_prompt)
        self._lock = threading.Lock()
        self._changed = threading.Condition()
        self._ready: collections.deque[Group] = collections.deque()
        self._pending: dict[int, tuple[PendingRollout, list[tuple[Group, int]]]] = {}
        self._in_flight = 0
        self._stale_filtered = 0
        self._cut = {"continued": 0, "regenerated": 0}
        self._busy: list[tuple[float, float]] = []
        self._busy_since: float | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._per_step: int | None = None
        """Prompts one step takes: the default top-up and concurrency (set by the first next_groups)."""
        self._thread: threading.Thread | None = None
        self._recycle: list[list[int]] = []
        """Prompts of groups recycled for staleness, submitted again first (guarded by ``self._changed``)."""

    # ---- the trainer's side -------------------------------------------------------------------
    def next_groups(self, n: int, timeout_s: float | None = None) -> tuple[list[list[RolloutSample]], AsyncStepStats]:
        """``n`` completed groups (each ``group_size`` samples of one prompt, in sample order), waiting for them;
        groups staler than ``--max-weight-staleness`` are recycled on the way."""
        timeout_s = self.job.timeout_s if timeout_s is None else timeout_s
        if self._thread is None:
            self._per_step = n
            self._thread = threading.Thread(target=self._generate, name="fully-async-rollout", daemon=True)
            self._thread.start()
        start = time.monotonic()
        out: list[list[RolloutSample]] = []
        staleness: list[int] = []
        by_lag: dict[int, int] = collections.Counter()
        with self._changed:
            while len(out) < n:
                self._raise_if_failed()
                while self._ready and len(out) < n:
                    group = self._ready.popleft()
                    current = self.job.version
                    lag = current - min(m.oldest_version for m in group.members)
                    if self.cfg.max_weight_staleness is not None and lag > self.cfg.max_weight_staleness:
                        self._stale_filtered += 1
                        self._recycle.append(group.prompt)
                        self._changed.notify_all()
                        continue
                    out.append(list(group.members))
                    for m in group.members:
                        staleness.append(current - m.oldest_version)
                        by_lag.update(current - int(v) for v in m.versions)
                if len(out) < n:
                    left = start + timeout_s - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"fully async rollout: {len(out)} of {n} groups ready after {timeout_s:g} s "
                                           f"({self._in_flight} samples in flight); the bound is the job's timeout_s")
                    self._changed.wait(min(left, 1.0))
            stats = AsyncStepStats(staleness, self._stale_filtered, dict(by_lag), time.monotonic() - start,
                                   **self._cut)
            self._stale_filtered = 0
            self._cut = {"continued": 0, "regenerated": 0}
        return out, stats

    def update_weights(self, *, force: bool = False) -> "UpdateResult | None":
        """``RLJob.update_weights`` while the engines generate: each applies ``--pause-generation-mode`` to its
        requests in flight. Submissions wait for it (one lock); finished samples are still collected. Under
        ``--update-weights-interval K`` it sends once every K train calls (None between), as the job does."""
        if not (force or self.job.update_due()):
            return None  # the engines keep generating, untouched: no lock taken
        with self._lock:
            return self.job.update_weights(force=True)

    def pop_busy_intervals(self) -> list[tuple[float, float]]:
        """Wall-clock intervals (``time.time()``) the engines had samples in flight since the last call, the
        current one cut at now: the rollout side's busy time for telemetry."""
        now = time.time()
        with self._changed:
            out, self._busy = self._busy, []
            if self._busy_since is not None:
                out.append((self._busy_since, now))
                self._busy_since = now
        return out

    def close(self) -> None:
        """Stop generating and abort every request in flight (the engines stay ready)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.job.timeout_s)
        with self._lock:
            if self._pending:
                self.job.abort()

    def __enter__(self) -> "FullyAsyncRollout":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- the generation thread ------------------------------------------------------------------
    def _generate(self) -> None:
        last_sample = time.monotonic()
        try:
            while not self._stop.is_set():
                self._top_up()
                pendings = [p for p, _ in self._pending.values()]
                got = poll_ready(self.job.engines, pendings, IDLE_POLL_S, self.job.timeout_s) if pendings else []
                if not pendings:
                    time.sleep(IDLE_POLL_S)
                if got:
                    last_sample = time.monotonic()
                elif self._in_flight and time.monotonic() - last_sample > self.job.timeout_s:
                    raise TimeoutError(f"fully async rollout: no sample finished within {self.job.timeout_s:g} s with "
                                       f"{self._in_flight} in flight")
                for pending, sample in got:
                    self._take(pending, sample)
                for key in [k for k, (p, _) in self._pending.items() if p.done]:
                    del self._pending[key]
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self._changed:
                self._error = exc
                self._changed.notify_all()

    def _top_up(self) -> None:
        """Submit prompts while fewer than ``--async-max-concurrent-samples`` samples are in flight or ready
        and not taken (a bound on both: generation runs ahead of training by at most that many samples, so
        groups do not pile up to go stale): recycled prompts first, then ``--over-sampling-batch-size`` new
        ones at a time."""
        per_step = self._per_step or 1
        chunk = self.cfg.over_sampling_batch_size or per_step
        cap = self.cfg.async_max_concurrent_samples or 2 * per_step * self.group_size
        while (held := self._in_flight + len(self._ready) * self.group_size) + self.group_size <= cap \
                and not self._stop.is_set():
            want = min(chunk, max(1, (cap - held) // self.group_size))
            with self._changed:
                recycled, self._recycle = self._recycle[:want], self._recycle[want:]
            fresh = self._prompts(want - len(recycled)) if want > len(recycled) else []
            prompts = recycled + [list(map(int, p)) for p in fresh]
            n = len(prompts) * self.group_size
            lengths = self._lengths(n)
            groups = [Group(p, lengths[i * self.group_size:(i + 1) * self.group_size], [None] * self.group_size,
                             [[] for _ in range(self.group_size)]) for i, p in enumerate(prompts)]
            self._submit([(g, k, g.prompt, g.lengths[k]) for g in groups for k in range(self.group_size)],
                         n_per_prompt=self.group_size)

    def _lengths(self, n: int) -> list[int]:
        if callable(self._max_tokens):
            return [int(m) for m in self._max_tokens(n)]
        budget = self._max_tokens if self._max_tokens is not None else self.job.config.rollout.max_response_len
        return [int(budget)] * n

    def _submit(self, work: list[tuple[Group, int, list[int], int]], n_per_prompt: int) -> None:
        """Start requests for ``work`` (group, member, prompt ids, token budget); with ``n_per_prompt`` > 1 the
        members of a prompt are consecutive and share its prompt (one generate call's groups)."""
        prompts = [w[2] for w in work[::n_per_prompt]]
        with self._lock:
            if self._stop.is_set():
                return
            pending = self.job.generate_async(prompts, self._sampling, n_samples_per_prompt=n_per_prompt,
                                              max_tokens=[w[3] for w in work], exact_lengths=self._exact)
        with self._changed:
            self._pending[id(pending)] = (pending, [(w[0], w[1]) for w in work])
            self._note_in_flight(len(work))

    def _note_in_flight(self, delta: int) -> None:
        """Under ``self._changed``: the count of samples in flight, and the engines' busy intervals."""
        before, self._in_flight = self._in_flight, self._in_flight + delta
        if before == 0 and self._in_flight > 0:
            self._busy_since = time.time()
        elif before > 0 and self._in_flight == 0 and self._busy_since is not None:
            self._busy.append((self._busy_since, time.time()))
            self._busy_since = None

    def _take(self, pending: PendingRollout, sample: RolloutSample) -> None:
        group, member = self._pending[id(pending)][1][sample.index]
        with self._changed:
            self._note_in_flight(-1)
        if sample.aborted:  # an update cut it short: continue it (--partial-rollout) or start it again
            pieces = group.pieces[member]
            done = sum(len(p.token_ids) for p in pieces) + len(sample.token_ids)
            continued = self.cfg.partial_rollout and len(sample.token_ids) > 0
            if continued:
                pieces.append(sample)
            else:
                pieces.clear()
                done = 0
            with self._changed:
                self._cut["continued" if continued else "regenerated"] += 1
            prefix = [int(t) for p in pieces for t in p.token_ids]
            if done >= group.lengths[member]:  # nothing left to generate: the pieces are the sample
                sample = dataclasses.replace(sample, aborted=False, finish_reason="length")
                group.pieces[member] = pieces[:-1]
            else:
                self._submit([(group, member, group.prompt + prefix, group.lengths[member] - done)], n_per_prompt=1)
                return
        if group.place(member, _joined(group.prompt, group.pieces[member], sample)):
            with self._changed:
                self._ready.append(group)
                self._changed.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"fully async rollout: the generation thread failed: {self._error!r}") from self._error


def _joined(prompt: list[int], pieces: list[RolloutSample], last: RolloutSample) -> RolloutSample:
    """A sample continued over several requests as one: the prompt, every piece's tokens, log-probs and
    versions in order, the first piece's start and the last one's end."""
    if not pieces:
        return last
    import numpy as np

    parts = [*pieces, last]
    return dataclasses.replace(
        last, prompt_ids=list(prompt), token_ids=np.concatenate([p.token_ids for p in parts]),
        logprobs=np.concatenate([p.logprobs for p in parts]),
        token_versions=np.concatenate([p.versions for p in parts]),
        weight_version=pieces[0].weight_version, first_token_at=pieces[0].first_token_at,
        kv_mixed=any(p.kv_mixed for p in parts))
