"""What must leave a shared GPU before each phase, decided from memory readings (pure functions).

Under ``--colocate`` with ``--offload-train``/``--offload-rollout`` left unset, the hand-off moves a side
only when the other side's next phase would not fit beside it; an explicit flag is never overridden.
All figures are GiB of one GPU: the tightest trainer GPU's free memory against the largest engine
worker's need, since every trainer rank shares its GPU with engine workers.

* Before rollout, the engines wake what they released (KV cache, and the weights after a sleep): a
  pool of fixed size, known exactly from vLLM's sleep pool. The trainer stays if that fits in the
  free memory with :func:`headroom_gb` to spare.
* Before training, the trainer grows from what it holds to its peak. The peak of a step is known
  only once one ran, and varies with the batch's lengths: the engines sleep before the first step,
  and later stay awake only if the last peak's growth, plus a quarter, plus the headroom, fits.
  Sleeping costs ~0.1 s (vLLM level 2); running out of memory costs the run.

The same test (:func:`fits`) decides what may overlap: the engines' KV cache waking while the trainer's
state leaves, and the trainer's state coming back while the engines go to sleep.
"""

from __future__ import annotations

PEAK_SLACK = 1.25
"""A training step's growth is taken as the last measured one times this: batches vary in length."""


def headroom_gb(total_gb: float) -> float:
    """Memory left free after a side wakes beside the other: CUDA contexts, NCCL, allocator slack."""
    return max(2.0, 0.03 * total_gb)


def fits(free_gb: float, need_gb: float, total_gb: float) -> bool:
    """Whether ``need_gb`` can be allocated in ``free_gb`` with the headroom to spare."""
    return free_gb >= need_gb + headroom_gb(total_gb)


def trainer_must_leave(free_gb: float, engine_wake_gb: float, total_gb: float) -> bool:
    """Before rollout: whether the engines' wake-up (``engine_wake_gb``) does not fit in ``free_gb``."""
    return not fits(free_gb, engine_wake_gb, total_gb)


def engines_must_sleep(free_gb: float, trainer_growth_gb: float | None, total_gb: float) -> bool:
    """Before training: whether the trainer's growth to its peak (None: no step measured yet) may not
    fit in ``free_gb`` beside engines that stay awake."""
    if trainer_growth_gb is None:
        return True
    return free_gb < max(0.0, trainer_growth_gb) * PEAK_SLACK + headroom_gb(total_gb)


def engine_wake_gb(pool: dict, holds: str) -> float:
    """GiB an engine allocates to wake from what it ``holds`` (``weights``: its KV cache; ``nothing``: both)."""
    kv = pool.get("kv_cache_gb", 0.0)
    return kv if holds == "weights" else kv + pool.get("weights_gb", 0.0)
