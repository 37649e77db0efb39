"""Rollouts over the job's engines: what a sample is (:class:`RolloutSample`), a rollout in flight
(:class:`PendingRollout`), and how one is requested, spread, streamed back and aborted.

Engine-neutral: the engines are Ray actors of any ``engines.base.RolloutEngine`` kind, reached only through
its ``submit``, ``poll`` and ``abort`` and sent only the sampling keys every kind takes
(``engines.base.SAMPLING_KEYS``) besides a caller's own. ``RLJob`` holds the job's engines and timeout
and calls these.
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from rlplacement.errors import ConfigError, PeerError
from rlplacement.runtime.waits import cause_of, get_all

if TYPE_CHECKING:
    import numpy as np

    from rlplacement.config import Config

POLL_WAIT_S = 1.0
"""How long one poll waits on an engine for a sample to finish before the driver asks again."""


@dataclasses.dataclass
class RolloutSample:
    """One generated sample and where it came from."""

    prompt_ids: list[int]
    token_ids: "np.ndarray"
    """int64 generated token ids."""
    logprobs: "np.ndarray"
    """float32 log-prob of each generated token under the sampling distribution (after temperature)."""
    finish_reason: str
    """``stop`` (end of sequence, a stop string or token), ``length`` (max tokens) or ``abort``."""
    weight_version: int
    """The weight version that sampled its first token (the oldest of :attr:`token_versions`)."""
    engine: int
    finished_at: float
    """Wall time its last token was produced (stamped on the engine as it came out)."""
    first_token_at: float | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended it, if one did."""
    aborted: bool = False
    """Ended by :meth:`RLJob.abort` before it finished: a partial sample, not to train on unless meant."""
    index: int = 0
    """Its place in the call's samples: prompt ``index // n``, that prompt's sample ``index % n``."""
    routed_experts: "np.ndarray | None" = None
    """``[P + R, L, K]`` the experts the engine routed each prompt and response position to, in each of the
    model's ``L`` layers (``--use-rollout-routing-replay``; None otherwise). The last position was never fed
    to the engine; it holds experts ``0..K-1``. :func:`rlplacement.routed_experts_of` stacks them into
    :attr:`Batch.routed_experts`."""
    token_versions: "np.ndarray | None" = None
    """int32, one per generated token: the version that sampled it. All :attr:`weight_version` unless an update
    landed while it generated (``--fully-async`` with ``retract`` or ``in_place``)."""
    kv_mixed: bool = False
    """In flight at an ``in_place`` update: its tokens after it attend to KV computed by older weights, so its
    log-probs there are of neither version alone (the loss's importance weight takes them as they are)."""

    @property
    def versions(self) -> "np.ndarray":
        """int32 per generated token: the version that sampled it (:attr:`weight_version` for every token
        where the engine kind records no :attr:`token_versions`)."""
        import numpy as np

        if self.token_versions is not None:
            return np.asarray(self.token_versions, dtype=np.int32)
        return np.full(len(self.token_ids), self.weight_version, dtype=np.int32)

    @property
    def oldest_version(self) -> int:
        """The oldest version that sampled any of its tokens (what staleness is measured from)."""
        versions = self.versions
        return int(versions.min()) if len(versions) else self.weight_version


@dataclasses.dataclass
class PendingRollout:
    """A rollout started by :meth:`RLJob.generate_async`: :meth:`RLJob.stream` yields its samples as
    they finish, :meth:`RLJob.collect` returns them all, :meth:`RLJob.abort` ends it."""

    prompts: list[list[int]]
    """The prompt of each sample."""
    batches: dict[tuple[int, str], list[int]]
    """(engine index, the engine's batch id) -> the sample indices it generates."""
    samples: list["RolloutSample | None"]
    """Samples received so far, by index."""
    polls: dict = dataclasses.field(default_factory=dict)
    """Ray ref of an outstanding poll -> (engine index, batch id)."""
    specs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Each sample's sampling spec, its seed among them: what :func:`generate_lost_again` starts again."""
    generated_again: int = 0
    """Samples started again after their engine was restarted (``job.groups.finished_groups``)."""
    dropped_groups: int = 0
    """Groups left out of ``job.groups.finished_groups`` because a member was cut short (aborted)."""

    @property
    def done(self) -> bool:
        return not self.batches


def sampling_defaults(config: "Config") -> dict[str, Any]:
    """The sampling keys every generate starts from: the ``--rollout-*`` flags."""
    r = config.rollout
    return {"temperature": config.train.rollout_temperature, "top_p": r.top_p, "top_k": r.top_k,
            "max_tokens": r.max_response_len, "stop": list(r.stop) or None,
            "stop_token_ids": list(r.stop_token_ids) or None}


