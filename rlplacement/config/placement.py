"""Where the trainer ranks and the rollout engines run: ``--colocate``, the GPU counts, the offload flags."""

from __future__ import annotations

import dataclasses


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
