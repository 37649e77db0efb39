"""Refuse a backend configuration before any process starts, from ``config.json`` alone.

Reads only JSON files (the HF ``config.json``, the converted folder's marker and metadata) and imports
only torch-free modules (the family tables, the backend registry, the checkpoint folder format): no
torch, megatron or torchtitan import, so the RL driver can call it in milliseconds (a test checks it
in a fresh process). The one exception is the default of ``cuda_available``, which asks torch. Every check
here mirrors a refusal a backend would otherwise raise minutes later inside a Ray actor; each
message names the flag or file and what to change.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from rlplacement.backends import train_checkpoint
from rlplacement.config import BackendConfig
from rlplacement.backends.megatron import checkpoint_layout as megatron_checkpoint
from rlplacement.backends.registry import known_backends
from rlplacement.errors import ConfigError
from rlplacement.hf_folder import check_safetensors
from rlplacement.families import family_for
from rlplacement.families.torchtitan_mapping import FAMILIES as TORCHTITAN_FAMILIES
from rlplacement.families.torchtitan_mapping import NEEDS_CUDA as TORCHTITAN_NEEDS_CUDA


MOE_BACKENDS = ("fsdp", "megatron")
"""The backends that train a mixture-of-experts model (the family's own blocks)."""


def preflight(cfg: BackendConfig, hf_dir: str | None = None, *, cuda_available: bool | None = None,
              for_training: bool = True) -> None:
    """Raise :class:`ConfigError` for everything ``make_backend(cfg)`` would refuse later.

    ``hf_dir`` is the HF folder the job also serves from (used when ``cfg.hf_checkpoint`` is unset).
    ``cuda_available``: whether the trainer ranks have CUDA (default: ``torch.cuda.is_available()``
    here, the right answer when the driver runs on a trainer node). ``for_training`` False: the checks
    ``rlplacement convert`` needs (a mixture-of-experts model converts for any backend and layout).
    """
    if cfg.name not in known_backends():
        raise ConfigError(f"--train-backend {cfg.name!r} is unknown: use one of {', '.join(known_backends())}")
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if cfg.name != "megatron":
        if cfg.load:
            train_checkpoint.latest(cfg.load)  # a finished --save folder of this backend, or refused by name
        if (tp, pp) != (1, 1):
            raise ConfigError(f"--tensor-model-parallel-size/--pipeline-model-parallel-size apply to "
                              f"--train-backend megatron, not {cfg.name}: drop them")

    hf_flag, hf = _hf_source(cfg, hf_dir)
    if cfg.name == "megatron" and cfg.load:
        hf_config, source = _check_load(cfg.load, tp)
    else:
        if hf is None:
            raise ConfigError(f"--train-backend {cfg.name} needs --hf-checkpoint (an HF model folder)"
                              + (" or --load (a folder from `rlplacement convert`)" if cfg.name == "megatron" else ""))
        hf_config, source = read_hf_config(hf, hf_flag)
        check_safetensors(hf, hf_flag)
    family = _family(hf_config, source)
    if family.moe and for_training and cfg.name not in MOE_BACKENDS:
        raise ConfigError(f"{source}: {family.name} is a mixture-of-experts model, which --train-backend {cfg.name} "
                          f"does not train yet: use --train-backend {' or '.join(MOE_BACKENDS)}")
    _check_moe_flags(cfg, hf_config, family, source, for_training)
    if cfg.lora.enabled and for_training:
        _check_lora(cfg.lora, hf_config, family, source)

    if cfg.name == "megatron":
        _check_megatron_sizes(hf_config, source, tp, pp)
        if family.moe:
            _check_expert_sizes(hf_config, source, tp, cfg.expert_model_parallel_size)
    elif cfg.name == "torchtitan":
        _check_torchtitan(hf_config, family, source, cuda_available)


def _check_lora(lora, hf_config: Any, family, source: str) -> None:
    """LoRA's rank against the adapted layers (an adapter of a rank above a layer's smaller side is no
    low-rank update); a mixture-of-experts model's adapters are not built."""
    from rlplacement.transfer.plan.tensors import ModelTensors

    if family.moe:
        raise ConfigError(f"--lora-rank with {source}'s mixture-of-experts {family.name}: LoRA adapters are built for "
                          f"dense models only so far: drop --lora-rank, or train the model in full")
    # each decoder linear layer's shape, from the plan's table of the model's tensors (layer 0: all alike)
    model = ModelTensors.from_hf_config(vars(hf_config), source, dtype="float32")
    sides = {t.name.rsplit(".", 2)[-2]: t.shape for t in model.tensors if t.layer == 0 and len(t.shape) == 2}
    for module in lora.target_modules:
        smaller = min(sides[module])
        if lora.rank > smaller:
            raise ConfigError(f"--lora-rank {lora.rank} is larger than {module}'s smaller side {smaller} in {source}: "
                              f"use --lora-rank {smaller} or less, or drop {module} with --exclude-modules")
    if lora.adapter_path:
        from rlplacement.lora_format import adapter_shapes, check_adapter_folder

        check_adapter_folder(lora.adapter_path, lora.rank, lora.alpha,
                             adapter_shapes(vars(hf_config), lora.rank, lora.target_modules, source))


def _hf_source(cfg: BackendConfig, hf_dir: str | None) -> tuple[str, str | None]:
    if cfg.hf_checkpoint:
        return "--hf-checkpoint", cfg.hf_checkpoint
    return "the HF folder", hf_dir


def read_hf_config(hf: str, flag: str = "--hf-checkpoint") -> tuple[Any, str]:
    """``config.json`` as an attribute namespace (what the family checks read), and its path for messages."""
    path = Path(hf)
    if not path.is_dir():
        hub_like = not path.is_absolute() and len(path.parts) == 2 and not str(hf).startswith(".")
        raise ConfigError(f"{flag} {hf}: no such folder; pass a local Hugging Face model folder"
                          + (" (models are read from disk, never fetched from a hub: download it first, e.g. "
                             f"`huggingface-cli download {hf} --local-dir /models/{path.name}`)" if hub_like else ""))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{flag} {hf}: no config.json there; pass a Hugging Face model folder")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config_file}: expected a JSON object")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        if key not in data:
            raise ConfigError(f"{config_file}: {key} is missing; is this a decoder language model?")
    return types.SimpleNamespace(**data), str(config_file)


