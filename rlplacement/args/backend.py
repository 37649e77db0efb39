"""Trainer backend flags (``--train-backend``, checkpoints to start from, model parallelism) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import TRAIN_BACKENDS, flag, get, require_choice, require_positive
from rlplacement.config import BackendConfig, PlacementConfig, default_of
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
         help="Megatron expert parallelism: `rlplacement convert` takes it for a mixture-of-experts model; "
              "training is of dense models only so far, so 1 here."),
    flag("--expert-tensor-parallel-size", type=int, default=default_of(BackendConfig, "expert_tensor_parallel_size"),
         help="Megatron's tensor parallelism inside experts: dense models only so far, so 1 (or unset)."),
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
    for flag_name, value in (("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size", etp)):
        if value not in (None, 1):
            raise ConfigError(f"{flag_name} {value}: expert parallelism needs a mixture-of-experts model, and "
                              f"rlplacement trains dense models only so far: use {flag_name} 1.")
    return BackendConfig(name=name, hf_checkpoint=get(args, "hf_checkpoint"), load=get(args, "load"),
                         tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                         sequence_parallel=sequence_parallel)
