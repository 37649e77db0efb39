"""What a weight update does to a vLLM engine's requests in flight (``--pause-generation-mode``): wait for
them, abort them, or hold them between two engine steps and let them continue on the new weights, and which
KV cache they may reuse afterwards.

:class:`PauseAroundUpdates` is mixed into :class:`~rlplacement.engines.vllm.vllm_engine.VllmRolloutEngine`,
whose update (``vllm_updates``) calls :meth:`~PauseAroundUpdates._quiesce` before the workers change their
weights and :meth:`~PauseAroundUpdates._forget_old_kv` after, also after a failed update. It relies on the
engine's ``llm``, its request stepper ``_stepper`` (which stamps every token with the version that sampled
it) and ``_between_steps``, and keeps ``_prefix_cache_filled`` true whenever the prefix cache may hold KV
computed with weights older than those served.
"""

from __future__ import annotations

from rlplacement.config import PAUSE_GENERATION_MODES as PAUSE_MODES


class PauseAroundUpdates:
    """The pause half of a vLLM engine's update; see the module docstring."""

    def set_pause_generation_mode(self, mode: str | None) -> None:
        """What later updates do to requests in flight (``--pause-generation-mode``; None: wait for them).
        Requests submitted from now on have their prefix-cache key salted with their version if ``mode``."""
        if mode not in (None, *PAUSE_MODES):
            from rlplacement.errors import ConfigError

            raise ConfigError(f"pause_generation_mode {mode!r}: use one of {', '.join(PAUSE_MODES)} "
                              f"(--pause-generation-mode)")
        self.pause_mode = mode

    def _quiesce(self, version: int) -> int | None:
        """Make the weights safe to change; the number of requests held in flight (None: none can be).

        Without a pause mode, wait for every request to finish (no sample sees two versions). ``abort``:
        end them now (their partial samples come out of :meth:`poll`, marked aborted) and go on idle.
        ``in_place`` and ``retract``: hold generation between two steps; the requests continue after the
        update (:meth:`_forget_old_kv` says with which KV), their tokens stamped with the version that
        sampled each (``RequestStepper.mark_update``). The boundary is exact wherever vLLM's engine core runs:
        in this process (the CPU default) no step runs while held; in its own process (every GPU engine) the
        stepper holds the core's scheduler and reads what it sampled before marking. vLLM 0.26 and 0.32 both
        have the reset, the salt and the scheduler's hold used here."""
        if self.pause_mode in ("in_place", "retract"):
            return self._stepper.pause()
        if self.pause_mode == "abort":
            self._stepper.abort()
        self._stepper.wait_idle(before=f"weight update {version}")
        return None

    def _forget_old_kv(self, held: int | None) -> None:
        """After an update (or a failed one: a worker may have loaded part of it), no request may reuse KV
        the older weights computed, except where ``in_place`` means it to. Idle: reset the prefix cache.
        ``retract``: vLLM's reset that also preempts the running requests, which then recompute their prompt
        and tokens so far under the new weights. ``in_place``: the running requests keep their KV; new ones
        cannot hit it, since every request's prefix-cache key is salted with the version it started under
        (:meth:`submit`)."""
        if not self._prefix_cache_filled:
            return
        if held is None:
            self._between_steps(self.llm.reset_prefix_cache, "reset_prefix_cache")
            self._prefix_cache_filled = False
        elif self.pause_mode == "retract":
            self._between_steps(lambda: self.llm.reset_prefix_cache(reset_running_requests=True),
                                "reset_prefix_cache(reset_running_requests=True)")
            self._prefix_cache_filled = bool(held)
        else:  # in_place: a reset succeeds only with nothing running; the salt covers the rest
            self._prefix_cache_filled = not self._between_steps(self.llm.reset_prefix_cache, "reset_prefix_cache")
