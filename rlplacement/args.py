"""Every rlplacement flag, defined once, and the one place they are validated.

``add_arguments(parser)`` adds the flags to any argparse parser (a Megatron or Miles
``extra_args_provider`` included) and skips flags the parser already has, so an RL codebase that
already defines ``--colocate`` keeps its own definition. ``config_from_args(args)`` turns parsed
args into the frozen configs of :mod:`rlplacement.config` and raises :class:`ConfigError` naming the
flag and what to change. Defaults are the configs' own (read from their fields), and the names a
choice flag accepts are read from its registry when asked, so a backend or transfer mode registered
after import is offered and accepted like the built-in ones.

Invariant: validation never rewrites a value the user set. Values the user left unset are derived
(``--rollout-num-gpus`` under ``--colocate`` is the trainer's GPU count) and the derivation is
recorded in the config, not written back into ``args``.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Callable, Iterable

from rlplacement.backends import registry as backend_registry
from rlplacement.config import (ENGINE_DTYPES, KL_LOSS_TYPES, LR_DECAY_STYLES, BackendConfig, Config, OptimConfig,
                                PlacementConfig, RolloutConfig, TrainConfig, TransferConfig, default_of)
from rlplacement.errors import ConfigError
from rlplacement.transfer import registry as transfer_registry
from rlplacement.transfer.options import DELTA_ENCODINGS, P2P_PROTOCOLS


class RegistryChoices:
    """A choice flag's accepted names, read from a registry each time argparse (or validation) asks."""

    def __init__(self, names: Callable[[], Iterable[str]]):
        self._names = names

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in tuple(self._names())


# registered modes a user may name (all but the colocated one, which --colocate picks)
TRANSFER_MODES = RegistryChoices(transfer_registry.selectable_modes)
TRAIN_BACKENDS = RegistryChoices(backend_registry.known_backends)


@dataclasses.dataclass(frozen=True)
class _Flag:
    names: tuple[str, ...]
    kwargs: dict[str, Any]

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def _flag(*names: str, **kwargs: Any) -> _Flag:
    return _Flag(names, kwargs)


