"""What the job, the colocated hand-off and the update driver ask of a rollout engine: :class:`RolloutEngine`.

An engine serves one model on one or more workers and is driven as a Ray actor (``ray_engines``):
it generates (submit, poll, abort; pause and resume between its steps), takes weight updates from the
trainer's transfer group (the transfer protocol, ``rlplacement.transfer``, is engine-neutral: the engine
hosts a receiver on each worker and commits what it staged), and, when colocated with the trainer,
gives its GPU memory back and takes it again. Everything engine-specific (vLLM's arguments, its
sampling parameters, its worker calls) stays inside the engine's own module; ``registry`` names the
kinds. Calls that return data return plain data: dicts, lists, numbers, strings and numpy arrays.

Turn-taking: a kind decorates its class with ``runtime.one_at_a_time.one_call_at_a_time``, so every
method but the control calls (:data:`CONTROL_CALLS`) takes turns with the others, also across the
thread a compiled update graph runs ``update_weights`` on, and the class gains ``current_call`` (what
the update graph asks an engine that did not answer). Control calls run beside the call holding the
turn, so a driver can poll, abort or pause a generation while a blocking call runs; a subclass's
overrides of them are marked as such here, whatever it forgets.
"""

from __future__ import annotations

import abc
from typing import Any

from rlplacement.runtime.one_at_a_time import control_call
from rlplacement.transfer.base import EngineUpdateReport

CONTROL_CALLS = ("poll", "abort", "pause", "resume", "health")
"""Methods that run beside the call holding the engine's turn (and, as Ray actors, in their own
concurrency group)."""

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed", "min_tokens")
"""The sampling keys the job sends with each request (``RLJob.sampling_defaults`` and what a generate call
adds); every engine takes these. ``max_tokens`` is required; ``min_tokens`` equal to it asks for exactly
that many tokens. A caller's other keys reach the engine as they are (vLLM: ``SamplingParams`` keywords)."""