def _family(hf_config: Any, source: str):
    try:
        return family_for(hf_config, source)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _check_load(load: str, tp: int) -> tuple[Any, str]:
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


def _check_megatron_sizes(hf_config: Any, source: str, tp: int, pp: int) -> None:
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


def _check_moe_flags(cfg: BackendConfig, hf_config: Any, family, source: str, for_training: bool) -> None:
    """Mixture-of-experts flags against ``config.json``: for a dense model none of those megatron itself
    leaves unset (``--num-experts``, ``--moe-ffn-hidden-size``, ``--moe-z-loss-coeff``, ``--moe-router-dtype``;
    the others have megatron defaults a Megatron parser carrying these flags sets, and, as in megatron, do
    nothing without experts); the declared architecture equal to the config's; expert parallelism and TP as
    megatron trains experts."""
    from rlplacement.config import MOE_FLAGS
    from rlplacement.families import num_experts

    unset_in_megatron = ("num_experts", "ffn_hidden_size", "z_loss_coeff", "router_dtype")
    given = [f for f in unset_in_megatron if getattr(cfg.moe, f) is not None]
    if not family.moe:
        if cfg.moe.rollout_routing_replay:
            raise ConfigError(f"--use-rollout-routing-replay replays a mixture-of-experts model's routing; {source} "
                              f"is the dense {family.name}: drop it")
        if given:
            raise ConfigError(f"{MOE_FLAGS[given[0]]} and the other MoE flags configure a "
                              f"mixture-of-experts model; {source} is the dense {family.name}: drop them")
        if cfg.expert_model_parallel_size != 1:
            raise ConfigError(f"--expert-model-parallel-size {cfg.expert_model_parallel_size}: expert parallelism "
                              f"needs a mixture-of-experts model, and {source} is the dense {family.name}: use "
                              f"--expert-model-parallel-size 1.")
        return
    declared = (("num_experts", "num_experts", num_experts(hf_config)),
                ("router_topk", "num_experts_per_tok", hf_config.num_experts_per_tok),
                ("ffn_hidden_size", "moe_intermediate_size", getattr(hf_config, "moe_intermediate_size", None)))
    for field, key, actual in declared:
        value, flag_name = getattr(cfg.moe, field), MOE_FLAGS[field]
        if value is not None and value != actual:
            raise ConfigError(f"{flag_name} {value} differs from {source}'s {key} {actual}: the architecture comes "
                              f"from config.json; drop {flag_name} or set it to {actual}")
    if not for_training or cfg.name != "megatron":
        return
    etp = cfg.expert_tensor_parallel_size
    if etp is not None and etp != cfg.tensor_model_parallel_size:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size "
                          f"{cfg.tensor_model_parallel_size}: experts run at the dense layers' tensor parallelism so "
                          f"far: drop --expert-tensor-parallel-size")
    if cfg.tensor_model_parallel_size > 1 and not cfg.sequence_parallel:
        raise ConfigError(f"--tensor-model-parallel-size {cfg.tensor_model_parallel_size} with a mixture-of-experts "
                          f"model: megatron trains MoE layers under tensor parallelism only with --sequence-parallel "
                          f"(which needs TransformerEngine): add it, or use --tensor-model-parallel-size 1")


def _check_expert_sizes(hf_config: Any, source: str, tp: int, ep: int) -> None:
    from rlplacement.families import num_experts

    experts, inter = num_experts(hf_config), getattr(hf_config, "moe_intermediate_size", 0)
    if experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide num_experts {experts} of {source}: "
                          f"use a divisor of {experts}")
    if inter % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide moe_intermediate_size {inter} of "
                          f"{source}: use a divisor of {inter}")


def _check_torchtitan(hf_config: Any, family, source: str, cuda_available: bool | None) -> None:
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