# (group title, flags). Names and defaults follow Miles so users need not relearn them.
FLAG_GROUPS: tuple[tuple[str, tuple[_Flag, ...]], ...] = (
    (
        "rlplacement: placement",
        (
            _flag("--colocate", action="store_true", default=default_of(PlacementConfig, "colocate"),
                  help="Trainer and rollout engines time-share the same GPUs."),
            _flag("--actor-num-nodes", type=int, default=default_of(PlacementConfig, "actor_num_nodes"), help="Nodes for the trainer."),
            _flag("--actor-num-gpus-per-node", type=int, default=default_of(PlacementConfig, "actor_num_gpus_per_node"),
                  help="Trainer GPUs on each trainer node."),
            _flag("--rollout-num-gpus", type=int, default=None,
                  help="GPUs for rollout engines (required in a split layout; under --colocate "
                       "it defaults to, and must equal, the trainer's GPU count)."),
            _flag("--rollout-num-gpus-per-engine", type=int, default=default_of(PlacementConfig, "rollout_num_gpus_per_engine"),
                  help="GPUs per rollout engine (its tensor-parallel size)."),
            _flag("--num-gpus-per-node", type=int, default=default_of(PlacementConfig, "num_gpus_per_node"), help="GPUs on each node of the cluster."),
            _flag("--ray-address", type=str, default=default_of(PlacementConfig, "ray_address"),
                  help="Address of an existing Ray cluster (else RAY_ADDRESS, else a local one)."),
            _flag("--offload-train", action=argparse.BooleanOptionalAction, default=None,
                  help="--colocate: move the trainer's weights and optimizer state to host memory while the "
                       "engines generate; --no-offload-train keeps them resident; unset, they move only when "
                       "the engines' KV cache would not fit beside them."),
            _flag("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
                  help="--colocate: the engines release their weights and KV cache (vLLM sleep mode) while the "
                       "trainer trains; --no-offload-rollout keeps them resident; unset, they sleep unless the "
                       "trainer's measured peak fits beside them."),
            _flag("--offload-rollout-keep-weights", action="store_true",
                  default=default_of(PlacementConfig, "offload_rollout_keep_weights"),
                  help="--colocate: sleeping engines copy their weights to host memory and back (vLLM level 1) "
                       "instead of discarding them (level 2; the update refills them from the trainer), so a "
                       "failed update leaves the previous version served instead of refusing to generate."),
            _flag("--one-step-off", action="store_true", default=default_of(PlacementConfig, "one_step_off"),
                  help="Split layouts: generate step k+1 while the trainer trains on step k (samples at most "
                       "one weight version stale; the loss corrects with the engine's log-probs)."),
        ),
    ),
    (
        "rlplacement: weight transfer",
        (
            _flag("--update-weight-transfer-mode", type=str, default=default_of(TransferConfig, "requested_mode"),
                  choices=TRANSFER_MODES,
                  help="How weights reach the engines in a split layout. Under --colocate the "
                       "in-GPU CUDA IPC path is used (broadcast modes only)."),
            _flag("--update-weight-buffer-size", type=int, default=default_of(TransferConfig, "buffer_size"),
                  help="Bucket size in bytes for packing tensors."),
            _flag("--update-weight-disk-dir", type=str, default=default_of(TransferConfig, "disk_dir"),
                  help="Shared folder for disk-delta versions."),
            _flag("--update-weight-delta-encoding", type=str, default=default_of(TransferConfig, "delta_encoding"),
                  choices=DELTA_ENCODINGS,
                  help="disk-delta encoding: xor (apply exactly once) or overwrite (idempotent)."),
            _flag("--p2p-protocol", type=str, default=None, choices=P2P_PROTOCOLS,
                  help="Mooncake transport for p2p: rdma where this host has an RDMA device, else tcp "
                       "(the default picks so; a value you set is kept, and rdma without a device is refused)."),
            _flag("--p2p-transfer-timeout", type=float, default=default_of(TransferConfig, "p2p_timeout_s"),
                  help="Seconds a p2p update may take before it is failed."),
            _flag("--check-weight-update-equal", action="store_true", default=default_of(TransferConfig, "check_equal"),
                  help="After each update compare engine and trainer weights; raise on mismatch."),
        ),
    ),
    (
        "rlplacement: trainer backend",
        (
            _flag("--train-backend", type=str, default=default_of(BackendConfig, "name"), choices=TRAIN_BACKENDS,
                  help="Trainer backend, any registered one (rlplacement.backends.registry.register_backend)."),
            _flag("--hf-checkpoint", type=str, default=default_of(BackendConfig, "hf_checkpoint"),
                  help="Hugging Face model folder."),
            _flag("--load", type=str, default=default_of(BackendConfig, "load"),
                  help="A training checkpoint to start from: a --save folder, or for megatron a torch_dist folder "
                       "(`rlplacement convert`'s output is iteration 0)."),
            _flag("--tensor-model-parallel-size", type=int,
                  default=default_of(BackendConfig, "tensor_model_parallel_size")),
            _flag("--pipeline-model-parallel-size", type=int,
                  default=default_of(BackendConfig, "pipeline_model_parallel_size")),
            _flag("--sequence-parallel", action="store_true", default=default_of(BackendConfig, "sequence_parallel"),
                  help="Megatron: split the activations outside attention and MLP along the sequence over the TP "
                       "ranks (needs --tensor-model-parallel-size > 1 and TransformerEngine)."),
        ),
    ),
    (
        "rlplacement: train step",
        (
            _flag("--bf16", action=argparse.BooleanOptionalAction, default=default_of(TrainConfig, "bf16"),
                  help="Mixed precision: fp32 master weights and AdamW state, bf16 compute, fp32 gradient "
                       "reduction (on by default where the trainer is on a GPU; --no-bf16 keeps fp32)."),
            _flag("--global-batch-size", type=int, default=default_of(TrainConfig, "global_batch_size"),
                  help="Samples per optimizer step over all data-parallel ranks (default: the whole rollout batch)."),
            _flag("--micro-batch-size", type=int, default=default_of(TrainConfig, "micro_batch_size"),
                  help="Samples per forward/backward on one rank; gradients accumulate into one step."),
            _flag("--use-dynamic-batch-size", action="store_true",
                  default=default_of(TrainConfig, "use_dynamic_batch_size"),
                  help="Pack samples into micro-batches by token count (--max-tokens-per-gpu)."),
            _flag("--max-tokens-per-gpu", type=int, default=default_of(TrainConfig, "max_tokens_per_gpu"),
                  help="With --use-dynamic-batch-size: most tokens (samples x padded length) per micro-batch."),
            _flag("--gradient-checkpointing", action="store_true",
                  default=default_of(TrainConfig, "gradient_checkpointing"),
                  help="Recompute each decoder layer's activations in the backward pass."),
            _flag("--recompute-granularity", choices=("full", "selective"),
                  default=default_of(TrainConfig, "recompute_granularity"),
                  help="Megatron: recompute activations in backward: full layers (with --recompute-method and "
                       "--recompute-num-layers) or selective (core attention only)."),
            _flag("--recompute-method", choices=("uniform", "block"), default=default_of(TrainConfig, "recompute_method"),
                  help="Megatron, with --recompute-granularity full: uniform (every --recompute-num-layers layers "
                       "as one unit) or block (the first --recompute-num-layers layers of each pipeline stage)."),
            _flag("--recompute-num-layers", type=int, default=default_of(TrainConfig, "recompute_num_layers"),
                  help="Megatron, with --recompute-granularity full: layers per unit (uniform) or recomputed (block)."),
            _flag("--use-distributed-optimizer", action="store_true",
                  default=default_of(TrainConfig, "use_distributed_optimizer"),
                  help="Megatron: shard the fp32 main parameters and optimizer moments over the data-parallel "
                       "ranks (megatron's DistributedOptimizer)."),
            _flag("--log-probs-chunk-size", type=int, default=default_of(TrainConfig, "log_probs_chunk_size"),
                  help="Tokens per chunk of the output layer (fp32 logits exist for one chunk at a time; megatron: "
                       "its output layer runs whole, the fp32 logits and cross-entropy go by chunks)."),
            _flag("--eps-clip", type=float, default=default_of(TrainConfig, "eps_clip"),
                  help="PPO clip range of the importance ratio (lower side, and upper unless --eps-clip-high)."),
            _flag("--eps-clip-high", type=float, default=default_of(TrainConfig, "eps_clip_high"),
                  help="Upper clip range (clip-higher)."),
            _flag("--use-kl-loss", action="store_true", default=default_of(TrainConfig, "use_kl_loss"),
                  help="Add a KL penalty to a frozen reference model (the starting weights)."),
            _flag("--kl-loss-coef", type=float, default=default_of(TrainConfig, "kl_loss_coef")),
            _flag("--kl-loss-type", type=str, default=None, choices=KL_LOSS_TYPES,
                  help=f"Per-token KL estimator (with --use-kl-loss; default "
                       f"{default_of(TrainConfig, 'kl_loss_type')})."),
            _flag("--entropy-coef", type=float, default=default_of(TrainConfig, "entropy_coef")),
            _flag("--save", type=str, default=default_of(TrainConfig, "save"),
                  help="Folder for training checkpoints (model, optimizer, schedule, step, RNG, weight version)."),
            _flag("--save-interval", type=int, default=default_of(TrainConfig, "save_interval"),
                  help="Save every N train steps (with --save)."),
        ),
    ),
    (
        "rlplacement: rollout",
        (
            _flag("--rollout-temperature", type=float, default=default_of(TrainConfig, "rollout_temperature"),
                  help="Sampling temperature; the trainer's logits are divided by it too."),
            _flag("--rollout-top-p", type=float, default=default_of(RolloutConfig, "top_p")),
            _flag("--rollout-top-k", type=int, default=default_of(RolloutConfig, "top_k"), help="-1: all tokens."),
            _flag("--rollout-max-response-len", type=int, default=default_of(RolloutConfig, "max_response_len"),
                  help="Most tokens generated per sample."),
            _flag("--rollout-stop", type=str, nargs="+", default=None, help="Strings that end a sample."),
            _flag("--rollout-stop-token-ids", type=int, nargs="+", default=None,
                  help="Token ids that end a sample (besides end-of-sequence)."),
            _flag("--n-samples-per-prompt", type=int, default=default_of(RolloutConfig, "n_samples_per_prompt"),
                  help="Samples per prompt (a GRPO group), all on one engine (its prefix cache serves them)."),
            _flag("--rollout-seed", type=int, default=default_of(RolloutConfig, "seed"),
                  help="Base of the per-sample sampling seeds."),
            _flag("--vllm-dtype", type=str, default=default_of(RolloutConfig, "dtype"), choices=ENGINE_DTYPES,
                  help="Engine dtype; auto: the one the model's config declares."),
            _flag("--vllm-max-model-len", "--rollout-max-context-len", type=int,
                  default=default_of(RolloutConfig, "max_model_len"),
                  help="Engine context length (prompt + response); default: the model's max_position_embeddings."),
            _flag("--vllm-enforce-eager", action="store_true", default=default_of(RolloutConfig, "enforce_eager"),
                  help="Decode without CUDA graphs (CPU engines always run eager)."),
            _flag("--vllm-gpu-memory-utilization", type=float,
                  default=default_of(RolloutConfig, "gpu_memory_utilization"),
                  help="Fraction of its GPU an engine may use; default: 0.9 less what an update stages on it "
                       "(the whole model in the engine's dtype)."),
            _flag("--verbose", action="store_true", default=default_of(RolloutConfig, "verbose"),
                  help="vLLM and Ray log at INFO (default: WARNING)."),
        ),
    ),
    (
        "rlplacement: optimizer",
        (
            _flag("--lr", type=float, default=default_of(OptimConfig, "lr")),
            _flag("--min-lr", type=float, default=default_of(OptimConfig, "min_lr")),
            _flag("--lr-decay-style", type=str, default=default_of(OptimConfig, "lr_decay_style"),
                  choices=LR_DECAY_STYLES),
            _flag("--lr-decay-iters", type=int, default=default_of(OptimConfig, "lr_decay_iters"),
                  help="Optimizer steps the decay lasts (needed unless --lr-decay-style constant)."),
            _flag("--lr-warmup-iters", type=int, default=default_of(OptimConfig, "lr_warmup_iters")),
            _flag("--clip-grad", type=float, default=default_of(OptimConfig, "max_grad_norm"),
                  help="Clip the global gradient norm to this (0 disables)."),
            _flag("--weight-decay", type=float, default=default_of(OptimConfig, "weight_decay")),
            _flag("--adam-beta1", type=float, default=default_of(OptimConfig, "betas")[0]),
            _flag("--adam-beta2", type=float, default=default_of(OptimConfig, "betas")[1]),
            _flag("--adam-eps", type=float, default=default_of(OptimConfig, "eps")),
        ),
    ),
)

