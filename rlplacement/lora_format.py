"""The adapter tensors of a LoRA update as trainer and engines both name them: PEFT's saved names
(``base_model.model.<HF module>.lora_A.weight`` ``[rank, in]`` and ``.lora_B.weight`` ``[out, rank]``), the
names vLLM's LoRA loader parses (``vllm.lora.utils.parse_fine_tuned_lora_name``) and a PEFT adapter
folder holds. Pure: the shapes come from ``config.json`` alone (the plan's table of the model's tensors).
"""

from __future__ import annotations

from typing import Any

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the HF module name of every saved adapter tensor."""


def adapter_name(module: str, matrix: str) -> str:
    """The saved name of ``matrix`` (``A`` or ``B``) of the adapter on the HF module ``module``
    (``model.layers.0.self_attn.q_proj``)."""
    return f"{PEFT_PREFIX}{module}.lora_{matrix}.weight"


def adapter_shapes(hf_config: dict[str, Any], rank: int, target_modules: tuple[str, ...] | list[str],
                   source: str = "config.json") -> dict[str, tuple[int, int]]:
    """Saved name -> shape of every adapter tensor of a model with rank-``rank`` adapters on the decoder
    linear layers named in ``target_modules`` (HF names: ``q_proj``, ..., ``down_proj``), in layer order."""
    from rlplacement.transfer.plan.tensors import ModelTensors

    model = ModelTensors.from_hf_config(dict(hf_config), source, dtype="float32")
    shapes: dict[str, tuple[int, int]] = {}
    for tensor in model.tensors:
        module, _, leaf = tensor.name.rpartition(".")
        if tensor.layer is None or leaf != "weight" or len(tensor.shape) != 2:
            continue
        if module.rsplit(".", 1)[-1] in target_modules:
            out_features, in_features = tensor.shape
            shapes[adapter_name(module, "A")] = (rank, in_features)
            shapes[adapter_name(module, "B")] = (out_features, rank)
    return shapes


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def check_adapter_folder(path: str, rank: int, alpha: float, expected: dict[str, tuple[int, int]]) -> None:
    """A PEFT adapter folder (``--lora-adapter-path``) against the flags and the model: its rank and alpha are
    ``--lora-rank``/``--lora-alpha``, and its tensors are exactly ``expected`` (:func:`adapter_shapes`) by name and
    shape; anything else is refused naming the flag, the file and what differs. Reads the config and the
    safetensors header only."""
    import json
    from pathlib import Path

    from rlplacement.errors import ConfigError
    from rlplacement.hf_folder import safetensors_shapes

    folder = Path(path)
    config_file, weights = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for f in (config_file, weights):
        if not f.is_file():
            raise ConfigError(f"--lora-adapter-path {path}: no {f.name} there; pass a PEFT adapter folder (as "
                              f"`rlplacement export-hf` or peft's save_pretrained writes)")
    config = json.loads(config_file.read_text())
    if config.get("r") != rank:
        raise ConfigError(f"--lora-adapter-path {path}: {ADAPTER_CONFIG} says r = {config.get('r')}, not --lora-rank "
                          f"{rank}; use --lora-rank {config.get('r')}")
    if float(config.get("lora_alpha", -1)) != float(alpha):
        raise ConfigError(f"--lora-adapter-path {path}: {ADAPTER_CONFIG} says lora_alpha = {config.get('lora_alpha')}, "
                          f"not --lora-alpha {alpha}; use --lora-alpha {config.get('lora_alpha')}")
    held = safetensors_shapes(folder)  # the safetensors headers: a PEFT folder's one weights file
    missing, extra = sorted(set(expected) - set(held)), sorted(set(held) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which --target-modules does not adapt"
        raise ConfigError(f"--lora-adapter-path {path}: {ADAPTER_WEIGHTS} {what} ({len(missing)} missing, {len(extra)} "
                          f"extra): pass the --target-modules it was trained with")
    for name, shape in expected.items():
        if held[name] != tuple(shape):
            raise ConfigError(f"--lora-adapter-path {path}: {name} is {list(held[name])}, not {list(shape)} as this "
                              f"model's layers need: it was trained on another model")


def read_adapter_folder(path: str) -> dict:
    """Saved name -> tensor of a PEFT adapter folder's weights (checked first: :func:`check_adapter_folder`)."""
    from pathlib import Path

    from safetensors.torch import load_file

    return load_file(str(Path(path) / ADAPTER_WEIGHTS))