@dataclasses.dataclass
class RolloutRequest:
    """Every sample of one generate call, one request each: its prompt and its sampling keys."""

    prompts: list[list[int]]
    specs: list[dict[str, Any]]


def prompt_ids(prompts: Sequence[Sequence[int] | str], tokenize: Callable[[str], list[int]]) -> list[list[int]]:
    """Each prompt as token ids: a list of ints as it is, text through ``tokenize`` (the model's tokenizer);
    anything else refused naming the prompt."""
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            out.append(list(tokenize(prompt)))
            continue
        try:
            out.append([operator.index(t) for t in prompt])
        except TypeError:
            raise ConfigError(f"prompt {i} is {type(prompt).__name__} {str(prompt)[:60]!r}: give each prompt as text "
                              f"(a str, tokenized with the model's tokenizer) or as token ids (a list of ints)") from None
    return out


def check_sampling_keys(sampling: dict[str, Any] | None, accepted: Callable[[], frozenset[str]]) -> None:
    """Refuse a sampling key the engines do not take, naming the nearest one they do; ``accepted`` is asked
    only for keys beyond :data:`~rlplacement.engines.base.SAMPLING_KEYS` (it may import the engine's library)."""
    from rlplacement.engines.base import SAMPLING_KEYS

    extra = [k for k in (sampling or {}) if k not in SAMPLING_KEYS]
    if not extra:
        return
    known = accepted()
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f": did you mean {close[0]!r}?" if close else f"; the engines take {', '.join(sorted(known))}"
            raise ConfigError(f"sampling key {key!r} is not one the engines take{hint}")


def rollout_request(config: "Config", prompts: Sequence[Sequence[int]], sampling: dict[str, Any] | None, *,
                    n_samples_per_prompt: int | None, max_tokens: int | Sequence[int] | None, seed: int | None,
                    exact_lengths: bool, call_index: int, context: int) -> RolloutRequest:
    """The requests of ``RLJob.generate_async``'s arguments (see there); ``prompts``: token ids
    (:func:`prompt_ids` makes them); ``call_index``: how many generate calls the job made before (the default
    seed moves with it); ``context``: the smallest engine's. Refuses bad sizes, and requests that cannot
    fit the context, before any engine is asked."""
    from rlplacement.engines.engine_settings import check_context

    n = config.rollout.n_samples_per_prompt if n_samples_per_prompt is None else int(n_samples_per_prompt)
    if n < 1:
        raise ConfigError(f"n_samples_per_prompt {n}: use 1 or more")
    spec = {**sampling_defaults(config), **(sampling or {})}
    per_sample = [list(map(int, p)) for p in prompts for _ in range(n)]
    if max_tokens is None:
        lengths = [int(spec["max_tokens"])] * len(per_sample)
    elif isinstance(max_tokens, Sequence):
        lengths = [int(m) for m in max_tokens]
        if len(lengths) != len(per_sample):
            raise ConfigError(f"max_tokens has {len(lengths)} entries for {len(per_sample)} samples "
                              f"({len(prompts)} prompts x {n}): give one per sample, or one for all")
    else:
        lengths = [int(max_tokens)] * len(per_sample)
    for ids, m in zip(per_sample, lengths):
        check_context(len(ids), m, context, "RLJob.generate")
    if seed is None and "seed" not in (sampling or {}):
        seed = config.rollout.seed + 1_000_003 * call_index
    elif seed is None:
        seed = spec["seed"]

    def spec_of(j: int) -> dict[str, Any]:
        one = {**spec, "max_tokens": lengths[j], "seed": None if seed is None else seed + j}
        if exact_lengths:
            one["min_tokens"] = lengths[j]
        return one

    return RolloutRequest(per_sample, [spec_of(j) for j in range(len(per_sample))])


def submit(engines: Sequence, request: RolloutRequest, timeout_s: float) -> PendingRollout:
    """Start ``request`` on the engines, balanced over them by tokens with each prompt's samples on one
    engine (``runtime.rollout_dealing``), and return at once."""
    every = list(range(len(request.prompts)))
    return PendingRollout(request.prompts, _start(engines, request.prompts, request.specs, every, timeout_s),
                          [None] * len(request.prompts), specs=list(request.specs))


