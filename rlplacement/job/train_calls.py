"""What a loop calls on :class:`~rlplacement.job.RLJob` to train: log-probs, train steps and checkpoints,
a :class:`~rlplacement.train_io.Batch` split over the data-parallel trainer ranks.

:class:`TrainCalls` is mixed into ``RLJob`` (``job.lifecycle``) and reads the job's state (trainer actors,
data-parallel ranks, config, timeout, ``ft``) and its ``_hand_off``/``_with_hint``. A batch whose sizes do
not split is refused by name before any rank starts.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlplacement.errors import ConfigError
from rlplacement.runtime.waits import get_all

if TYPE_CHECKING:
    import torch

    from rlplacement.train_io import Batch, TrainStepReport


class TrainCalls:
    """The training side of ``RLJob``; see the module docstring."""

    def _shards(self, batch: "Batch", chunk: bool = False) -> list["Batch"]:
        """Each trainer rank's share: ranks of one tensor/pipeline-parallel group get the same one. With
        ``--global-batch-size`` G, optimizer step j trains on samples ``j*G .. (j+1)*G - 1`` of ``batch``
        whatever the number of ranks: a rank's share is its slice of each step's samples, in step order.
        ``Batch.token_versions`` stays on the driver (the job masks with it before this)."""
        batch = dataclasses.replace(batch, token_versions=None) if batch.token_versions is not None else batch
        cfg = self.config.train
        n, dp = len(batch), self.data_parallel_size
        per_step = cfg.global_batch_size or n
        from rlplacement.train_io import refuse_unreplayed_routes

        replay = self.config.backend.moe.rollout_routing_replay
        if replay and batch.routed_experts is None:
            raise ConfigError("the job replays rollout routing (--use-rollout-routing-replay) and the batch has no "
                              "routed_experts: build it with rlplacement.routed_experts_of(samples)")
        refuse_unreplayed_routes(batch, replay)
        if n % dp:
            raise ConfigError(f"a batch of {n} samples does not split over {dp} data-parallel trainer "
                              f"ranks: use a multiple of {dp} samples per step")
        if n % per_step:
            raise ConfigError(f"a batch of {n} samples is not a whole number of optimizer steps of "
                              f"--global-batch-size {per_step}: send a multiple of {per_step} samples per step")
        share = per_step // dp
        if cfg.micro_batch_size and cfg.micro_batch_size > share and not chunk:  # a chunk's micro-batch may be short
            raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} is larger than a rank's share of an "
                              f"optimizer step ({per_step} samples over {dp} data-parallel ranks = {share}): lower "
                              f"--micro-batch-size to {share} or less, or send more samples per step")
        if cfg.use_dynamic_batch_size:
            longest = max(batch.sample_lengths(), default=0)
            if longest > cfg.max_tokens_per_gpu:
                raise ConfigError(f"--max-tokens-per-gpu {cfg.max_tokens_per_gpu} is below one sample's length "
                                  f"({longest} tokens): raise --max-tokens-per-gpu to {longest} or more")
        batch.check_lengths()
        steps = range(0, n, per_step)
        return [batch.rows([i for start in steps for i in range(start + r * share, start + (r + 1) * share)])
                if len(steps) > 1 else batch.rows(slice(r * share, (r + 1) * share))
                for r in self.data_parallel_ranks]

    def log_probs(self, batch: "Batch") -> "torch.Tensor":
        """``[B, T]`` float32 log-probs of ``batch`` under the trainer's current weights (see
        ``backends.base`` for the layout: ``lp[:, t]`` is the log-prob of token t, ``lp[:, 0] = 0``)."""
        import torch

        self._hand_off("to_train")
        parts = self._on_trainers("trainer log-probs", lambda t, s: t.log_probs.remote(s), self._shards(batch))
        first_of_share = {dp: part for dp, part in zip(self.data_parallel_ranks, parts)}
        return torch.cat([first_of_share[dp] for dp in range(self.data_parallel_size)])

    def train(self, batch: "Batch") -> list["TrainStepReport"]:
        """Optimizer steps on ``batch`` (one, or one per ``--global-batch-size`` samples); each trainer rank's
        report, in rank order. Every ``--save-interval`` calls the training state is saved (``--save``). Under
        ``--mask-offpolicy-in-partial-rollout`` only the tokens the engines' current version (:attr:`version`)
        sampled count in the loss: ``batch`` must carry ``token_versions``
        (:func:`~rlplacement.train_io.token_versions_of`)."""
        self._check_tis(batch)
        if self.config.async_rollout.mask_offpolicy_in_partial_rollout:  # only the engines' current version
            batch = batch.only_version(self.version)
        shards = self._shards(batch)  # bad sizes refused before any rank starts
        self._hand_off("to_train")
        if self.handoff is not None:
            self.handoff.train_step_runs()
        reports = self._on_trainers("train step", lambda t, s: t.train_step.remote(s), shards)
        self._after_train_call()
        return reports

    def train_chunk(self, batch: "Batch") -> None:
        """``--train-during-rollout``: start forward and backward of ``batch`` (whole groups that have finished, a
        multiple of the data-parallel size in samples) on every trainer rank and return at once; the gradients
        accumulate until :meth:`finish_train_during_rollout` steps once. Ray runs an actor's calls in order, so a
        later :meth:`log_probs` waits for the chunks before it (on weights no step has changed)."""
        if not self.config.train.train_during_rollout:
            raise ConfigError("RLJob.train_chunk needs the job started with --train-during-rollout")
        self._check_tis(batch)
        shards = self._shards(batch, chunk=True)
        self._chunk_calls.append([t.train_chunk.remote(s) for t, s in zip(self.trainers, shards)])

    def finish_train_during_rollout(self) -> tuple[list["TrainStepReport"], list[tuple[float, float]]]:
        """After the rollout's last group went to :meth:`train_chunk`: wait for the chunks, then the one optimizer
        step on every rank. Returns each rank's report (as :meth:`train` does) and the chunks' (start, end) on
        rank 0, for telemetry. A chunk that failed raises here; its step is not taken."""
        calls, self._chunk_calls = self._chunk_calls, []
        intervals = [self._with_hint(get_all, refs, self.timeout_s, "a chunk of --train-during-rollout",
                                     self.trainer_names)[0] for refs in calls]
        reports = self._with_hint(get_all, [t.finish_chunked_step.remote() for t in self.trainers], self.timeout_s,
                                  "the step of --train-during-rollout", self.trainer_names)
        self._after_train_call()
        return reports, intervals

    def _check_tis(self, batch: "Batch") -> None:
        if self.config.train.use_tis and (batch.rollout_logprobs is None or batch.old_logprobs is None):
            raise ConfigError("--use-tis weighs each token by the trainer's log-prob over the engine's: give the batch "
                              "rollout_logprobs (the samples' engine log-probs) and old_logprobs (job.log_probs(batch) "
                              "before the step), or drop --use-tis")

    def _after_train_call(self) -> None:
        self.train_calls += 1
        cfg = self.config.train
        if cfg.save and cfg.save_interval and self.train_calls % cfg.save_interval == 0:
            self.save_checkpoint()

    def save_checkpoint(self, extra_state: dict[str, Any] | None = None) -> str:
        """Save the training state under ``--save`` now (collective over the trainer ranks); the weights are
        recorded as the version the next update serves them as. Returns the published folder.

        The checkpoint also records this job's generate calls (the next rollout's seeds), epoch and run id,
        and ``extra_state`` (default: :attr:`checkpoint_extra_state`'s, else {}): a small JSON-able dict of
        the caller's, e.g. its prompt sampler's position, given back as :attr:`resumed_extra_state` by a
        run started with ``--load``. Together a resumed run generates what the uninterrupted one would
        have: same prompts, same seeds, same weights."""
        if not self.config.train.save:
            raise ConfigError("RLJob.save_checkpoint: no --save folder was given: set --save")
        if extra_state is None:
            extra_state = self.checkpoint_extra_state() if self.checkpoint_extra_state is not None else {}
        job_state = {"generate_calls": self._generate_calls, "epoch": self.epoch, "run_id": self.run_id,
                     "extra_state": dict(extra_state)}
        self._hand_off("to_train")
        return get_all([t.save_checkpoint.remote(self.config.train.save, self.version + 1, job_state)
                        for t in self.trainers], self.timeout_s, "saving a checkpoint", self.trainer_names)[0]

    def prepare_train(self) -> None:
        """Colocated hand-off to training now (else the next ``log_probs`` or ``train`` does it)."""
        self._hand_off("to_train")

    def _on_trainers(self, what: str, call, shards: list) -> list:
        """``call(trainer, shard)`` on every rank, waited for by name. With ``--ft-components train`` a rank that
        died takes the trainer down: it restarts from the last ``--save`` and the call runs once more."""
        for attempt in (0, 1):
            try:
                return self._with_hint(get_all, [call(t, s) for t, s in zip(self.trainers, shards)],
                                       self.timeout_s, what, self.trainer_names)
            except Exception as exc:
                if attempt or self.ft is None or not self.ft.trainer_died(exc):
                    raise
                self.ft.restart_trainer(str(exc))
                self._hand_off("to_train")
        raise AssertionError("unreachable")
