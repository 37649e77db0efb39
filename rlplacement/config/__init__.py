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
from typing import Any

from rlplacement.config.backend import (LORA_MEGATRON_NAMES, LORA_MODULES, MOE_DISPATCHERS, MOE_FLAGS,
                                        MOE_ROUTER_DTYPES, BackendConfig, LoRAConfig, MoEConfig)
from rlplacement.config.fault_tolerance import FT_COMPONENTS, FaultToleranceConfig
from rlplacement.config.placement import PlacementConfig
from rlplacement.config.rollout import ENGINE_DTYPES, PAUSE_GENERATION_MODES, AsyncRolloutConfig, RolloutConfig
from rlplacement.config.tracking import WANDB_MODES, TrackingConfig
from rlplacement.config.train import KL_LOSS_TYPES, LR_DECAY_STYLES, OptimConfig, TrainConfig
from rlplacement.config.transfer import DEFAULT_BUCKET_BYTES, TransferConfig

__all__ = ["DEFAULT_BUCKET_BYTES", "ENGINE_DTYPES", "FT_COMPONENTS", "KL_LOSS_TYPES", "LORA_MEGATRON_NAMES",
           "LORA_MODULES", "LR_DECAY_STYLES", "MOE_DISPATCHERS", "MOE_FLAGS", "MOE_ROUTER_DTYPES",
           "PAUSE_GENERATION_MODES", "WANDB_MODES", "AsyncRolloutConfig", "BackendConfig", "Config",
           "FaultToleranceConfig", "LoRAConfig", "MoEConfig", "OptimConfig", "PlacementConfig", "RolloutConfig",
           "TrackingConfig", "TrainConfig", "TransferConfig", "default_of"]


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (KeyError if it has none)."""
    field = cls.__dataclass_fields__[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise KeyError(f"{cls.__name__}.{name} has no default")


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
