"""rlplacement: placement, weight transfer and trainer backends for RL post-training loops.

What a loop uses, from the package root: flags (:func:`add_arguments`, :func:`config_from_args`), the
configs they validate into, :class:`RLJob` and what goes in and out of it, and every error the library
raises on purpose. Heavy optional parts (ray, vllm, megatron, mooncake) are imported only where used;
``Batch``, ``TrainStepReport``, ``routed_experts_of`` and ``token_versions_of`` (torch) load on first access.
"""

from rlplacement.args import add_arguments, config_from_args
from rlplacement.config import BackendConfig, Config, OptimConfig, PlacementConfig, RolloutConfig, TransferConfig
from rlplacement.errors import (ConfigError, ContextLengthError, GpuMemoryError, PeerError, TransferError,
                                WeightMismatchError, WeightUpdateError)
from rlplacement.job import PendingRollout, RLJob, RolloutSample
from rlplacement.transfer.base import EngineUpdateReport, UpdateReport, UpdateResult

_TORCH_TYPES = ("Batch", "TrainStepReport", "routed_experts_of", "token_versions_of")

__all__ = ["BackendConfig", "Config", "ConfigError", "ContextLengthError", "EngineUpdateReport", "GpuMemoryError",
           "OptimConfig", "PeerError", "PendingRollout", "PlacementConfig", "RLJob", "RolloutConfig", "RolloutSample",
           "TransferConfig",
           "TransferError", "UpdateReport", "UpdateResult", "WeightMismatchError", "WeightUpdateError",
           "add_arguments", "config_from_args", *_TORCH_TYPES]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _TORCH_TYPES:
        from rlplacement import train_io

        return getattr(train_io, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
