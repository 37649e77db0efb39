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
from typing import TYPE_CHECKING, Any, Iterable

from rlplacement.errors import ConfigError

if TYPE_CHECKING:
    import torch

DEFAULT_BUFFER_SIZE = 512 * 1024 * 1024
DEFAULT_P2P_TRANSFER_TIMEOUT_S = 30.0


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
    offload_train: bool = False
    """Resolved: under ``colocate`` the trainer's weights and optimizer state go to host memory while the
    engines generate (on unless ``--no-offload-train``); always False in a split layout."""
    offload_rollout: bool = False
    """Resolved: under ``colocate`` the engines sleep (release weights and KV cache) while the trainer
    trains (on unless ``--no-offload-rollout``); always False in a split layout."""

    @property
    def trainer_num_gpus(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How weights reach the engines after every optimizer step."""

    mode: str
    """The transfer mode that runs: ``cuda_ipc`` under ``--colocate``, else ``requested_mode``."""
    requested_mode: str = "broadcast"
    """What ``--update-weight-transfer-mode`` asked for (under ``--colocate`` a broadcast mode, which the
    colocated IPC path replaces; a framework plug-in emitting a split layout uses it)."""
    buffer_size: int = DEFAULT_BUFFER_SIZE
    """Bucket size in bytes: tensors are packed into buckets of at most this (a larger tensor goes alone)."""
    disk_dir: str | None = None
    """disk-delta: the folder every engine reads versions from (required for that mode)."""
    delta_encoding: str = "xor"
    """disk-delta: ``xor`` (apply exactly once) or ``overwrite`` (idempotent)."""
    p2p_protocol: str = "tcp"
    """p2p: the Mooncake transport, resolved (``rdma`` where the host has an RDMA device, else ``tcp``)."""
    p2p_timeout_s: float = DEFAULT_P2P_TRANSFER_TIMEOUT_S
    """p2p: seconds one bucket's writes may take before the update fails naming the engine."""
    check_equal: bool = False
    """After every update, compare per-tensor checksums of trainer and engines; a mismatch fails the update."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendConfig:
    """Which trainer backend trains, from which weights, with which model parallelism."""

    name: str = "megatron"
    """A registered trainer backend (``rlplacement.backends.registry``): megatron, fsdp, torchtitan, ..."""
    hf_checkpoint: str | None = None
    """Hugging Face model folder: the architecture, the tokenizer, and the weights unless ``load`` is set."""
    load: str | None = None
    """Megatron ``torch_dist`` checkpoint folder (``rlplacement convert``'s output) to start from."""
    tensor_model_parallel_size: int = 1
    """Megatron tensor-parallel size; the trainer's GPUs are a multiple of TP x PP."""
    pipeline_model_parallel_size: int = 1
    """Megatron pipeline-parallel size."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The trainer's optimizer; validated when built, so a bad value fails before any process starts."""

    name: str = "adamw"
    """``adamw`` or ``sgd``."""
    lr: float = 1e-5
    """Learning rate (positive)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW) or L2 (SGD)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decay rates."""
    eps: float = 1e-8
    """AdamW's denominator term."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None or 0 disables clipping."""

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ConfigError(f"optimizer {self.name!r} is unknown: use adamw or sgd")
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}")

    def build(self, params: Iterable["torch.nn.Parameter"]) -> "torch.optim.Optimizer":
        import torch

        params = [p for p in params if p.requires_grad]
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Everything ``config_from_args`` validated: placement, weight transfer and trainer backend."""

    placement: PlacementConfig
    transfer: TransferConfig
    backend: BackendConfig