class RolloutEngine(abc.ABC):
    """One rollout engine; see the module docstring. Construction: ``cls(model_dir, engine_index=i,
    dtype=..., max_model_len=..., enforce_eager=..., tensor_parallel_size=..., sleep_mode=..., verbose=...,
    **engine-specific keywords)``."""

    @classmethod
    def sampling_keys(cls) -> frozenset[str]:
        """Every sampling key this engine kind accepts (a caller's key outside it is refused by name before
        any request starts); at least :data:`SAMPLING_KEYS`."""
        return frozenset(SAMPLING_KEYS)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in CONTROL_CALLS:
            fn = cls.__dict__.get(name)
            if fn is not None:
                control_call(fn)

    @staticmethod
    def process_env(verbose: bool) -> dict[str, str]:
        """Environment variables for the engine's processes, set before it starts (its log levels)."""
        return {}

    # ---- identity ----------------------------------------------------------------------------
    @abc.abstractmethod
    def info(self) -> dict:
        """At least: ``engine_index``; ``num_workers`` (ranks it takes in a transfer group); ``dtype`` it
        serves; ``max_model_len`` (prompt + response tokens); ``kv_cache_tokens`` and ``max_num_seqs``
        (what caps its decoding concurrency); ``sleep_mode`` (whether it can release its memory)."""

    def health(self) -> dict:
        """Answered beside any running call (a control call), so an engine busy in a long update still
        answers: ``{"stuck": what}`` when a call into the engine overran its bound and was abandoned (the
        engine refuses every call until it returns), else ``{"stuck": None}``; a kind that counts them adds
        ``"steps"``, the generation steps taken so far (progress while requests run). An engine that does not
        answer at all within the health check's timeout is gone or stopped (``fault_tolerance``)."""
        return {"stuck": None}

    # ---- generation --------------------------------------------------------------------------
    @abc.abstractmethod
    def submit(self, prompt_token_ids: list[list[int]], sampling: list[dict]) -> str:
        """Start one request per prompt, ``sampling[i]`` being prompt i's keys (:data:`SAMPLING_KEYS`);
        returns the batch id :meth:`poll` and :meth:`abort` take. Refuses a request that does not fit the
        context (``ContextLengthError``) before any starts, and refuses to start while its weights are
        not a whole version (``WeightsUnavailableError``). Every sample of the batch comes from the
        version served when it was submitted: an update waits until no request is in flight."""

    @abc.abstractmethod
    def poll(self, batch: str, timeout_s: float = 1.0) -> tuple[list[dict], bool]:
        """Samples of ``batch`` finished since the last poll (waiting up to ``timeout_s`` for one) and
        whether the batch is done. A sample: ``index`` in the batch, ``token_ids`` (int64 array),
        ``logprobs`` (float32, of each sampled token under the sampling distribution, after temperature),
        ``finish_reason`` (``stop``, ``length``, ``abort``), ``stop_reason``, ``aborted``,
        ``weight_version``, ``finished_at`` and ``first_token_at`` (wall times)."""

    @abc.abstractmethod
    def abort(self, batch: str | None = None) -> int:
        """End ``batch``'s requests in flight (every batch's: None) now; their partial samples come out of
        :meth:`poll` marked ``aborted``. Returns how many were ended; the engine stays ready."""

    @abc.abstractmethod
    def pause(self) -> int:
        """Hold generation between two engine steps: returns once no step runs, with the number of
        requests held in flight. Submits are still taken (they wait), polls and aborts work as usual, and
        nothing is lost: after :meth:`resume` every request continues where it stood. An update or a
        sleep refuses at once while requests are held (it would wait for them forever): resume or abort
        them first."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Let generation go on after :meth:`pause` (nothing when not paused)."""

    def generate(self, prompt_token_ids: list[list[int]], *, max_tokens: int | list[int] = 16,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop_token_ids: list[int] | None = None, exact_lengths: bool = False,
                 sampling: dict | None = None) -> list[dict]:
        """One completion per prompt, in prompt order (the samples :meth:`poll` describes), in one call:
        for scripts and tests. ``seed``: prompt i samples with ``seed + i``; ``max_tokens`` may be one per
        prompt; ``exact_lengths``: each completion exactly that long (no early stop); ``sampling``: any
        other sampling keys, for every prompt."""
        n = len(prompt_token_ids)
        lengths = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * n
        if len(lengths) != n:
            raise ValueError(f"max_tokens has {len(lengths)} entries for {n} prompts")
        specs = [{"temperature": temperature, "top_p": top_p, "stop_token_ids": stop_token_ids, **(sampling or {}),
                  "max_tokens": lengths[i], "seed": None if seed is None else seed + i,
                  **({"min_tokens": lengths[i]} if exact_lengths else {})} for i in range(n)]
        batch = self.submit(prompt_token_ids, specs)
        results: list[dict | None] = [None] * n
        done = False
        while not done:
            new, done = self.poll(batch, 60.0)
            for r in new:
                results[r["index"]] = r
        return results  # type: ignore[return-value]

    # ---- weight updates ------------------------------------------------------------------------
    @abc.abstractmethod
    def init_transfer(self, endpoint: dict, rank_offset: int, staging: str | None = None) -> None:
        """Join the trainer's transfer group (a ``TransferEndpoint`` as a dict), its workers on ranks
        ``rank_offset`` .. ``rank_offset + num_workers - 1``; blocks until every member has joined.
        ``staging``: ``full`` or ``bucket`` for this group's updates (``--update-weight-staging``); None:
        the engine's own."""

    @abc.abstractmethod
    def update_weights(self, version: int) -> EngineUpdateReport:
        """Receive version ``version`` from the trainer and serve it, once no request is in flight (or, under
        a pause mode, as :meth:`set_pause_generation_mode` says); all or nothing: a failure before the load
        leaves the previous version served."""

    def set_pause_generation_mode(self, mode: str | None) -> None:
        """What later updates do to requests in flight (``config.PAUSE_GENERATION_MODES``; None: wait for
        them to finish). Every sample then says which version sampled each token. A kind that cannot
        change weights under running requests refuses any mode but None (this default)."""
        if mode is not None:
            from rlplacement.errors import ConfigError

            raise ConfigError(f"--pause-generation-mode {mode}: the {type(self).__name__} engine kind updates only "
                              f"between batches; drop --fully-async or use the vllm engine kind")

    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version every worker serves (raises if they disagree)."""

    @abc.abstractmethod
    def received_checksums(self) -> dict[str, str]:
        """Per-tensor checksums (HF names) of the last update as received, recorded with check_equal on."""

    @abc.abstractmethod
    def model_checksums(self) -> dict[str, str]:
        """Checksums of the served parameters whose bytes are readable (the engine's own names)."""

    @abc.abstractmethod
    def close_transfer(self) -> None:
        """Leave the transfer group (never waits on peers)."""

    # ---- memory (a colocated hand-off) -----------------------------------------------------------
    @abc.abstractmethod
    def release_memory(self, keep_weights: bool = False) -> dict:
        """Sleep once no request is in flight: level 2 (weights discarded; the engine refuses to generate
        until a full update lands) or, with ``keep_weights``, level 1 (weights kept in host memory).
        Returns ``seconds``, ``level`` and a :meth:`gpu_memory` reading."""

    @abc.abstractmethod
    def resume_weights(self) -> dict:
        """Wake the weights only (before an update); ``seconds`` and a :meth:`gpu_memory` reading."""

    @abc.abstractmethod
    def resume_kv_cache(self) -> dict:
        """Wake the KV cache (before generating); ``seconds`` and a :meth:`gpu_memory` reading."""

    @abc.abstractmethod
    def resume_all(self) -> dict:
        """Wake everything; ``seconds`` and a :meth:`gpu_memory` reading."""

    @abc.abstractmethod
    def sleep_pool(self) -> dict:
        """GiB a wake-up allocates again, by what it holds (``weights_gb``, ``kv_cache_gb``); empty when
        the engine cannot sleep."""

    @abc.abstractmethod
    def gpu_memory(self) -> dict:
        """GiB its largest worker holds now (``resident_gb``) and held at most since the last call
        (``peak_gb``); empty without a GPU."""

    @abc.abstractmethod
    def unmap_trainer_memory(self) -> dict:
        """Before the trainer frees its weights: let go of any of the trainer's memory the workers map
        (``mapped_allocations``: how many were mapped)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine; never raises (it runs on error paths)."""
