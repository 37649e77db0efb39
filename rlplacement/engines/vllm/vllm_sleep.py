"""A vLLM engine's memory hand-off under ``--offload-rollout``: the engine gives its GPU memory back before
the trainer runs (vLLM's sleep, levels 1 and 2) and takes it again in two steps (the weights before an update,
the KV cache before generating), and reports what it holds.

:class:`MemoryHandOff` is mixed into :class:`~rlplacement.engines.vllm.vllm_engine.VllmRolloutEngine`. It relies
on the engine's ``llm``, ``sleep_mode``, ``engine_index``, its request stepper ``_stepper``, ``_between_steps``
and ``_workers``; a level-2 sleep clears ``_served`` (the weights are discarded, so the served version must be
asked of the workers again) and every sleep ``_prefix_cache_filled`` (vLLM's sleep empties the prefix cache).
"""

from __future__ import annotations

import time


class MemoryHandOff:
    """Sleep, wake and memory reports of a vLLM engine; see the module docstring."""

    def release_memory(self, keep_weights: bool = False) -> dict:
        """Before training: the update's staging buffers freed (they are outside vLLM's sleep pool), then
        sleep, releasing the KV cache and the weights.

        Level 2 (``keep_weights`` False): the weights are discarded, not copied to host memory, since the
        next update rewrites every one of them from the trainer; none of the engine's bytes cross PCIe.
        The workers first record that their weights are gone, so the engine refuses to generate
        (:class:`WeightsUnavailableError`) until a full update lands, also after a failed one.
        Level 1 (``keep_weights``, ``--offload-rollout-keep-weights``): the weights go to host memory and
        come back on wake, so a failed update leaves the previous version served."""
        level = 1 if keep_weights else 2

        def release_and_sleep() -> None:
            self.llm.collective_rpc("rlplacement_release_staging")
            if level == 2:
                self._served = None
                self.llm.collective_rpc("rlplacement_mark_weights_lost", args=("a level-2 sleep discarded them",))
            self.llm.sleep(level=level)  # any level also clears the prefix cache
            self._prefix_cache_filled = False

        return {**self._timed(release_and_sleep, f"a level-{level} sleep", quiesce=True), "level": level}

    def sleep_pool(self) -> dict:
        """GiB of this engine's sleep pool on its largest worker, by what it holds (``weights_gb``,
        ``kv_cache_gb``): what a wake-up allocates again; empty without sleep mode."""
        if not self.sleep_mode:
            return {}
        per_worker = self._workers("rlplacement_sleep_pool")
        return {k: max(w.get(k, 0.0) for w in per_worker) for k in ("weights_gb", "kv_cache_gb")}

    def unmap_trainer_memory(self) -> dict:
        """Before the trainer frees its weights (a colocated hand-off): cuda_ipc's mappings of them go."""
        return {"mapped_allocations": sum(self._workers("rlplacement_unmap_trainer_memory"))}

    def resume_weights(self) -> dict:
        """Before an update: the weights come back (the KV cache stays released while bytes arrive)."""
        return self._timed(lambda: self.llm.wake_up(tags=["weights"]), "wake_up(weights)")

    def resume_kv_cache(self) -> dict:
        """Before generating: the KV cache comes back and scheduling resumes."""
        return self._timed(lambda: self.llm.wake_up(tags=["kv_cache"]), "wake_up(kv_cache)")

    def resume_all(self) -> dict:
        return self._timed(lambda: self.llm.wake_up(), "wake_up")

    def _timed(self, action, what: str, quiesce: bool = False) -> dict:
        if not self.sleep_mode:
            raise RuntimeError(f"engine {self.engine_index} was started without sleep mode (--offload-rollout on a GPU)")
        if quiesce:
            self._stepper.wait_idle(before=what)
        start = time.perf_counter()
        self._between_steps(action, what)
        return {"seconds": time.perf_counter() - start, **self.gpu_memory()}

    def gpu_memory(self) -> dict:
        """GiB this engine's workers hold on their GPUs now and at most since the last call (the largest
        worker); empty without CUDA."""
        per_worker = self._workers("rlplacement_gpu_memory")
        per_worker = [m for m in per_worker if m]
        if not per_worker:
            return {}
        return {k: max(m[k] for m in per_worker) for k in per_worker[0]}
