"""The same layout and transfer mode in another framework's settings: ``rlplacement plan ...
--emit verl|miles``. Pure functions of a validated :class:`~rlplacement.config.Config`; no framework
is imported.

Each emitter returns the line to copy and notes (``# ...``) for whatever that framework's config
cannot express, saying which part and why, never a silently different layout.
"""

from __future__ import annotations

import shlex

from rlplacement.args import flag_default
from rlplacement.config import DEFAULT_BUCKET_BYTES, Config
from rlplacement.errors import ConfigError
from rlplacement.placement.layout import compute_layout
from rlplacement.transfer import registry
from rlplacement.transfer.spec import flag_dest

MIB = 1 << 20
VERL_CE = "actor_rollout_ref.rollout.checkpoint_engine"
# our transfer flags Miles defines itself (miles/utils/arguments.py); the others need
# parse_args(add_custom_arguments=rlplacement.args.add_arguments) in the driver script
MILES_OWN_FLAGS = {"update_weight_disk_dir", "update_weight_delta_encoding", "check_weight_update_equal",
                   "p2p_transfer_timeout"}


def _mode_options(config: Config, args) -> dict[str, object]:
    """Our transfer options that differ from their defaults, by flag dest: the equality check and the
    mode's own options (its spec's). An option whose flag is unset by default and resolved on each host
    (``--p2p-protocol``: rdma where a device is) only as the user set it, not as this host resolved it."""
    t = config.transfer
    values: dict[str, object] = {"check_weight_update_equal": t.check_equal}
    for field in registry.spec(t.mode).option_fields:
        dest = flag_dest(field)
        host_resolved = field.metadata["flag_default"] is None and field.default is not None
        values[dest] = getattr(args, dest, None) if host_resolved else getattr(t.options, field.name)
    return {k: v for k, v in values.items() if v is not None and v != flag_default(k)}


def rollout_nodes(config: Config) -> tuple[int, int] | None:
    """(nodes, GPUs per node) of the rollout GPUs in our layout, or None when their count differs
    between nodes: verl's rollout pools are always ``[n_gpus_per_node] * nnodes``."""
    per_node: dict[int, int] = {}
    for node, _ in compute_layout(config.placement).rollout_gpus:
        per_node[node] = per_node.get(node, 0) + 1
    counts = set(per_node.values())
    return (len(per_node), counts.pop()) if len(counts) == 1 else None


def emit_verl(config: Config, args=None) -> list[str]:
    p, t = config.placement, config.transfer
    overrides = [f"trainer.nnodes={p.actor_num_nodes}", f"trainer.n_gpus_per_node={p.actor_num_gpus_per_node}",
                 f"actor_rollout_ref.rollout.tensor_model_parallel_size={p.rollout_num_gpus_per_engine}"]
    notes = []
    if p.colocate:
        overrides.insert(0, "trainer.v1.trainer_mode=sync")
        notes.append("# --colocate: verl's colocated trainers move weights in-process with its own 'naive' backend "
                     "(trainer.v1 forces it), so no rlplacement transfer mode runs there")
        return [" ".join(overrides), *notes]
    split = rollout_nodes(config)
    if split is None:
        raise ConfigError(f"--rollout-num-gpus {p.rollout_num_gpus} lands on nodes with different rollout GPU counts "
                          f"(see `rlplacement plan`), which verl's actor_rollout_ref.rollout.nnodes x n_gpus_per_node "
                          f"cannot write: choose a count that fills whole nodes of --num-gpus-per-node "
                          f"{p.num_gpus_per_node}, or the same count on each node.")
    if t.bucket_bytes % MIB:
        raise ConfigError(f"--update-weight-buffer-size {t.bucket_bytes} is not a whole number of MiB: verl takes "
                          f"{VERL_CE}.update_weights_bucket_megabytes; use a multiple of {MIB}.")
    backend = registry.spec(t.mode).verl_backend
    if backend is None:
        raise ConfigError(f"--update-weight-transfer-mode {t.mode} has no verl checkpoint-engine backend: use one of "
                          f"{', '.join(n for n, s in registry.specs().items() if s.verl_backend)}.")
    overrides[:0] = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false"]
    overrides += [f"actor_rollout_ref.rollout.nnodes={split[0]}", f"actor_rollout_ref.rollout.n_gpus_per_node={split[1]}",
                  f"{VERL_CE}.backend={backend}", f"{VERL_CE}.custom_backend_module=rlplacement.integrations.verl",
                  f"{VERL_CE}.update_weights_bucket_megabytes={t.bucket_bytes // MIB}"]
    overrides += [f"+{VERL_CE}.engine_kwargs.{backend}.{k}={_hydra(v)}" for k, v in _mode_options(config, args).items()]
    notes.append("# verl places the trainer pool and each rollout replica's pool by Ray (STRICT_PACK per node, no "
                 "node choice): they may share or skip nodes differently from `rlplacement plan`")
    notes.append("# separate_async trains off-policy by trainer.v1.separate_async.parameter_sync_step (default 4); "
                 "it needs data.train_batch_size == parameter_sync_step x actor_rollout_ref.actor.ppo_mini_batch_size")
    return [" ".join(shlex.quote(o) for o in overrides), *notes]


def emit_miles(config: Config, args=None) -> list[str]:
    p, t = config.placement, config.transfer
    flags = [f"--actor-num-nodes {p.actor_num_nodes}", f"--actor-num-gpus-per-node {p.actor_num_gpus_per_node}",
             f"--rollout-num-gpus {p.rollout_num_gpus}", f"--rollout-num-gpus-per-engine {p.rollout_num_gpus_per_engine}",
             f"--num-gpus-per-node {p.num_gpus_per_node}"]
    notes = []
    if p.colocate:
        flags.append("--colocate")
        notes.append("# --colocate: Miles moves colocated weights with its own CUDA IPC path; no external protocol runs")
        return [" ".join(flags), *notes]
    factory = registry.spec(t.mode).miles_factory
    if factory is None:
        raise ConfigError(f"--update-weight-transfer-mode {t.mode} has no Miles protocol factory: use one of "
                          f"{', '.join(n for n, s in registry.specs().items() if s.miles_factory)}.")
    flags += ["--update-weight-transfer-mode external",
              f"--custom-weight-transfer-protocol-path rlplacement.integrations.miles.{factory}"]
    if t.bucket_bytes != DEFAULT_BUCKET_BYTES:
        flags.append(f"--update-weight-buffer-size {t.bucket_bytes}")
    extra = []
    for key, value in _mode_options(config, args).items():
        flag = "--" + key.replace("_", "-")
        text = flag if value is True else f"{flag} {shlex.quote(str(value))}"
        (flags if key in MILES_OWN_FLAGS else extra).append(text)
    if extra:
        notes.append(f"# {' '.join(extra)}: not Miles flags; pass them too, with "
                     f"parse_args(add_custom_arguments=rlplacement.args.add_arguments) in your driver script")
        flags += extra
    return [" ".join(flags), *notes]


def _hydra(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


EMITTERS = {"verl": emit_verl, "miles": emit_miles}
