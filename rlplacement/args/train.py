"""Train-step flags (precision, batching, recompute, the objective, checkpoints) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import flag, get, require_choice, require_positive
from rlplacement.args.placement import require_both_resident
from rlplacement.specs.backend import backend_spec, backends_with, known_backends, spoken
from rlplacement.specs.backend import GRADIENT_CHECKPOINTING, LAYERS
from rlplacement.config import KL_LOSS_TYPES, BackendConfig, PlacementConfig, TrainConfig, default_of
from rlplacement.errors import ConfigError

TITLE = "rlplacement: train step"
FLAGS = (
    flag("--bf16", action=argparse.BooleanOptionalAction, default=default_of(TrainConfig, "bf16"),
          help="Mixed precision: fp32 master weights and AdamW state, bf16 compute, fp32 gradient "
               "reduction (on by default where the trainer is on a GPU; --no-bf16 keeps fp32)."),
    flag("--global-batch-size", type=int, default=default_of(TrainConfig, "global_batch_size"),
          help="Samples per optimizer step over all data-parallel ranks (default: the whole rollout batch)."),
    flag("--micro-batch-size", type=int, default=default_of(TrainConfig, "micro_batch_size"),
          help="Samples per forward/backward on one rank; gradients accumulate into one step."),
    flag("--use-dynamic-batch-size", action="store_true",
          default=default_of(TrainConfig, "use_dynamic_batch_size"),
          help="Pack samples into micro-batches by token count (--max-tokens-per-gpu)."),
    flag("--max-tokens-per-gpu", type=int, default=default_of(TrainConfig, "max_tokens_per_gpu"),
          help="With --use-dynamic-batch-size: most tokens (samples x padded length) per micro-batch."),
    flag("--gradient-checkpointing", action="store_true",
          default=default_of(TrainConfig, "gradient_checkpointing"),
          help="Recompute each decoder layer's activations in the backward pass."),
    flag("--recompute-granularity", choices=("full", "selective"),
          default=default_of(TrainConfig, "recompute_granularity"),
          help="Megatron: recompute activations in backward: full layers (with --recompute-method and "
               "--recompute-num-layers) or selective (core attention only)."),
    flag("--recompute-method", choices=("uniform", "block"), default=default_of(TrainConfig, "recompute_method"),
          help="Megatron, with --recompute-granularity full: uniform (every --recompute-num-layers layers "
               "as one unit) or block (the first --recompute-num-layers layers of each pipeline stage)."),
    flag("--recompute-num-layers", type=int, default=default_of(TrainConfig, "recompute_num_layers"),
          help="Megatron, with --recompute-granularity full: layers per unit (uniform) or recomputed (block)."),
    flag("--accumulate-allreduce-grads-in-fp32", action=argparse.BooleanOptionalAction,
         default=default_of(TrainConfig, "accumulate_allreduce_grads_in_fp32"),
         help="Megatron under --bf16: accumulate and all-reduce gradients in fp32 (on by default; "
              "--no-accumulate-allreduce-grads-in-fp32: in bf16)."),
    flag("--attention-softmax-in-fp32", action=argparse.BooleanOptionalAction,
         default=default_of(TrainConfig, "attention_softmax_in_fp32"),
         help="Megatron: the attention softmax in fp32 (megatron's default; --no-attention-softmax-in-fp32 to turn off)."),
    flag("--attention-dropout", type=float, default=0.0,
         help="Megatron's dropout flags are accepted at 0 only: dropout would make the trainer's log-probs differ "
              "from the engines'."),
    flag("--hidden-dropout", type=float, default=0.0, help="As --attention-dropout: 0 only."),
    flag("--use-distributed-optimizer", action="store_true",
          default=default_of(TrainConfig, "use_distributed_optimizer"),
          help="Megatron: shard the fp32 main parameters and optimizer moments over the data-parallel "
               "ranks (megatron's DistributedOptimizer)."),
    flag("--log-probs-chunk-size", type=int, default=default_of(TrainConfig, "log_probs_chunk_size"),
          help="Tokens per chunk of the output layer (fp32 logits exist for one chunk at a time; megatron: "
               "its output layer runs whole, the fp32 logits and cross-entropy go by chunks)."),
    flag("--eps-clip", type=float, default=default_of(TrainConfig, "eps_clip"),
          help="PPO clip range of the importance ratio (lower side, and upper unless --eps-clip-high)."),
    flag("--eps-clip-high", type=float, default=default_of(TrainConfig, "eps_clip_high"),
          help="Upper clip range (clip-higher)."),
    flag("--use-kl-loss", action="store_true", default=default_of(TrainConfig, "use_kl_loss"),
          help="Add a KL penalty to a frozen reference model (the starting weights)."),
    flag("--kl-loss-coef", type=float, default=default_of(TrainConfig, "kl_loss_coef")),
    flag("--kl-loss-type", type=str, default=None, choices=KL_LOSS_TYPES,
          help=f"Per-token KL estimator (with --use-kl-loss; default "
               f"{default_of(TrainConfig, 'kl_loss_type')})."),
    flag("--entropy-coef", type=float, default=default_of(TrainConfig, "entropy_coef")),
    flag("--use-tis", action="store_true", default=default_of(TrainConfig, "use_tis"),
          help="Truncated importance sampling: weight each token's policy-gradient term by "
               "clamp(exp(old log-prob - rollout log-prob), --tis-clip-low, --tis-clip), the trainer's "
               "log-probs at the step's start over the engine's that sampled it (needs Batch.rollout_logprobs)."),
    flag("--tis-clip", type=float, default=default_of(TrainConfig, "tis_clip"),
          help="--use-tis: upper bound of the importance weight."),
    flag("--tis-clip-low", type=float, default=default_of(TrainConfig, "tis_clip_low"),
          help="--use-tis: lower bound of the importance weight."),
    flag("--train-during-rollout", action="store_true", default=default_of(TrainConfig, "train_during_rollout"),
         help="Train each finished group (forward and backward, gradients accumulating) while the rest of the "
              "rollout still decodes; the one optimizer step runs after the last group, on the weights every "
              "sample was drawn from (strictly on-policy). Equal to the whole-batch step for dense models; MoE "
              "router losses are per micro-batch of a chunk. One optimizer step per rollout batch."),
    flag("--save", type=str, default=default_of(TrainConfig, "save"),
          help="Folder for training checkpoints (model, optimizer, schedule, step, RNG, weight version), written "
               "every --save-interval train steps (a library caller may also call RLJob.save_checkpoint)."),
    flag("--save-interval", type=int, default=default_of(TrainConfig, "save_interval"),
          help="Save every N train steps (with --save)."),
)


def train_from_args(args: argparse.Namespace, placement: PlacementConfig, backend: BackendConfig) -> TrainConfig:
    temperature = get(args, "rollout_temperature")
    if temperature is not None and temperature <= 0:
        raise ConfigError(f"--rollout-temperature {temperature}: the trainer divides its logits by the temperature, so "
                          f"it must be above 0 (sampling needs a distribution; for near-greedy rollouts use e.g. "
                          f"--rollout-temperature 0.1).")
    require_positive(args, ("global_batch_size", "micro_batch_size", "max_tokens_per_gpu", "log_probs_chunk_size",
                             "save_interval"))
    require_choice(args, ("kl_loss_type",))
    dynamic, max_tokens = bool(get(args, "use_dynamic_batch_size")), get(args, "max_tokens_per_gpu")
    micro, global_batch = get(args, "micro_batch_size"), get(args, "global_batch_size")
    if dynamic and max_tokens is None:
        raise ConfigError("--use-dynamic-batch-size packs micro-batches by token count: set --max-tokens-per-gpu "
                          "(the most tokens one micro-batch may hold).")
    if max_tokens is not None and not dynamic:
        raise ConfigError("--max-tokens-per-gpu applies to --use-dynamic-batch-size: add it, or drop "
                          "--max-tokens-per-gpu and set --micro-batch-size.")
    if dynamic and micro is not None:
        raise ConfigError("--micro-batch-size and --use-dynamic-batch-size both size micro-batches: keep one.")
    dp = placement.trainer_num_gpus // (backend.tensor_model_parallel_size * backend.pipeline_model_parallel_size)
    if global_batch is not None and global_batch % dp:
        raise ConfigError(f"--global-batch-size {global_batch} does not split over the trainer's {dp} data-parallel "
                          f"ranks: use a multiple of {dp}.")
    if global_batch is not None and micro is not None and micro > global_batch // dp:
        raise ConfigError(f"--micro-batch-size {micro} is larger than a rank's share of an optimizer step "
                          f"(--global-batch-size {global_batch} over {dp} data-parallel ranks = {global_batch // dp}): "
                          f"lower --micro-batch-size to {global_batch // dp} or less.")
    use_kl, kl_type = bool(get(args, "use_kl_loss")), get(args, "kl_loss_type")
    if kl_type is not None and not use_kl:
        raise ConfigError(f"--kl-loss-type {kl_type} chooses the KL estimator of --use-kl-loss: add --use-kl-loss, "
                          f"or drop --kl-loss-type.")
    coefs = {d: float(get(args, d)) for d in ("kl_loss_coef", "entropy_coef", "eps_clip")}
    high = get(args, "eps_clip_high")
    for dest, value in (*coefs.items(), ("eps_clip_high", high)):
        if value is not None and value < 0:
            name = "--" + dest.replace("_", "-")
            raise ConfigError(f"{name} {value} must be 0 or more: set {name} to 0 or a positive value.")
    if coefs["kl_loss_coef"] and not use_kl:
        raise ConfigError("--kl-loss-coef weighs the KL term of --use-kl-loss: add --use-kl-loss, or drop "
                          "--kl-loss-coef.")
    save, interval, bf16 = get(args, "save"), get(args, "save_interval"), get(args, "bf16")
    recompute = _recompute_from_args(args, backend)
    for dest in ("attention_dropout", "hidden_dropout"):
        value = get(args, dest)
        if value:
            name = "--" + dest.replace("_", "-")
            raise ConfigError(f"{name} {value}: dropout makes the trainer's log-probs of a sample differ from the "
                              f"engines' (which run without it), so the PPO ratio would be off from the first step: "
                              f"use {name} 0.")
    fp32_flags = {d: bool(get(args, d)) for d in ("accumulate_allreduce_grads_in_fp32", "attention_softmax_in_fp32")}
    turned_off = [f"--no-{d.replace('_', '-')}" for d, on in fp32_flags.items() if not on]
    spec = backend_spec(backend.name)
    if turned_off and not spec.fp32_switches:
        others = spoken(backends_with("fp32_switches"))
        raise ConfigError(f"{' and '.join(turned_off)} configure {others}; the {backend.name} backend reduces gradients "
                          f"in fp32 (FSDP2's mixed precision) and leaves the softmax to its attention kernel: drop "
                          f"{' and '.join(turned_off)}, or use --train-backend {others}.")
    distributed_optimizer = bool(get(args, "use_distributed_optimizer"))
    if distributed_optimizer and not spec.distributed_optimizer:
        others = spoken(backends_with("distributed_optimizer"))
        raise ConfigError(f"--use-distributed-optimizer is {others}'s DistributedOptimizer; the {backend.name} backend "
                          f"shards its optimizer state its own way: drop the flag, or use --train-backend {others}.")
    if save:
        from rlplacement.atomic_files import check_writable

        check_writable(save, "--save")
    if interval is not None and not save:
        raise ConfigError("--save-interval says how often to write a checkpoint: set --save to a folder, or drop "
                          "--save-interval.")
    tis = _tis_from_args(args)
    during = _train_during_rollout_from_args(args, placement, spec, global_batch)
    return TrainConfig(**tis, train_during_rollout=during, bf16=bf16, global_batch_size=global_batch, micro_batch_size=micro,
                       use_dynamic_batch_size=dynamic, max_tokens_per_gpu=max_tokens,
                       gradient_checkpointing=bool(get(args, "gradient_checkpointing")),
                       use_distributed_optimizer=distributed_optimizer, **recompute, **fp32_flags,
                       log_probs_chunk_size=int(get(args, "log_probs_chunk_size")), eps_clip=coefs["eps_clip"],
                       eps_clip_high=None if high is None else float(high), use_kl_loss=use_kl,
                       kl_loss_coef=coefs["kl_loss_coef"], kl_loss_type=kl_type or default_of(TrainConfig, "kl_loss_type"),
                       entropy_coef=coefs["entropy_coef"],
                       rollout_temperature=float(get(args, "rollout_temperature")), save=save, save_interval=interval)


def _train_during_rollout_from_args(args: argparse.Namespace, placement: PlacementConfig, spec,
                                    global_batch: int | None) -> bool:
    """``--train-during-rollout``: one optimizer step per rollout batch, on a backend whose chunked step is checked,
    beside engines that stay awake for the whole rollout."""
    if not get(args, "train_during_rollout"):
        return False
    if not spec.trains_during_rollout:
        others = spoken(backends_with("trains_during_rollout"))
        raise ConfigError(f"--train-during-rollout: the {spec.name} backend's chunked step (gradients accumulated over "
                          f"chunks, reduced and stepped once) is not checked against its whole-batch step: use "
                          f"--train-backend {others}, or drop --train-during-rollout.")
    if global_batch is not None:
        raise ConfigError(f"--train-during-rollout takes one optimizer step per rollout batch, after its last group; "
                          f"--global-batch-size {global_batch} asks for a step every {global_batch} samples, each "
                          f"needing the previous step's weights before its samples could train: drop "
                          f"--global-batch-size, or drop --train-during-rollout.")
    for name, dest in (("--one-step-off", "one_step_off"), ("--fully-async", "fully_async")):
        if get(args, dest):
            raise ConfigError(f"--train-during-rollout trains on the weights every sample was drawn from; {name} "
                              f"trains on samples of older weights while the next ones generate: keep one of the two.")
    require_both_resident(placement, "--train-during-rollout under --colocate trains beside engines that are still "
                                     "decoding, so neither side may be moved off the GPUs mid-rollout (the hand-off "
                                     "would put the engines to sleep or the trainer on the host between the two)")
    return True


def _recompute_from_args(args: argparse.Namespace, backend) -> dict:
    """Activation recompute, each backend's own way (``BackendSpec.recompute``): megatron's three flags, or
    FSDP's and torchtitan's --gradient-checkpointing; the other way's flags are refused, naming this
    backend's."""
    granularity, method, layers = (get(args, d) for d in ("recompute_granularity", "recompute_method",
                                                            "recompute_num_layers"))
    if backend_spec(backend.name).recompute == LAYERS:
        if get(args, "gradient_checkpointing"):
            others = spoken([n for n in known_backends() if backend_spec(n).recompute == GRADIENT_CHECKPOINTING], "and")
            raise ConfigError(f"--gradient-checkpointing is the {others} backends' recompute; {backend.name} "
                              "recomputes through its own flags: use --recompute-granularity full --recompute-method "
                              "uniform --recompute-num-layers 1 (every layer), or --recompute-granularity selective.")
        if granularity == "full" and (method is None or layers is None):
            raise ConfigError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                              "--recompute-num-layers N: add both (uniform with 1 recomputes every layer).")
        if granularity != "full" and (method is not None or layers is not None):
            said = " and ".join(f for f, v in (("--recompute-method", method), ("--recompute-num-layers", layers))
                                if v is not None)
            raise ConfigError(f"{said} apply only with --recompute-granularity full (got "
                              f"{granularity or 'no --recompute-granularity'}): add --recompute-granularity full, or "
                              f"drop {said}.")
        if layers is not None and layers < 1:  # the bound above (a stage's layers) is checked with the model
            raise ConfigError(f"--recompute-num-layers {layers}: use 1 or more.")
        if granularity == "full" and backend.moe.rollout_routing_replay and backend.pipeline_model_parallel_size > 1:
            raise ConfigError(f"--use-rollout-routing-replay with --recompute-granularity full at "
                              f"--pipeline-model-parallel-size {backend.pipeline_model_parallel_size}: a recomputed "
                              f"router replays the micro-batch set last, and the pipeline schedule runs other "
                              f"micro-batches' forwards before a backward; use --recompute-granularity selective, or "
                              f"drop --use-rollout-routing-replay.")
    elif granularity is not None or method is not None or layers is not None:
        others = spoken([n for n in known_backends() if backend_spec(n).recompute == LAYERS], "and")
        raise ConfigError(f"--recompute-granularity, --recompute-method and --recompute-num-layers are {others}'s; "
                          f"the {backend.name} backend recomputes with --gradient-checkpointing: use that instead.")
    return {"recompute_granularity": granularity, "recompute_method": method, "recompute_num_layers": layers}


def _tis_from_args(args: argparse.Namespace) -> dict:
    use, high, low = bool(get(args, "use_tis")), float(get(args, "tis_clip")), float(get(args, "tis_clip_low"))
    if not use:
        given = [n for n, d, v in (("--tis-clip", "tis_clip", high), ("--tis-clip-low", "tis_clip_low", low))
                 if v != default_of(TrainConfig, d)]
        if given:
            raise ConfigError(f"{' and '.join(given)} bound{'s' if len(given) == 1 else ''} the truncated importance "
                              f"weight, which is off: add --use-tis, or drop {' and '.join(given)}.")
    if high <= 0:
        raise ConfigError(f"--tis-clip {high} must be above 0: set it to the largest importance weight a token may "
                          f"get (Miles' default {default_of(TrainConfig, 'tis_clip')}).")
    if not 0 <= low < high:
        raise ConfigError(f"--tis-clip-low {low} must be at least 0 and below --tis-clip {high}: lower it.")
    return {"use_tis": use, "tis_clip": high, "tis_clip_low": low}
