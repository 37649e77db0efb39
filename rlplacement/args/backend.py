"""Trainer backend flags (``--train-backend``, checkpoints to start from, model parallelism) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import TRAIN_BACKENDS, flag, get, require_choice, require_positive
from rlplacement.config import (LORA_MEGATRON_NAMES, LORA_MODULES, MOE_DISPATCHERS, MOE_FLAGS, MOE_ROUTER_DTYPES,
                                BackendConfig, LoRAConfig, MoEConfig, PlacementConfig, default_of)
from rlplacement.errors import ConfigError

TITLE = "rlplacement: trainer backend"
FLAGS = (
    flag("--train-backend", type=str, default=default_of(BackendConfig, "name"), choices=TRAIN_BACKENDS,
          help="Trainer backend, any registered one (rlplacement.backends.registry.register_backend)."),
    flag("--hf-checkpoint", type=str, default=default_of(BackendConfig, "hf_checkpoint"),
          help="Hugging Face model folder."),
    flag("--load", type=str, default=default_of(BackendConfig, "load"),
          help="A training checkpoint to start from: a --save folder, or for megatron a torch_dist folder "
               "(`rlplacement convert`'s output is iteration 0)."),
    flag("--tensor-model-parallel-size", type=int,
          default=default_of(BackendConfig, "tensor_model_parallel_size")),
    flag("--pipeline-model-parallel-size", type=int,
          default=default_of(BackendConfig, "pipeline_model_parallel_size")),
    flag("--context-parallel-size", type=int, default=default_of(BackendConfig, "context_parallel_size"),
         help="Megatron context parallelism: only 1 is supported."),
    flag("--expert-model-parallel-size", type=int, default=default_of(BackendConfig, "expert_model_parallel_size"),
         help="Megatron expert parallelism for a mixture-of-experts model (each rank holds experts/EP of every "
              "sparse layer and sends its own); out of the data-parallel ranks."),
    flag("--expert-tensor-parallel-size", type=int, default=default_of(BackendConfig, "expert_tensor_parallel_size"),
         help="Megatron's tensor parallelism inside experts: 1 (or unset): experts use the dense layers' TP."),
    flag("--num-experts", type=int, default=default_of(MoEConfig, "num_experts"),
         help="Mixture-of-experts: experts per sparse layer; checked against config.json's num_experts."),
    flag("--moe-router-topk", type=int, default=default_of(MoEConfig, "router_topk"),
         help="Mixture-of-experts: experts per token; checked against config.json's num_experts_per_tok."),
    flag("--moe-ffn-hidden-size", type=int, default=default_of(MoEConfig, "ffn_hidden_size"),
         help="Mixture-of-experts: each expert's intermediate size; checked against moe_intermediate_size."),
    flag("--moe-aux-loss-coeff", type=float, default=default_of(MoEConfig, "aux_loss_coeff"),
         help="Mixture-of-experts: the routers' load-balancing loss weight (default: config.json's "
              "router_aux_loss_coef where output_router_logits is on, else 0)."),
    flag("--moe-z-loss-coeff", type=float, default=default_of(MoEConfig, "z_loss_coeff"),
         help="Mixture-of-experts, megatron: the router z-loss weight (default off)."),
    flag("--moe-token-dispatcher-type", type=str, default=default_of(MoEConfig, "token_dispatcher_type"),
         choices=MOE_DISPATCHERS, help="Mixture-of-experts, megatron: how tokens reach their experts."),
    flag("--moe-router-dtype", type=str, default=default_of(MoEConfig, "router_dtype"), choices=MOE_ROUTER_DTYPES,
         help="Mixture-of-experts, megatron: the router's compute dtype (default: the model's)."),
    flag("--moe-grouped-gemm", action="store_true", default=False,
         help="Megatron's grouped expert layouts (TransformerEngine's or grouped_gemm's): not built; refused "
              "naming the sequential layout experts train in."),
    flag("--use-rollout-routing-replay", action="store_true", default=default_of(MoEConfig, "rollout_routing_replay"),
         help="Mixture-of-experts: the engines return each token's experts and the trainer routes every token to "
              "them (Batch.routed_experts), so training runs the experts the rollout ran (needs GPU engines)."),
    flag("--lora-rank", type=int, default=default_of(LoRAConfig, "rank"),
         help="LoRA: train rank-N adapters on --target-modules with the base frozen (0: full fine-tuning; fsdp, "
              "megatron)."),
    flag("--lora-alpha", type=float, default=default_of(LoRAConfig, "alpha"),
         help="LoRA: the adapters' output is scaled by alpha / rank."),
    flag("--lora-dropout", type=float, default=default_of(LoRAConfig, "dropout"),
         help="LoRA: dropout on each adapter's input while training."),
    flag("--target-modules", type=str, default="all-linear",
         help="LoRA: the layers adapted, comma-separated, in HF (q_proj,...,down_proj) or megatron (linear_qkv, "
              "linear_proj, linear_fc1, linear_fc2) names; all-linear: every decoder linear layer."),
    flag("--exclude-modules", type=str, default=None, help="LoRA: layers left out of --target-modules."),
    flag("--lora-adapter-path", type=str, default=None,
         help="LoRA: start the adapters from a PEFT adapter folder (its rank, alpha and modules must match the "
              "flags)."),
    flag("--lora-merge-for-rollout", action="store_true", default=default_of(LoRAConfig, "merge_for_rollout"),
         help="LoRA: merge the adapters into the base on the trainer and send full weights every update (the "
              "slow path, for engines without LoRA serving); by default every update sends only the adapters, "
              "served live by vLLM on the checkpoint's base."),
    flag("--sequence-parallel", action="store_true", default=default_of(BackendConfig, "sequence_parallel"),
          help="Megatron: split the activations outside attention and MLP along the sequence over the TP "
               "ranks (needs --tensor-model-parallel-size > 1 and TransformerEngine)."),
)


def backend_from_args(args: argparse.Namespace, placement: PlacementConfig) -> BackendConfig:
    require_positive(args, ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    require_choice(args, ("train_backend",))
    name = get(args, "train_backend")
    tp, pp = get(args, "tensor_model_parallel_size"), get(args, "pipeline_model_parallel_size")
    if placement.trainer_num_gpus % (tp * pp):
        raise ConfigError(
            f"The trainer's {placement.trainer_num_gpus} GPUs are not divisible by "
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}: change the sizes "
            f"or --actor-num-gpus-per-node.")
    if name != "megatron" and (tp, pp) != (1, 1):
        raise ConfigError(
            f"--tensor-model-parallel-size/--pipeline-model-parallel-size apply to --train-backend megatron, "
            f"not {name}: drop them or use --train-backend megatron.")
    sequence_parallel = bool(get(args, "sequence_parallel"))
    if sequence_parallel and name != "megatron":
        raise ConfigError(f"--sequence-parallel is megatron's sequence parallelism over its TP ranks; the {name} "
                          f"backend has no tensor parallelism: drop the flag, or use --train-backend megatron.")
    if sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks, and "
                          "--tensor-model-parallel-size is 1: set it to 2 or more, or drop --sequence-parallel.")
    require_positive(args, ("context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size"))
    cp, ep, etp = (get(args, d) for d in ("context_parallel_size", "expert_model_parallel_size",
                                          "expert_tensor_parallel_size"))
    if cp != 1:
        raise ConfigError(f"--context-parallel-size {cp}: context parallelism is not built in rlplacement's trainers; "
                          f"use --context-parallel-size 1 (split long sequences with --max-tokens-per-gpu instead).")
    if etp not in (None, 1):
        raise ConfigError(f"--expert-tensor-parallel-size {etp}: experts run at the dense layers' tensor parallelism "
                          f"so far: use --expert-tensor-parallel-size 1.")
    if ep != 1 and name != "megatron":
        raise ConfigError(f"--expert-model-parallel-size {ep} is megatron's expert parallelism; the {name} backend "
                          f"shards experts as it shards every parameter: use --expert-model-parallel-size 1.")
    if ep != 1 and placement.trainer_num_gpus % (tp * pp * ep):
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide the trainer's "
                          f"{placement.trainer_num_gpus // (tp * pp)} data-parallel ranks (its GPUs over TP x PP): "
                          f"change it or --actor-num-gpus-per-node.")
    if get(args, "moe_grouped_gemm"):
        raise ConfigError("--moe-grouped-gemm: megatron's grouped expert layouts (TransformerEngine's, grouped_gemm's) "
                          "are not built; experts train in megatron's sequential layout, which converts and streams "
                          "bit-exact: drop --moe-grouped-gemm")
    moe = _moe_from_args(args, name)
    lora = _lora_from_args(args, name)
    return BackendConfig(name=name, hf_checkpoint=get(args, "hf_checkpoint"), load=get(args, "load"),
                         tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, moe=moe, lora=lora,
                         sequence_parallel=sequence_parallel)


_MEGATRON_ONLY = ("z_loss_coeff", "token_dispatcher_type", "router_dtype")


def _moe_from_args(args: argparse.Namespace, backend: str) -> MoEConfig:
    """The MoE flags as given; those that configure megatron's own MoE layer are refused for another backend
    (whether the model has experts is checked against config.json where the job starts)."""
    values = {field: get(args, flag_name.lstrip("-").replace("-", "_")) for field, flag_name in MOE_FLAGS.items()}
    values = {k: v for k, v in values.items() if v is not None}
    for field in ("num_experts", "router_topk", "ffn_hidden_size"):
        if field in values and values[field] < 1:
            raise ConfigError(f"{MOE_FLAGS[field]} {values[field]}: must be 1 or more")
    for field in ("aux_loss_coeff", "z_loss_coeff"):
        if field in values and values[field] < 0:
            raise ConfigError(f"{MOE_FLAGS[field]} {values[field]}: a loss weight is 0 or more")
    config = MoEConfig(**values)
    if backend != "megatron":
        for field in _MEGATRON_ONLY:
            if getattr(config, field) != getattr(MoEConfig(), field):
                raise ConfigError(f"{MOE_FLAGS[field]} configures megatron's MoE layer; the {backend} backend runs "
                                  f"the model's own MoE blocks: drop it, or use --train-backend megatron.")
    return config


def lora_modules(target: str, exclude: str | None) -> tuple[str, ...]:
    """``--target-modules`` minus ``--exclude-modules`` as HF layer names (megatron's names mapped to the HF
    layers they fuse); an unknown name is refused naming the flag and the names known."""
    def names(flag_name: str, text: str) -> list[str]:
        out = []
        for item in [t.strip() for t in text.split(",") if t.strip()]:
            if item == "all-linear":
                out += LORA_MODULES
            elif item in LORA_MODULES:
                out.append(item)
            elif item in LORA_MEGATRON_NAMES:
                out += LORA_MEGATRON_NAMES[item]
            else:
                raise ConfigError(f"{flag_name} {item}: not a decoder linear layer; use all-linear or HF names "
                                  f"({','.join(LORA_MODULES)}) or megatron's ({','.join(LORA_MEGATRON_NAMES)})")
        return out

    excluded = set(names("--exclude-modules", exclude or ""))
    chosen = tuple(m for m in LORA_MODULES if m in names("--target-modules", target) and m not in excluded)
    if not chosen:
        raise ConfigError(f"--target-modules {target} less --exclude-modules {exclude} leaves no layer to adapt")
    return chosen


def _lora_from_args(args: argparse.Namespace, backend: str) -> LoRAConfig:
    rank = get(args, "lora_rank")
    if not rank:
        return LoRAConfig()
    if rank < 0:
        raise ConfigError(f"--lora-rank {rank}: use 1 or more (0: no adapters)")
    if backend not in ("fsdp", "megatron"):
        raise ConfigError(f"--lora-rank with --train-backend {backend}: LoRA adapters train on the fsdp and megatron "
                          f"backends: use --train-backend fsdp or megatron")
    alpha, dropout = get(args, "lora_alpha"), get(args, "lora_dropout")
    if alpha <= 0:
        raise ConfigError(f"--lora-alpha {alpha}: use a positive scale")
    if not 0 <= dropout < 1:
        raise ConfigError(f"--lora-dropout {dropout}: use 0 <= p < 1")
    lora_targets = lora_modules(get(args, "target_modules"), get(args, "exclude_modules"))
    if backend == "megatron":
        from rlplacement.backends.megatron.lora import check_supported

        check_supported(LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules=lora_targets),
                        bool(get(args, "sequence_parallel")), moe=False)
    merge = bool(get(args, "lora_merge_for_rollout"))
    if not merge and get(args, "update_weight_staging") == "bucket":
        raise ConfigError("--update-weight-staging bucket with --lora-rank: an adapter-only update is staged whole "
                          "(it is small, and swapped in as one); use --update-weight-staging full or auto, or add "
                          "--lora-merge-for-rollout")
    if not merge:
        from rlplacement.engines.live_lora import engine_args

        engine_args(rank)  # a rank vLLM cannot serve is refused here, naming the flag
    return LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, merge_for_rollout=merge, target_modules=lora_targets,
                      adapter_path=get(args, "lora_adapter_path"))
