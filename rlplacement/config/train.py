"""One train call on the trainer (precision, batching, memory, the objective, checkpoints) and its optimizer
and learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Iterable

from rlplacement.errors import ConfigError

if TYPE_CHECKING:
    import torch


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
    train_during_rollout: bool = False
    """Train the groups that have finished while the rest still decode (``--train-during-rollout``): each
    chunk of finished groups runs forward and backward with loss normaliser 1, gradients accumulating; after
    the last chunk the token count is all-reduced, the gradients scaled by data-parallel size / tokens, and the
    one optimizer step runs on the weights every sample was drawn from. Equal to the whole-batch step on the
    same samples for dense models (MoE router losses are per micro-batch, and a chunk's micro-batches hold other
    samples than the whole batch's)."""
    save: str | None = None
    """Folder for training checkpoints (``--save``): model, optimizer, schedule, step, RNG, weight version."""
    save_interval: int | None = None
    """Save every this many train calls (``--save-interval``); None: never."""

    @property
    def eps_clip_upper(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def refuse_steps_within_batch(train: TrainConfig, samples: int) -> None:
    """Under ``train_during_rollout`` a rollout batch of ``samples`` is one optimizer step: a
    ``global_batch_size`` below it (set by hand in a config, the flag being refused with it) would need a step's
    weights before its later samples could train."""
    if train.train_during_rollout and train.global_batch_size is not None and train.global_batch_size < samples:
        raise ConfigError(f"--train-during-rollout takes one optimizer step per rollout batch; --global-batch-size "
                          f"{train.global_batch_size} is below this batch's {samples} samples: drop "
                          f"--global-batch-size, or drop --train-during-rollout.")