def _start(engines: Sequence, prompts: list[list[int]], specs: list[dict[str, Any]], indices: list[int],
           timeout_s: float) -> dict[tuple[int, str], list[int]]:
    """Samples ``indices`` (of ``prompts``/``specs``) started on the engines: (engine index, batch id) -> the
    sample indices it generates."""
    from rlplacement.runtime.rollout_dealing import samples_by_engine

    by_engine = samples_by_engine([prompts[j] for j in indices], [int(specs[j]["max_tokens"]) for j in indices],
                                  len(engines))
    used = [i for i, idx in enumerate(by_engine) if idx]
    batch_ids = get_all([engines[i].submit.remote([prompts[indices[k]] for k in by_engine[i]],
                                                  [specs[indices[k]] for k in by_engine[i]]) for i in used],
                        timeout_s, "starting generation", [f"engine {i}" for i in used])
    return {(i, b): [indices[k] for k in by_engine[i]] for i, b in zip(used, batch_ids)}


def generate_lost_again(engines: Sequence, pending: PendingRollout, replaced: set[int], timeout_s: float) -> int:
    """After engines ``replaced`` were restarted: the samples of ``pending`` they had not returned, started
    again on the engines with their own specs (the same seeds, so a sampler that is deterministic for its
    seed and weights gives the same samples). Returns how many were started again."""
    lost_keys = [key for key in pending.batches if key[0] in replaced]
    lost = sorted(j for key in lost_keys for j in pending.batches.pop(key) if pending.samples[j] is None)
    pending.polls = {ref: key for ref, key in pending.polls.items() if key[0] not in replaced}
    if lost:
        pending.batches.update(_start(engines, pending.prompts, pending.specs, lost, timeout_s))
    return len(lost)


def stream(engines: Sequence, pending: PendingRollout, timeout_s: float) -> Iterator[RolloutSample]:
    """Yield ``pending``'s samples as each finishes (any order; ``RolloutSample.index`` says which),
    waiting at most ``timeout_s`` for the next. An engine that dies, fails or gives no sample in time
    raises :class:`~rlplacement.errors.PeerError` naming it (what fault tolerance repairs)."""
    deadline = time.monotonic() + timeout_s
    while pending.batches:
        got = poll_ready(engines, [pending], max(0.0, deadline - time.monotonic()), timeout_s)
        if got:
            deadline = time.monotonic() + timeout_s
        elif time.monotonic() >= deadline:
            raise PeerError("generation", {f"engine {i}": f"no sample within {timeout_s:.0f}s"
                                           for i, _ in pending.batches})
        for _, sample in got:
            yield sample


def poll_ready(engines: Sequence, pendings: Sequence[PendingRollout], wait_s: float,
               timeout_s: float) -> list[tuple[PendingRollout, RolloutSample]]:
    """The samples of any of ``pendings`` that finished, waiting at most ``wait_s`` for the first; each with
    the rollout it belongs to (whose ``samples`` it is also stored in). Every unfinished engine batch has one
    poll outstanding (kept across calls in ``PendingRollout.polls``); an engine whose poll fails raises
    :class:`~rlplacement.errors.PeerError` naming it."""
    import ray

    owner = {}
    for pending in pendings:
        for key in pending.batches:
            if key not in pending.polls.values():
                pending.polls[engines[key[0]].poll.remote(key[1], POLL_WAIT_S)] = key
        owner.update({ref: pending for ref in pending.polls})
    if not owner:
        return []
    done, rest = ray.wait(list(owner), num_returns=1, timeout=wait_s)
    if done and rest:
        done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
    got = []
    for ref in done:
        pending = owner[ref]
        key = pending.polls.pop(ref)
        try:
            results, finished = ray.get(ref, timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - one error naming the engine, whatever Ray raised
            raise PeerError("generation", {f"engine {key[0]}": cause_of(exc)}) from exc
        idx = pending.batches.pop(key) if finished else pending.batches[key]
        for out in results:
            j = idx[out["index"]]
            sample = RolloutSample(pending.prompts[j], out["token_ids"], out["logprobs"], out["finish_reason"],
                                   out["weight_version"], key[0], out["finished_at"], out["first_token_at"],
                                   out["stop_reason"], out["aborted"], j, out.get("routed_experts"),
                                   out.get("token_versions"), bool(out.get("kv_mixed", False)))
            pending.samples[j] = sample
            got.append((pending, sample))
    return got


def abort(engines: Sequence, pending: PendingRollout | None, timeout_s: float) -> list[RolloutSample]:
    """End ``pending``'s requests still generating (every engine's: None); ``pending``'s partial samples,
    marked ``aborted``."""
    keys = list(pending.batches) if pending is not None else [(i, None) for i in range(len(engines))]
    get_all([engines[i].abort.remote(b) for i, b in keys], timeout_s, "aborting generation",
            [f"engine {i}" for i, _ in keys])
    if pending is None:
        return []
    return [s for s in stream(engines, pending, timeout_s) if s.aborted]
