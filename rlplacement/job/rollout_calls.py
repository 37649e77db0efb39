"""What a loop calls on :class:`~rlplacement.job.RLJob` to generate: the sync rollout over the engines
(``generate``, ``generate_async``, ``stream``, ``collect``, ``abort``) and the rollout modes built on it
(``one_step_off``, ``fully_async``).

:class:`RolloutCalls` is mixed into ``RLJob`` (``job.lifecycle``) and reads the job's state (its engines,
config, timeout, ``ft``, the generate-call count that seeds rollouts) and its ``_hand_off``/``_with_hint``.
A rollout never runs on weights a failed update left behind: ``generate_async`` reconciles first.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from rlplacement.job import rollout
from rlplacement.job.rollout import PendingRollout, RolloutSample


class RolloutCalls:
    """The generation side of ``RLJob``; see the module docstring."""

    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling keys every generate starts from: the ``--rollout-*`` flags."""
        return rollout.sampling_defaults(self.config)

    def generate(self, prompts: Sequence[Sequence[int] | str], sampling: dict[str, Any] | None = None, *,
                 n_samples_per_prompt: int | None = None, max_tokens: int | Sequence[int] | None = None,
                 seed: int | None = None, exact_lengths: bool = False,
                 include_aborted: bool = False) -> list[RolloutSample]:
        """The samples of :meth:`generate_async`'s arguments, in index order, once all have finished. Under
        ``--use-fault-tolerance`` an engine that dies or hangs meanwhile is restarted and the call runs again
        with the same seeds (so the same samples)."""
        calls = self._generate_calls
        for attempt in (0, 1):
            self._generate_calls = calls  # a repeat draws the same seeds
            try:
                return self.collect(self.generate_async(prompts, sampling, n_samples_per_prompt=n_samples_per_prompt,
                                                        max_tokens=max_tokens, seed=seed,
                                                        exact_lengths=exact_lengths),
                                    include_aborted=include_aborted)
            except Exception as exc:
                if attempt or self.ft is None or not self.ft.on_engine_failure(exc):
                    raise
        raise AssertionError("unreachable")

    def _tokenize(self, text: str) -> list[int]:
        """Text prompts through the model's own tokenizer (loaded from the engines' folder on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        return self._tokenizer.encode(text)

    def generate_async(self, prompts: Sequence[Sequence[int] | str], sampling: dict[str, Any] | None = None, *,
                       n_samples_per_prompt: int | None = None, max_tokens: int | Sequence[int] | None = None,
                       seed: int | None = None, exact_lengths: bool = False) -> PendingRollout:
        """Start ``n_samples_per_prompt`` (default ``--n-samples-per-prompt``) samples of every prompt and
        return at once (one-step-off: the trainer trains meanwhile).

        ``prompts``: token ids (lists of ints) or text (tokenized with the model's tokenizer; the samples'
        ``prompt_ids`` hold the ids); ``sampling``: sampling keys over :meth:`sampling_defaults`
        (``engines.base.SAMPLING_KEYS``, or the engine's own, e.g. any ``vllm.SamplingParams`` keyword; any
        other key is refused naming the nearest one); ``max_tokens``: one for all or one per
        sample (overrides ``sampling``'s); ``seed``: sample j samples with ``seed + j`` (default:
        ``--rollout-seed`` plus 1,000,003 per generate call of this job, so steps differ and a rerun
        repeats them); ``exact_lengths``: every sample exactly ``max_tokens`` long. The samples of a prompt
        go to one engine as separate requests (its prefix cache shares their prompt, each stops at its own
        length); prompts are balanced over engines by tokens (``runtime.rollout_dealing``). A request that
        cannot fit the engines' context is refused first.

        An engine applies an ``update_weights`` issued meanwhile only once its requests have finished:
        every sample comes from one weight version.
        """
        rollout.check_sampling_keys(sampling, self.engine_class.sampling_keys)
        prompts = rollout.prompt_ids(prompts, self._tokenize)
        if self.ft is not None:
            self.ft.check_engines()
        request = rollout.rollout_request(self.config, prompts, sampling, n_samples_per_prompt=n_samples_per_prompt,
                                          max_tokens=max_tokens, seed=seed, exact_lengths=exact_lengths,
                                          call_index=self._generate_calls,
                                          context=min(info["max_model_len"] for info in self.engine_info))
        self._generate_calls += 1
        self.reconcile()  # a rollout never runs on weights a failed update left behind
        self._hand_off("to_rollout")
        return self._with_hint(rollout.submit, self.engines, request, self.timeout_s)

    def stream(self, pending: PendingRollout) -> Iterator[RolloutSample]:
        """Yield ``pending``'s samples as each finishes (any order; ``RolloutSample.index`` says which),
        waiting at most the job's timeout for the next (naming the engines that did not answer)."""
        return rollout.stream(self.engines, pending, self.timeout_s)

    def finished_groups(self, pending: PendingRollout, group_size: int) -> Iterator[list[RolloutSample]]:
        """``pending``'s groups (its prompts' ``group_size`` samples each), each as its last sample finishes
        (``job.groups.finished_groups``): what ``--train-during-rollout`` trains on while the rest decode."""
        from rlplacement.job.groups import finished_groups

        return finished_groups(self, pending, group_size)

    def collect(self, pending: PendingRollout, *, include_aborted: bool = False) -> list[RolloutSample]:
        """Every sample of ``pending`` in index order once all have ended; samples an :meth:`abort` cut
        short are left out unless ``include_aborted``."""
        for _ in self.stream(pending):
            pass
        return [s for s in pending.samples if s is not None and (include_aborted or not s.aborted)]

    def abort(self, pending: PendingRollout | None = None) -> list[RolloutSample]:
        """End ``pending``'s requests still generating (every rollout's: None, e.g. before shutting down);
        returns ``pending``'s partial samples, marked ``aborted``. The engines stay ready for the next
        generate, serving the same version."""
        return rollout.abort(self.engines, pending, self.timeout_s)

    def fully_async(self, prompts, **options):
        """Continuous generation for a ``--fully-async`` job: ``prompts(n)`` gives the next ``n`` prompts;
        ``next_groups`` hands out completed groups, ``update_weights`` updates while the engines generate
        (returns a :class:`~rlplacement.job.fully_async.FullyAsyncRollout`, which ``options`` go to; the import runs
        here, one way: fully_async builds on the job)."""
        from rlplacement.job.fully_async import FullyAsyncRollout

        return FullyAsyncRollout(self, prompts, **options)

    def one_step_off(self, prompts, prompts_per_step: int, **options):
        """Rollout for a ``--one-step-off`` job: ``next_samples()`` returns a step's samples after starting the
        next step's batch, which generates while the caller trains (returns a
        :class:`~rlplacement.job.one_step_off.OneStepOffRollout`, which ``options`` go to)."""
        from rlplacement.job.one_step_off import OneStepOffRollout

        return OneStepOffRollout(self, prompts, prompts_per_step, **options)

    def engine_capacity(self) -> dict:
        """The smallest engine's ``kv_cache_tokens`` and ``max_num_seqs`` (what caps decoding concurrency)."""
        return {"kv_cache_tokens": min(i["kv_cache_tokens"] for i in self.engine_info),
                "max_num_seqs": min(i["max_num_seqs"] for i in self.engine_info)}

    def prepare_rollout(self) -> None:
        """Colocated hand-off to generation now (else the next ``generate`` does it): a loop that times
        its phases calls these first, so the hand-off is reported apart (``pop_handoff_metrics``)."""
        self._hand_off("to_rollout")
