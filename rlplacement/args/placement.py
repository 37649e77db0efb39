"""Placement flags (``--colocate``, the GPU counts, the hand-off) and their validation."""

from __future__ import annotations

import argparse

from rlplacement.args.common import flag, get, require_positive
from rlplacement.config import PlacementConfig, default_of
from rlplacement.errors import ConfigError

TITLE = "rlplacement: placement"
FLAGS = (
    flag("--colocate", action="store_true", default=default_of(PlacementConfig, "colocate"),
          help="Trainer and rollout engines time-share the same GPUs."),
    flag("--actor-num-nodes", type=int, default=default_of(PlacementConfig, "actor_num_nodes"), help="Nodes for the trainer."),
    flag("--actor-num-gpus-per-node", type=int, default=default_of(PlacementConfig, "actor_num_gpus_per_node"),
          help="Trainer GPUs on each trainer node."),
    flag("--rollout-num-gpus", type=int, default=None,
          help="GPUs for rollout engines (required in a split layout; under --colocate "
               "it defaults to, and must equal, the trainer's GPU count)."),
    flag("--rollout-num-gpus-per-engine", type=int, default=default_of(PlacementConfig, "rollout_num_gpus_per_engine"),
          help="GPUs per rollout engine (its tensor-parallel size)."),
    flag("--num-gpus-per-node", type=int, default=default_of(PlacementConfig, "num_gpus_per_node"), help="GPUs on each node of the cluster."),
    flag("--ray-address", type=str, default=default_of(PlacementConfig, "ray_address"),
          help="Address of an existing Ray cluster (else RAY_ADDRESS, else a local one)."),
    flag("--offload-train", action=argparse.BooleanOptionalAction, default=None,
          help="--colocate: move the trainer's weights and optimizer state to host memory while the "
               "engines generate; --no-offload-train keeps them resident; unset, they move only when "
               "the engines' KV cache would not fit beside them."),
    flag("--offload-rollout", action=argparse.BooleanOptionalAction, default=None,
          help="--colocate: the engines release their weights and KV cache (vLLM sleep mode) while the "
               "trainer trains; --no-offload-rollout keeps them resident; unset, they sleep unless the "
               "trainer's measured peak fits beside them."),
    flag("--offload-rollout-keep-weights", action="store_true",
          default=default_of(PlacementConfig, "offload_rollout_keep_weights"),
          help="--colocate: sleeping engines copy their weights to host memory and back (vLLM level 1) "
               "instead of discarding them (level 2; the update refills them from the trainer), so a "
               "failed update leaves the previous version served instead of refusing to generate."),
    flag("--one-step-off", action="store_true", default=default_of(PlacementConfig, "one_step_off"),
          help="Split layouts: generate step k+1 while the trainer trains on step k (samples at most "
               "one weight version stale; the loss corrects with the engine's log-probs)."),
)


def placement_from_args(args: argparse.Namespace) -> PlacementConfig:
    require_positive(args, ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus",
                             "rollout_num_gpus_per_engine", "num_gpus_per_node"))
    colocate = bool(get(args, "colocate"))
    nodes, per_node = get(args, "actor_num_nodes"), get(args, "actor_num_gpus_per_node")
    gpus_per_node = get(args, "num_gpus_per_node")
    rollout, per_engine = get(args, "rollout_num_gpus"), get(args, "rollout_num_gpus_per_engine")
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
    if colocate and nodes > 1 and (per_engine > per_node or per_node % per_engine):
        raise ConfigError(
            f"--colocate with --actor-num-nodes {nodes}: an engine of --rollout-num-gpus-per-engine {per_engine} "
            f"must lie inside one node of --actor-num-gpus-per-node {per_node} (each engine worker reads the "
            f"trainer rank on its own GPU by IPC, which does not cross nodes): use a divisor of {per_node}, or "
            f"--actor-num-nodes 1.")
    if colocate and per_engine > per_node and per_engine % per_node:
        raise ConfigError(
            f"Under --colocate an engine of --rollout-num-gpus-per-engine {per_engine} would straddle "
            f"trainer nodes of --actor-num-gpus-per-node {per_node}: use a divisor or multiple of {per_node}.")
    one_step_off = bool(get(args, "one_step_off"))
    if colocate and one_step_off:
        raise ConfigError(
            "--one-step-off overlaps generation with training, but under --colocate both run on the same GPUs "
            "and cannot run at once: drop --one-step-off, or drop --colocate for a split layout.")
    offload_train, offload_rollout = _offload_from_args(args, colocate)
    keep_weights = bool(get(args, "offload_rollout_keep_weights"))
    if keep_weights and (not colocate or offload_rollout is False):
        raise ConfigError(
            "--offload-rollout-keep-weights says how sleeping engines keep their weights, but "
            + ("without --colocate nothing sleeps: add --colocate or drop --offload-rollout-keep-weights."
               if not colocate else "--no-offload-rollout keeps the engines awake: drop one of the two flags."))
    return PlacementConfig(colocate=colocate, actor_num_nodes=nodes, actor_num_gpus_per_node=per_node,
                           rollout_num_gpus=rollout, rollout_num_gpus_per_engine=per_engine,
                           num_gpus_per_node=gpus_per_node, ray_address=get(args, "ray_address"),
                           one_step_off=one_step_off, offload_train=offload_train, offload_rollout=offload_rollout,
                           offload_rollout_keep_weights=keep_weights)


def _offload_from_args(args: argparse.Namespace, colocate: bool) -> tuple[bool | None, bool | None]:
    """Hand-off flags as given (None: unset, decided from memory under --colocate); off in a split layout,
    where each side has its own GPUs and freeing one side's memory gives the other nothing; asking for
    it there is refused."""
    chosen = {dest: get(args, dest) for dest in ("offload_train", "offload_rollout")}
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


def require_both_resident(placement: PlacementConfig, what: str) -> None:
    """Under ``--colocate``, refuse a mode that runs training and generation at once unless both offload flags are
    off for the whole run: ``what`` says the mode and why, the refusal names the flags still to add."""
    left = [f"--no-{d.replace('_', '-')}" for d in ("offload_train", "offload_rollout")
            if getattr(placement, d) is not False]
    if placement.colocate and left:
        raise ConfigError(f"{what}: add {' '.join(left)} (both resident for the whole run), or drop --colocate for a "
                          f"split layout.")
