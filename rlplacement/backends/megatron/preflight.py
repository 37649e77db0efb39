"""The megatron backend's checks before any process starts (its ``BackendSpec.load_config`` and
``BackendSpec.preflight``), from ``config.json`` and the converted folder's files alone: torch-free."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlplacement.backends import train_checkpoint
from rlplacement.backends.megatron import checkpoint_layout as megatron_checkpoint
from rlplacement.errors import ConfigError


def check_load(load: str, tp: int) -> tuple[Any, str]:
    """``--load`` as a finished conversion or ``--save`` folder whose vocabulary splits over ``tp``; the model's
    ``config.json`` it carries, and its path."""
    from rlplacement.backends.preflight import read_hf_config

    path = Path(load)
    if not path.is_dir():
        raise ConfigError(f"--load {load}: no such folder; convert first with "
                          f"`rlplacement convert --hf-checkpoint HF_DIR --save {load}`")
    if megatron_checkpoint.state(path) != "finished":
        raise ConfigError(f"--load {load} is neither a finished conversion nor a --save folder (no "
                          f"{megatron_checkpoint.MARKER}): rerun `rlplacement convert --hf-checkpoint HF_DIR --save "
                          f"{load}`")
    if megatron_checkpoint.is_training_checkpoint(path):  # a --save folder: its last iteration must be whole
        train_checkpoint.latest(load)
    meta_file = path / megatron_checkpoint.META
    if not meta_file.is_file():
        raise ConfigError(f"--load {load}: {megatron_checkpoint.META} missing, so it was not written by `rlplacement convert`; "
                          f"convert the HF folder with it")
    meta = json.loads(meta_file.read_text())
    padded = int(meta["padded_vocab_size"])
    if padded % tp:
        raise ConfigError(f"--load {load} has a padded vocabulary of {padded}, not divisible by "
                          f"--tensor-model-parallel-size {tp}: reconvert with --tensor-model-parallel-size {tp}")
    return read_hf_config(str(path / megatron_checkpoint.HF_CONFIG_DIR), f"--load {load}:")


def preflight(cfg, hf_config: Any, family, source: str, *, for_training: bool, cuda_available: bool | None) -> None:
    """The model's sizes against TP, PP and EP; for training a mixture-of-experts model, experts' TP as
    megatron trains them."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if family.moe and for_training:
        etp = cfg.expert_tensor_parallel_size
        if etp is not None and etp != tp:
            raise ConfigError(f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size "
                              f"{tp}: experts run at the dense layers' tensor parallelism so "
                              f"far: drop --expert-tensor-parallel-size")
        if tp > 1 and not cfg.sequence_parallel:
            raise ConfigError(f"--tensor-model-parallel-size {tp} with a mixture-of-experts "
                              f"model: megatron trains MoE layers under tensor parallelism only with --sequence-parallel "
                              f"(which needs TransformerEngine): add it, or use --tensor-model-parallel-size 1")
    _check_sizes(hf_config, source, tp, pp)
    if family.moe:
        _check_expert_sizes(hf_config, source, tp, cfg.expert_model_parallel_size)


def _check_sizes(hf_config: Any, source: str, tp: int, pp: int) -> None:
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", groups),
                    ("intermediate_size", getattr(hf_config, "intermediate_size", 0))):
        if n % tp:
            raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide {what} {n} of {source}: "
                              f"use a divisor of {n}")
    layers = hf_config.num_hidden_layers
    if layers % pp:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} does not divide num_hidden_layers {layers} "
                          f"of {source}: use a divisor of {layers}")


def _check_expert_sizes(hf_config: Any, source: str, tp: int, ep: int) -> None:
    from rlplacement.families import num_experts

    experts, inter = num_experts(hf_config), getattr(hf_config, "moe_intermediate_size", 0)
    if experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide num_experts {experts} of {source}: "
                          f"use a divisor of {experts}")
    if inter % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide moe_intermediate_size {inter} of "
                          f"{source}: use a divisor of {inter}")
