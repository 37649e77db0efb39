"""Generation that an engine steps itself: requests go in at once, samples come out as each finishes,
and requests in flight can be aborted while the engine is running them.

``vllm.LLM.generate`` runs a whole batch inside one blocking call, so nothing can reach it until every
request has finished. :class:`RequestStepper` instead owns one thread that calls
``LLMEngine.step()`` while any request is unfinished (what ``LLM.generate`` does inside), and lets
other threads add requests (:meth:`submit`), take finished samples (:meth:`poll`) and end requests
(:meth:`abort`). Every call into the vLLM engine holds one lock, so the engine's request bookkeeping
is never touched by two threads at once; a step holds it for one engine iteration.

Outputs are requested final-only (``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` does): a
step builds no output object for a request that has not finished, so stepping here costs what
``LLM.generate`` costs. An aborted request's partial sample is read from vLLM's own record of it
just before the abort (the output vLLM's async engine hands its callers on abort).

:meth:`pause` holds the stepping thread between two steps (it returns once no step runs) and
:meth:`resume` lets it go on; requests in flight, submits, polls and aborts are unaffected otherwise. An
engine core in its own process (every GPU engine) steps on by itself: :meth:`pause` also holds its scheduler
and takes what it sampled before, so the version :meth:`mark_update` marks then is exact.

Invariant the engine's update relies on: after :meth:`wait_idle` returns (and while no
:meth:`submit` runs), no request is in flight, so the model's weights may change without any sample
seeing two versions. While paused with requests in flight, :meth:`wait_idle` raises at once instead of
waiting for requests that cannot finish.

Every wait here is bounded by ``timeout_s`` (the engine's, which the job gives it: ``RLJob.start(timeout_s=)``)
and names what did not answer: :meth:`wait_idle` (requests still in flight), :meth:`call` (the engine
held by a step, or the call itself not returning: it runs on a thread of its own so that the caller
can stop waiting; the engine then refuses every later call by name, since the stuck call still holds
it), and :meth:`poll` (no engine step finished for ``timeout_s`` while requests are in flight,
generation is not paused and no call holds the engine: a call has its own bound, and the time it held
the engine is not charged to generation).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from rlplacement.errors import EngineStuckError


@dataclasses.dataclass
class _Request:
    batch: str
    index: int
    version: int
    internal_id: str
    """vLLM's own id of the request (what an abort names); outputs carry the id it was added under."""
    segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(first output token, version) for every weight version after the first that sampled part of it
    (:meth:`RequestStepper.mark_update`); empty: every token came from ``version``."""
    kv_mixed: bool = False
    """In flight at an ``in_place`` update: tokens sampled after it attend to KV computed by older weights."""

    def token_versions(self, n: int) -> "np.ndarray":
        """The version that sampled each of the first ``n`` output tokens (int32)."""
        versions = np.full(n, self.version, dtype=np.int32)
        for start, version in self.segments:
            versions[start:] = version
        return versions

    def result(self, output, now: float, wall_minus_monotonic: float, aborted: bool = False) -> dict:
        """The sample of vLLM's ``RequestOutput`` (None: nothing generated). ``now``: when its output
        reached the stepper, within one engine step of its last token; vLLM's own per-request times
        (on the monotonic clock every process of the host shares) where it keeps them (log stats on)."""
        c = output.outputs[0] if output is not None else None
        tokens = list(c.token_ids) if c is not None else []
        logprobs = [lp[t].logprob for t, lp in zip(tokens, c.logprobs)] if c is not None and c.logprobs else []
        stats = getattr(output, "metrics", None)
        last = getattr(stats, "last_token_ts", 0) or 0
        first = getattr(stats, "first_token_ts", 0) or 0
        return {"index": self.index, "token_ids": np.asarray(tokens, dtype=np.int64),
                "logprobs": np.asarray(logprobs, dtype=np.float32),
                "finish_reason": "abort" if aborted else c.finish_reason,
                "stop_reason": None if aborted else c.stop_reason, "aborted": aborted,
                "weight_version": self.version, "token_versions": self.token_versions(len(tokens)),
                "kv_mixed": self.kv_mixed,
                "finished_at": last + wall_minus_monotonic if last > 0 and not aborted else now,
                "first_token_at": first + wall_minus_monotonic if first > 0 else None,
                "routed_experts": _every_position(getattr(c, "routed_experts", None))}


def _every_position(routed) -> "np.ndarray | None":
    """vLLM's ``[P + R - 1, L, K]`` routed experts (the last sampled token is never fed) as ``[P + R, L, K]``
    int16 with the last position routed to experts ``0..K-1`` (it predicts nothing in training)."""
    if routed is None:
        return None
    routed = np.asarray(routed)
    k = routed.shape[-1]
    last = np.broadcast_to(np.arange(k, dtype=np.int16), (1, routed.shape[1], k))
    return np.concatenate([routed.astype(np.int16), last])


@dataclasses.dataclass
class _Batch:
    size: int
    finished: list[dict] = dataclasses.field(default_factory=list)
    taken: int = 0
    """How many of ``finished`` a poll has handed out."""


def _external_id(internal_id: str) -> str:
    """The id a request was added under, which its outputs carry: vLLM appends ``-`` and 8 random
    characters to make its internal id unless ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set."""
    import vllm.envs as envs

    if getattr(envs, "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", False):
        return internal_id
    return internal_id.rsplit("-", 1)[0]


class RequestStepper:
    """Steps a ``vllm.LLM``'s requests on a thread of its own; see the module docstring."""

    def __init__(self, llm, name: str = "engine", timeout_s: float | None = None):
        """``timeout_s``: the bound of every wait (None: unbounded, for scripts that drive vLLM directly)."""
        self.name = name
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._llm = llm
        self._engine = llm.llm_engine
        self._engine_lock = threading.Lock()
        self._changed = threading.Condition()
        """Notified when requests arrive or finish; guards the bookkeeping below."""
        self._requests: dict[str, _Request] = {}
        self._batches: dict[str, _Batch] = {}
        self._error: BaseException | None = None
        self._paused = False
        self._core_held = False  # an engine core in its own process, held by pause()
        self.steps = 0
        """Engine steps taken so far."""
        self._ids = itertools.count()
        self._wall_minus_monotonic = time.time() - time.monotonic()
        self._progress_at = time.monotonic()
        """When the last step finished, or generation last had reason to start (a submit while idle, a resume)."""
        self._stuck: str | None = None
        """A :meth:`call` that did not return within its bound (it still holds the engine)."""
        self._in_call = False
        """A :meth:`call`'s function is running (it holds the engine: no step can finish meanwhile)."""
        self._abandon = threading.Lock()
        """Orders a caller giving up on a call against the call thread finishing it."""
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._caller = threading.Thread(target=self._serve_calls, name=f"{name}-calls", daemon=True)
        self._caller.start()
        self._thread = threading.Thread(target=self._run, name=f"{name}-stepper", daemon=True)
        self._thread.start()

    def _bound(self) -> str:
        return (f"the bound is the engine's timeout_s={self.timeout_s:g} (the job's: RLJob.start(timeout_s=...))"
                if self.timeout_s is not None else "unbounded")

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, prompts: list, params: list, version: int, lora_request=None) -> str:
        """Add one request per prompt (``TokensPrompt``, ``SamplingParams`` pairs) as one batch, through
        ``LLM.enqueue`` (vLLM's own rendering of prompts); returns the batch's id. Every sample of it is
        stamped ``version``: the caller keeps the weights fixed until the batch has finished
        (``wait_idle``). ``lora_request``: the adapter every request of the batch runs with (None: the base)."""
        from vllm.sampling_params import RequestOutputKind

        for p in params:
            p.output_kind = RequestOutputKind.FINAL_ONLY
        batch = f"b{next(self._ids)}"
        with self._engine_lock:  # the stepper cannot step between the enqueue and the bookkeeping
            with self._changed:
                self._raise_if_failed()
            internal_ids = self._enqueue(prompts, params, lora_request)
            with self._changed:
                if not self._requests:
                    self._progress_at = time.monotonic()
                self._batches[batch] = _Batch(size=len(internal_ids))
                for i, internal in enumerate(internal_ids):
                    self._requests[_external_id(internal)] = _Request(batch, i, version, internal)
                self._changed.notify_all()
        return batch

    def _enqueue(self, prompts: list, params: list, lora_request=None) -> list[str]:
        """vLLM's ids of the new requests. ``LLM.enqueue`` where vLLM has it (0.32: it renders prompts the
        way ``generate`` does); else ``LLMEngine.add_request`` one by one."""
        adapter = {"lora_request": lora_request} if lora_request is not None else {}
        if hasattr(self._llm, "enqueue"):
            return list(self._llm.enqueue(prompts, params, use_tqdm=False, **adapter))
        return [self._engine.add_request(f"rlp{next(self._ids)}", prompt, p, **adapter)
                for prompt, p in zip(prompts, params)]

    def poll(self, batch: str, timeout_s: float) -> tuple[list[dict], bool]:
        """Samples of ``batch`` finished since the last poll (waiting up to ``timeout_s`` for one), and
        whether the batch is done (every sample handed out; the batch is then forgotten)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                self._raise_if_failed()
                b = self._batches.get(batch)
                if b is None:
                    raise KeyError(f"no batch {batch!r} on this engine (already collected, or never submitted)")
                if b.taken < len(b.finished) or time.monotonic() >= deadline:
                    break
                self._raise_if_stalled()
                self._changed.wait(max(0.0, min(deadline, self._stall_deadline()) - time.monotonic()))
            new, b.taken = b.finished[b.taken:], len(b.finished)
            done = b.taken == b.size
            if done:
                del self._batches[batch]
            return new, done

    def abort(self, batch: str | None = None) -> int:
        """End the unfinished requests of ``batch`` (every batch: None) now; each becomes a finished
        sample of the tokens generated so far, ``finish_reason="abort"`` and ``aborted=True``. Returns
        how many were aborted. The engine stays ready for the next submit."""
        with self._engine_lock:
            with self._changed:
                ids = [rid for rid, r in self._requests.items() if batch is None or r.batch == batch]
                internal = [self._requests[rid].internal_id for rid in ids]
            partial = {i: self._partial_output(i) for i in internal}
            if internal:
                try:
                    self._engine.abort_request(internal, internal=True)
                except TypeError:  # a vLLM whose abort takes the ids it returned without saying whose
                    self._engine.abort_request(internal)
            now = time.time()
            with self._changed:
                for rid in ids:
                    r = self._requests.pop(rid, None)
                    if r is not None and r.batch in self._batches:
                        self._batches[r.batch].finished.append(
                            r.result(partial[r.internal_id], now, self._wall_minus_monotonic, aborted=True))
                self._changed.notify_all()
        return len(ids)

    def _stall_deadline(self) -> float:
        return float("inf") if self.timeout_s is None or self._in_call else self._progress_at + self.timeout_s

    def _raise_if_stalled(self) -> None:
        """Under ``self._changed``: raise when requests are in flight, generation is not paused, no call
        holds the engine, and no step has finished within the bound since generation could last go on
        (vLLM's step, or a worker under it, stopped answering)."""
        if self._requests and not self._paused and time.monotonic() > self._stall_deadline():
            raise EngineStuckError(f"{self.name}: no generation step finished within {self.timeout_s:g} s with "
                                  f"{len(self._requests)} request(s) in flight (vLLM's engine or one of its workers "
                                  f"stopped answering); {self._bound()}")

    def wait_idle(self, before: str = "a weight change") -> None:
        """Block until no request is in flight, at most ``timeout_s`` (then TimeoutError naming how many
        requests are left and ``before``, what was waiting); raises at once while paused with requests in
        flight, which could not finish."""
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        with self._changed:
            while self._requests:
                self._raise_if_failed()
                if self._paused:
                    raise RuntimeError(f"generation is paused with {len(self._requests)} request(s) in flight, "
                                       f"which cannot finish: resume() or abort() them first")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"{self.name}: {len(self._requests)} request(s) still in flight after "
                                       f"{self.timeout_s:g} s of waiting for generation to finish before {before}; "
                                       f"abort() them, or raise the bound: {self._bound()}")
                self._changed.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            self._raise_if_failed()

    def pause(self) -> int:
        """Hold generation between two steps: returns once no step runs, with the number of requests in
        flight (they wait, as do requests submitted meanwhile, until :meth:`resume`)."""
        with self._changed:
            self._paused = True
            self._changed.notify_all()  # a wait_idle in progress raises rather than wait
        with self._engine_lock:  # a step in progress ends first; the next one sees the pause
            self._hold_core()
        with self._changed:
            return len(self._requests)

    def resume(self) -> None:
        """Let generation go on after :meth:`pause`."""
        if self._core_held:  # only then does resuming call into the engine
            with self._engine_lock:
                self._release_core()
        with self._changed:
            self._paused = False
            self._progress_at = time.monotonic()
            self._changed.notify_all()

    def _hold_core(self) -> None:
        """An engine core in its own process: hold its scheduler, then take every output it sent before (its
        reply to the hold comes after them on the same socket, so they are all queued here by then)."""
        core = getattr(self._engine, "engine_core", None)
        outputs = getattr(core, "outputs_queue", None)
        if outputs is None or self._core_held:  # in this process the core steps only when stepped
            return
        core.call_utility("pause_scheduler", "keep", False)
        self._core_held = True
        while not outputs.empty():
            self._take(self._engine.step())
            self.steps += 1

    def _release_core(self) -> None:
        if self._core_held:
            self._engine.engine_core.call_utility("resume_scheduler")
            self._core_held = False

    @property
    def paused(self) -> bool:
        return self._paused

    def mark_update(self, version: int, *, kv_mixed: bool) -> int:
        """Record that ``version`` samples every request in flight from its next token on (while paused,
        between two steps: the token counts are final); ``kv_mixed``: their KV cache so far stays (an
        ``in_place`` update), so later tokens attend to KV of older weights (every request in flight is
        marked: even one that has sampled nothing may hold or share prompt KV computed before). A request
        that has sampled no token yet is ``version``'s whole. Returns how many requests were in flight."""
        with self._engine_lock:
            with self._changed:
                for r in self._requests.values():
                    produced = self._tokens_so_far(r.internal_id)
                    if produced == 0 and not r.segments:
                        r.version = version
                    else:
                        r.segments.append((produced, version))
                    r.kv_mixed = r.kv_mixed or kv_mixed  # its prompt's KV too may be older weights'
                return len(self._requests)

    def _tokens_so_far(self, internal_id: str) -> int:
        """Output tokens vLLM's output processor holds for the request (its own running record)."""
        state = self._engine.output_processor.request_states.get(internal_id)
        detok = getattr(state, "detokenizer", None)
        return len(detok.output_token_ids) if detok is not None else 0

    @property
    def stuck(self) -> str | None:
        """The abandoned call that still holds the engine (see :meth:`call`), or None."""
        return self._stuck

    def call(self, fn: Callable[[], Any], what: str = "a call into vLLM", *, bound_s: float | None = None) -> Any:
        """Run ``fn`` (anything that calls into the vLLM engine, named ``what``) between two steps; its
        result, or its exception. Bounded (``bound_s``, default ``timeout_s``): the wait for a step in
        progress to end, then ``fn`` itself, which runs on this stepper's call thread. One that does not
        return in time is abandoned: the engine refuses every later call by name
        (:class:`~rlplacement.errors.EngineStuckError`) until it returns, if it ever does."""
        if self.timeout_s is None:
            with self._engine_lock:
                return fn()
        bound = self.timeout_s if bound_s is None else bound_s
        if self._stuck is not None:
            raise EngineStuckError(f"{self.name} cannot take {what}: {self._stuck} did not return and still holds "
                                  f"the engine; restart the engine")
        start = time.monotonic()
        if not self._engine_lock.acquire(timeout=bound):
            raise EngineStuckError(f"{self.name}: {what} waited {bound:g} s for the engine, held all that "
                                  f"time by a generation step that did not end; {self._bound()}")
        done, box = threading.Event(), {}
        self._calls.put((fn, box, done))  # the call thread releases the engine lock when fn returns
        if not done.wait(max(0.0, start + bound - time.monotonic())):
            with self._abandon:
                if not done.is_set():
                    self._stuck, box["abandoned"] = what, True
                    raise EngineStuckError(f"{self.name}: {what} did not return within {bound:g} s (a worker of "
                                          f"the engine stopped answering); {self._bound()}")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _serve_calls(self) -> None:
        """The call thread: runs each queued call, then releases the engine lock its caller took; an
        abandoned call that returns at last frees the engine for later calls."""
        while True:
            fn, box, done = self._calls.get()
            with self._changed:
                self._in_call = True
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                box["error"] = exc
            finally:
                with self._changed:  # generation may go on again: its stall clock restarts
                    self._in_call = False
                    self._progress_at = time.monotonic()
                    self._changed.notify_all()
                with self._abandon:
                    if box.get("abandoned"):
                        self._stuck = None
                    done.set()
                self._engine_lock.release()

    # ---- the stepping thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._requests or self._paused:
                    self._changed.wait()
            try:
                with self._engine_lock:
                    with self._changed:
                        if self._paused:  # paused after the check above: pause() waits on this lock, then no step
                            continue
                    if not self._engine.has_unfinished_requests():
                        self._drop_orphans()
                        continue
                    outputs = self._engine.step()
                    self.steps += 1
                    self._progress_at = time.monotonic()
                    self._take(outputs)  # under the engine lock: once pause() has it, the count it returns holds
            except BaseException as exc:  # noqa: BLE001 - every waiter hears it; the engine is not usable after
                with self._changed:
                    self._error = exc
                    self._changed.notify_all()
                return

    def _take(self, outputs: list) -> None:
        now = time.time()
        with self._changed:
            finished = False
            for out in outputs:
                r = self._requests.get(out.request_id)
                if r is None or not out.finished:  # aborted between the step and here
                    continue
                del self._requests[out.request_id]
                self._batches[r.batch].finished.append(r.result(out, now, self._wall_minus_monotonic))
                finished = True
            if finished:
                self._changed.notify_all()

    def _partial_output(self, internal_id: str):
        """What request ``internal_id`` generated so far, as the ``RequestOutput`` vLLM makes for an abort
        (its output processor's own record: every token and log-prob so far); None where this vLLM
        keeps that record differently (the sample is then returned empty, still marked aborted)."""
        try:
            from vllm.v1.engine import FinishReason

            state = self._engine.output_processor.request_states[internal_id]
            return state.make_request_output([], None, FinishReason.ABORT, None)
        except Exception:  # noqa: BLE001 - a partial sample is a courtesy; the abort itself must go on
            return None

    def _drop_orphans(self) -> None:
        """Requests we track that the engine no longer has (never expected: vLLM reports every end)
        finish as aborted rather than leaving waiters, and this thread, spinning."""
        now = time.time()
        with self._changed:
            for rid in list(self._requests):
                r = self._requests.pop(rid)
                if r.batch in self._batches:
                    self._batches[r.batch].finished.append(r.result(None, now, self._wall_minus_monotonic, aborted=True))
            self._changed.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the engine's generation loop failed: {self._error!r}") from self._error