ALL_FLAGS: tuple[_Flag, ...] = tuple(f for _, flags in FLAG_GROUPS for f in flags)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every rlplacement flag that ``parser`` does not already have; return ``parser``."""
    existing = set(parser._option_string_actions)  # argparse keeps no public view of this
    for title, flags in FLAG_GROUPS:
        missing = [f for f in flags if not existing.intersection(f.names)]
        if not missing:
            continue
        group = parser.add_argument_group(title)
        for f in missing:
            group.add_argument(*f.names, **f.kwargs)
    return parser


def add_flag(parser: argparse.ArgumentParser, name: str, **overrides: Any) -> None:
    """Add one flag of the table to a subcommand's parser: its names, type and default stay the
    table's, so a flag shared with a subcommand (``convert``'s TP/PP sizes) is defined once;
    ``overrides`` may only reword how it is shown (``help``, ``metavar``)."""
    if set(overrides) - {"help", "metavar"}:
        raise ValueError(f"{name}: only help and metavar may differ from the flag table")
    flag = next((f for f in ALL_FLAGS if name in f.names), None)
    if flag is None:
        raise KeyError(f"{name} is not an rlplacement flag")
    parser.add_argument(*flag.names, **{**flag.kwargs, **overrides})


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=prog))


def flag_default(dest: str) -> Any:
    """The default of our flag whose dest is ``dest``."""
    for f in ALL_FLAGS:
        if f.dest == dest:
            return f.kwargs.get("default")
    raise KeyError(dest)


def _get(args: argparse.Namespace, dest: str) -> Any:
    """Flags another parser owns may be missing from ``args``; fall back to our default."""
    return getattr(args, dest) if hasattr(args, dest) else flag_default(dest)


def _require_positive(args: argparse.Namespace, dests: Iterable[str]) -> None:
    for dest in dests:
        value = _get(args, dest)
        if value is not None and value <= 0:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} must be positive, got {value}: set {flag} to 1 or more.")


def _require_choice(args: argparse.Namespace, dests: Iterable[str]) -> None:
    """argparse checks ``choices`` only in parsers we built; a foreign parser or a framework's
    options dict reaches us unchecked."""
    for f in ALL_FLAGS:
        if f.dest in dests and "choices" in f.kwargs:
            value = _get(args, f.dest)
            if value is not None and value not in f.kwargs["choices"]:
                raise ConfigError(f"{f.names[0]} {value!r} is unknown: use one of {', '.join(f.kwargs['choices'])}.")


def placement_from_args(args: argparse.Namespace) -> PlacementConfig:
    _require_positive(args, ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus",
                             "rollout_num_gpus_per_engine", "num_gpus_per_node"))
    colocate = bool(_get(args, "colocate"))
    nodes, per_node = _get(args, "actor_num_nodes"), _get(args, "actor_num_gpus_per_node")
    gpus_per_node = _get(args, "num_gpus_per_node")
    rollout, per_engine = _get(args, "rollout_num_gpus"), _get(args, "rollout_num_gpus_per_engine")
    trainer = nodes * per_node
    if per_node > gpus_per_node:
        raise ConfigError(
            f"--actor-num-gpus-per-node {per_node} is larger than --num-gpus-per-node {gpus_per_node}: "
            f"lower --actor-num-gpus-per-node, or raise --num-gpus-per-node if your nodes have more GPUs.")
    if colocate:
        if rollout is not None and rollout != trainer:
            raise ConfigError(
                f"--colocate shares the trainer's {trainer} GPUs (--actor-num-nodes {nodes} x "
                f"--actor-num-gpus-per-node {per_node}) with rollout, but --rollout-num-gpus is "
                f"{rollout}: drop --rollout-num-gpus or set it to {trainer}, or drop --colocate for a "
                f"split layout.")
        rollout = trainer
    elif rollout is None:
        raise ConfigError(
            "A split layout (no --colocate) needs --rollout-num-gpus: set it to the GPUs for rollout "
            "engines, or pass --colocate to share the trainer's GPUs.")
    if rollout % per_engine:
        raise ConfigError(
            f"--rollout-num-gpus {rollout} is not a multiple of --rollout-num-gpus-per-engine "
            f"{per_engine}: use a multiple of {per_engine} (e.g. {max(per_engine, rollout - rollout % per_engine)}) "
            f"so every engine is whole.")
    if per_engine > gpus_per_node and per_engine % gpus_per_node:
        raise ConfigError(
            f"--rollout-num-gpus-per-engine {per_engine} is wider than a node (--num-gpus-per-node "
            f"{gpus_per_node}) but not a whole number of nodes: use {gpus_per_node} or a multiple of it.")
    if colocate and nodes > 1:
        raise ConfigError(
            f"--colocate with --actor-num-nodes {nodes}: colocated weights go by IPC from trainer rank 0, which "
            f"reaches only the engines on its own node: use --actor-num-nodes 1, or drop --colocate and use "
            f"--update-weight-transfer-mode broadcast_packed.")
    if colocate and per_engine > per_node and per_engine % per_node:
        raise ConfigError(
            f"Under --colocate an engine of --rollout-num-gpus-per-engine {per_engine} would straddle "
            f"trainer nodes of --actor-num-gpus-per-node {per_node}: use a divisor or multiple of {per_node}.")
    one_step_off = bool(_get(args, "one_step_off"))
    if colocate and one_step_off:
        raise ConfigError(
            "--one-step-off overlaps generation with training, but under --colocate both run on the same GPUs "
            "and cannot run at once: drop --one-step-off, or drop --colocate for a split layout.")
    offload_train, offload_rollout = _offload_from_args(args, colocate)
    keep_weights = bool(_get(args, "offload_rollout_keep_weights"))
    if keep_weights and (not colocate or offload_rollout is False):
        raise ConfigError(
            "--offload-rollout-keep-weights says how sleeping engines keep their weights, but "
            + ("without --colocate nothing sleeps: add --colocate or drop --offload-rollout-keep-weights."
               if not colocate else "--no-offload-rollout keeps the engines awake: drop one of the two flags."))
    return PlacementConfig(colocate=colocate, actor_num_nodes=nodes, actor_num_gpus_per_node=per_node,
                           rollout_num_gpus=rollout, rollout_num_gpus_per_engine=per_engine,
                           num_gpus_per_node=gpus_per_node, ray_address=_get(args, "ray_address"),
                           one_step_off=one_step_off, offload_train=offload_train, offload_rollout=offload_rollout,
                           offload_rollout_keep_weights=keep_weights)


def _offload_from_args(args: argparse.Namespace, colocate: bool) -> tuple[bool | None, bool | None]:
    """Hand-off flags as given (None: unset, decided from memory under --colocate); off in a split layout,
    where each side has its own GPUs and freeing one side's memory gives the other nothing; asking for
    it there is refused."""
    chosen = {dest: _get(args, dest) for dest in ("offload_train", "offload_rollout")}
    if not colocate:
        asked = [f"--{d.replace('_', '-')}" for d, v in chosen.items() if v]
        if asked:
            raise ConfigError(
                f"{' and '.join(asked)} {'hands' if len(asked) == 1 else 'hand'} GPU memory between the trainer and "
                f"the engines, which only share GPUs "
                f"under --colocate; in a split layout each side keeps its own: drop {' and '.join(asked)}, "
                f"or add --colocate.")
        return False, False
    return tuple(None if v is None else bool(v) for v in chosen.values())  # type: ignore[return-value]


def transfer_from_args(args: argparse.Namespace, *, this_host: bool = True) -> TransferConfig:
    _require_positive(args, ("update_weight_buffer_size", "p2p_transfer_timeout"))
    _require_choice(args, ("update_weight_transfer_mode", "update_weight_delta_encoding", "p2p_protocol"))
    mode = _get(args, "update_weight_transfer_mode")
    colocate = bool(_get(args, "colocate"))
    if colocate and mode in ("p2p", "disk-delta"):
        raise ConfigError(
            f"--update-weight-transfer-mode {mode} cannot be used with --colocate (the engines share the "
            f"trainer's GPUs and get weights by CUDA IPC): use broadcast or broadcast_packed, or drop --colocate.")
    protocol = _get(args, "p2p_protocol")
    if mode == "p2p" and this_host:
        from rlplacement.transfer.p2p import rdma_device_present

        if protocol is None:
            protocol = "rdma" if rdma_device_present() else "tcp"
        elif protocol == "rdma" and not rdma_device_present():
            raise ConfigError("--p2p-protocol rdma: this host has no RDMA device (/sys/class/infiniband is empty): "
                              "use --p2p-protocol tcp, or run where the RDMA NICs are.")
    disk_dir = _get(args, "update_weight_disk_dir")
    if mode == "disk-delta" and not disk_dir:
        raise ConfigError(
            "--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir: set it to a folder "
            "every engine can read.")
    return TransferConfig(mode=transfer_registry.COLOCATE_MODE if colocate else mode, requested_mode=mode,
                          buffer_size=_get(args, "update_weight_buffer_size"), disk_dir=disk_dir,
                          delta_encoding=_get(args, "update_weight_delta_encoding"),
                          p2p_protocol=protocol or default_of(TransferConfig, "p2p_protocol"),
                          p2p_timeout_s=float(_get(args, "p2p_transfer_timeout")),
                          check_equal=bool(_get(args, "check_weight_update_equal")))


def backend_from_args(args: argparse.Namespace, placement: PlacementConfig) -> BackendConfig:
    _require_positive(args, ("tensor_model_parallel_size", "pipeline_model_parallel_size"))
    _require_choice(args, ("train_backend",))
    name = _get(args, "train_backend")
    tp, pp = _get(args, "tensor_model_parallel_size"), _get(args, "pipeline_model_parallel_size")
    if placement.trainer_num_gpus % (tp * pp):
        raise ConfigError(
            f"The trainer's {placement.trainer_num_gpus} GPUs are not divisible by "
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}: change the sizes "
            f"or --actor-num-gpus-per-node.")
    if name != "megatron" and (tp, pp) != (1, 1):
        raise ConfigError(
            f"--tensor-model-parallel-size/--pipeline-model-parallel-size apply to --train-backend megatron, "
            f"not {name}: drop them or use --train-backend megatron.")
    sequence_parallel = bool(_get(args, "sequence_parallel"))
    if sequence_parallel and name != "megatron":
        raise ConfigError(f"--sequence-parallel is megatron's sequence parallelism over its TP ranks; the {name} "
                          f"backend has no tensor parallelism: drop the flag, or use --train-backend megatron.")
    if sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel splits the sequence over the tensor-parallel ranks, and "
                          "--tensor-model-parallel-size is 1: set it to 2 or more, or drop --sequence-parallel.")
    return BackendConfig(name=name, hf_checkpoint=_get(args, "hf_checkpoint"), load=_get(args, "load"),
                         tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         sequence_parallel=sequence_parallel)


def _set(args: argparse.Namespace, dest: str) -> Any:
    """A value the run cannot do without: a foreign parser may define the flag with no default (Megatron's
    ``--lr`` is None); say what to set instead of failing later."""
    value = _get(args, dest)
    if value is None:
        flag = "--" + dest.replace("_", "-")
        raise ConfigError(f"{flag} is unset (the parser that defines it gives it no default): set {flag}.")
    return value


def optim_from_args(args: argparse.Namespace) -> OptimConfig:
    _require_positive(args, ("lr", "adam_eps"))
    _require_choice(args, ("lr_decay_style",))
    clip = _get(args, "clip_grad")
    return OptimConfig(lr=float(_set(args, "lr")), min_lr=float(_set(args, "min_lr")),
                       lr_decay_style=_set(args, "lr_decay_style"), lr_decay_iters=_get(args, "lr_decay_iters"),
                       lr_warmup_iters=int(_get(args, "lr_warmup_iters") or 0),
                       weight_decay=float(_set(args, "weight_decay")),
                       betas=(float(_set(args, "adam_beta1")), float(_set(args, "adam_beta2"))),
                       eps=float(_set(args, "adam_eps")), max_grad_norm=None if clip is None else float(clip))


def train_from_args(args: argparse.Namespace, placement: PlacementConfig, backend: BackendConfig) -> TrainConfig:
    _require_positive(args, ("global_batch_size", "micro_batch_size", "max_tokens_per_gpu", "log_probs_chunk_size",
                             "rollout_temperature", "save_interval"))
    _require_choice(args, ("kl_loss_type",))
    dynamic, max_tokens = bool(_get(args, "use_dynamic_batch_size")), _get(args, "max_tokens_per_gpu")
    micro, global_batch = _get(args, "micro_batch_size"), _get(args, "global_batch_size")
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
    use_kl, kl_type = bool(_get(args, "use_kl_loss")), _get(args, "kl_loss_type")
    if kl_type is not None and not use_kl:
        raise ConfigError(f"--kl-loss-type {kl_type} chooses the KL estimator of --use-kl-loss: add --use-kl-loss, "
                          f"or drop --kl-loss-type.")
    coefs = {d: float(_get(args, d)) for d in ("kl_loss_coef", "entropy_coef", "eps_clip")}
    high = _get(args, "eps_clip_high")
    if any(v < 0 for v in coefs.values()) or (high is not None and high < 0):
        raise ConfigError(f"--kl-loss-coef, --entropy-coef, --eps-clip and --eps-clip-high must be 0 or more, got "
                          f"{coefs} and {high}.")
    if coefs["kl_loss_coef"] and not use_kl:
        raise ConfigError("--kl-loss-coef weighs the KL term of --use-kl-loss: add --use-kl-loss, or drop "
                          "--kl-loss-coef.")
    save, interval, bf16 = _get(args, "save"), _get(args, "save_interval"), _get(args, "bf16")
    recompute = _recompute_from_args(args, backend)
    distributed_optimizer = bool(_get(args, "use_distributed_optimizer"))
    if distributed_optimizer and backend.name != "megatron":
        raise ConfigError(f"--use-distributed-optimizer is megatron's DistributedOptimizer; the {backend.name} backend "
                          f"shards its optimizer state its own way: drop the flag, or use --train-backend megatron.")
    if interval is not None and not save:
        raise ConfigError("--save-interval says how often to write a checkpoint: set --save to a folder, or drop "
                          "--save-interval.")
    return TrainConfig(bf16=bf16, global_batch_size=global_batch, micro_batch_size=micro,
                       use_dynamic_batch_size=dynamic, max_tokens_per_gpu=max_tokens,
                       gradient_checkpointing=bool(_get(args, "gradient_checkpointing")),
                       use_distributed_optimizer=distributed_optimizer, **recompute,
                       log_probs_chunk_size=int(_get(args, "log_probs_chunk_size")), eps_clip=coefs["eps_clip"],
                       eps_clip_high=None if high is None else float(high), use_kl_loss=use_kl,
                       kl_loss_coef=coefs["kl_loss_coef"], kl_loss_type=kl_type or default_of(TrainConfig, "kl_loss_type"),
                       entropy_coef=coefs["entropy_coef"],
                       rollout_temperature=float(_get(args, "rollout_temperature")), save=save, save_interval=interval)


def _recompute_from_args(args: argparse.Namespace, backend) -> dict:
    """Activation recompute, each backend's own way: megatron's three flags, or FSDP's and torchtitan's
    --gradient-checkpointing; the other backend's flag is refused, naming this backend's."""
    granularity, method, layers = (_get(args, d) for d in ("recompute_granularity", "recompute_method",
                                                            "recompute_num_layers"))
    if backend.name == "megatron":
        if _get(args, "gradient_checkpointing"):
            raise ConfigError("--gradient-checkpointing is the fsdp and torchtitan backends' recompute; megatron "
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
    elif granularity is not None or method is not None or layers is not None:
        raise ConfigError(f"--recompute-granularity, --recompute-method and --recompute-num-layers are megatron's; "
                          f"the {backend.name} backend recomputes with --gradient-checkpointing: use that instead.")
    return {"recompute_granularity": granularity, "recompute_method": method, "recompute_num_layers": layers}


def rollout_from_args(args: argparse.Namespace) -> RolloutConfig:
    _require_positive(args, ("rollout_max_response_len", "n_samples_per_prompt", "vllm_max_model_len",
                             "vllm_gpu_memory_utilization", "rollout_top_p"))
    _require_choice(args, ("vllm_dtype",))
    top_p, top_k = float(_get(args, "rollout_top_p")), int(_get(args, "rollout_top_k"))
    if top_p > 1:
        raise ConfigError(f"--rollout-top-p {top_p} is a probability mass: use a value in (0, 1] (1 keeps every token).")
    if top_k == 0 or top_k < -1:
        raise ConfigError(f"--rollout-top-k {top_k}: use -1 (every token) or 1 or more.")
    utilization = _get(args, "vllm_gpu_memory_utilization")
    if utilization is not None and utilization > 1:
        raise ConfigError(f"--vllm-gpu-memory-utilization {utilization} is a fraction of the GPU: use a value "
                          f"in (0, 1].")
    response, context = int(_get(args, "rollout_max_response_len")), _get(args, "vllm_max_model_len")
    if context is not None and response >= context:
        raise ConfigError(f"--rollout-max-response-len {response} leaves no room for a prompt in the engines' "
                          f"context of --vllm-max-model-len {context}: lower --rollout-max-response-len or raise "
                          f"--vllm-max-model-len.")
    return RolloutConfig(top_p=top_p, top_k=top_k, max_response_len=response,
                         stop=tuple(_get(args, "rollout_stop") or ()),
                         stop_token_ids=tuple(int(t) for t in _get(args, "rollout_stop_token_ids") or ()),
                         n_samples_per_prompt=int(_get(args, "n_samples_per_prompt")),
                         seed=int(_get(args, "rollout_seed")), dtype=_get(args, "vllm_dtype"),
                         max_model_len=None if context is None else int(context),
                         enforce_eager=bool(_get(args, "vllm_enforce_eager")),
                         gpu_memory_utilization=None if utilization is None else float(utilization),
                         verbose=bool(_get(args, "verbose")))


def config_from_args(args: argparse.Namespace, *, this_host: bool = True) -> Config:
    """Validate parsed args and return frozen configs; raise ConfigError before any work starts.

    ``this_host=False`` (``rlplacement plan``, which describes a cluster from anywhere) skips the
    checks that read this machine: whether it has an RDMA device for ``--p2p-protocol``."""
    placement = placement_from_args(args)
    backend = backend_from_args(args, placement)
    return Config(placement=placement, transfer=transfer_from_args(args, this_host=this_host), backend=backend,
                  train=train_from_args(args, placement, backend), optim=optim_from_args(args),
                  rollout=rollout_from_args(args))


def require_available(config: Config) -> None:
    """Refuse, before any process starts, a config whose transfer mode this build does not register (a
    config built by hand, or before a mode was unregistered); flags parsed here were checked already."""
    mode, colocate = config.transfer.mode, config.placement.colocate
    if mode not in transfer_registry.MODES:
        raise ConfigError(
            f"weight transfer {mode!r} (from --update-weight-transfer-mode{' and --colocate' if colocate else ''}) "
            f"is not available in this build: use one of {', '.join(sorted(transfer_registry.MODES))}"
            f"{' in a split layout (drop --colocate)' if colocate else ''}.")
