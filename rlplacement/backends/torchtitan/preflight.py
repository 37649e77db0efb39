"""The torchtitan backend's checks before any process starts (its ``BackendSpec.preflight``), from
``config.json`` alone: torch-free but for asking torch whether CUDA is there when the caller did not say."""

from __future__ import annotations

from typing import Any

from rlplacement.errors import ConfigError
from rlplacement.families.torchtitan_mapping import FAMILIES as TORCHTITAN_FAMILIES
from rlplacement.families.torchtitan_mapping import NEEDS_CUDA as TORCHTITAN_NEEDS_CUDA


def preflight(cfg, hf_config: Any, family, source: str, *, for_training: bool, cuda_available: bool | None) -> None:
    """A family torchtitan ships, without q/k/v bias, on ranks with CUDA."""
    if family.name not in TORCHTITAN_FAMILIES:
        raise ConfigError(f"{source}: --train-backend torchtitan has no {family.name} model (torchtitan 0.3.0 "
                          f"ships {', '.join(TORCHTITAN_FAMILIES)}): use --train-backend fsdp or megatron")
    if family.uses_qkv_bias(hf_config):
        raise ConfigError(f"{source}: attention_bias=true is not supported by --train-backend torchtitan "
                          f"(its attention has no q/k/v bias): use --train-backend fsdp or megatron")
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise ConfigError(f"--train-backend torchtitan needs CUDA on the trainer ranks: {TORCHTITAN_NEEDS_CUDA}. "
                          f"Use --train-backend fsdp or megatron on this machine")
