"""``rlplacement export-hf`` of a LoRA run's ``--save`` folder: the adapters as a PEFT adapter folder
(``adapter_model.safetensors`` under PEFT's saved names, :mod:`rlplacement.lora_format`, and
``adapter_config.json``), which peft's ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load; with
``--merge-lora``, the base of ``--hf-config`` with ``W + alpha / rank * B A`` merged in, as an HF folder.

Read from the checkpoint's files alone (``torch.distributed.checkpoint`` without a process group): the
adapters are small and whole in its metadata. Written into ``OUT.tmp`` and renamed, so ``OUT`` is never a
half-written folder.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

from rlplacement.errors import ConfigError
from rlplacement.lora_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS

def lora_spec(folder: Path) -> dict | None:
    """The adapters' settings a LoRA run's checkpoint recorded (``rank``, ``alpha``, ``dropout``,
    ``target_modules``); None for a checkpoint of full weights."""
    from rlplacement.backends import train_checkpoint

    return train_checkpoint.read_state(folder).get("lora")


def read_adapters(folder: Path) -> dict[str, "torch.Tensor"]:
    """PEFT name -> tensor of every adapter in the checkpoint ``folder`` (an ``iter_N`` folder)."""
    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata().state_dict_metadata
    names = {k: _peft_name(k) for k in metadata}
    keys = [k for k, name in names.items() if name is not None]
    if not keys:
        raise ConfigError(f"--load {folder}: the checkpoint holds no LoRA adapters")
    state = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():  # no process group is the point here, not a mistake to warn of
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {names[k]: t for k, t in state.items()}


def _peft_name(key: str) -> str | None:
    """The PEFT name of a checkpoint key that holds an adapter tensor, else None: fsdp's ``model.`` + the FQN
    under the trained root (``lm.`` + the HF model's names), or megatron's
    (:func:`~rlplacement.backends.megatron.lora.peft_name_of`), whose ``torch_dist`` format is
    ``torch.distributed.checkpoint``'s too."""
    from rlplacement.backends.lora import peft_name
    from rlplacement.backends.megatron.lora import peft_name_of

    if key.startswith("model.") and (".lora_A." in key or ".lora_B." in key):
        return peft_name(key.removeprefix("model.").split(".", 1)[1])
    return peft_name_of(key)


def export(folder: Path, out: str | os.PathLike, hf_config: str | None, merge: bool) -> int:
    """Write ``folder``'s adapters to ``out`` (a PEFT folder, or merged into ``hf_config``'s base where
    ``merge``); returns the tensors written."""
    from safetensors.torch import save_file

    from rlplacement.atomic_files import fsync_dir

    spec = lora_spec(folder)
    adapters = read_adapters(folder)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if merge:
        tensors = _merged(adapters, spec, hf_config)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        from rlplacement.hf_folder import copy_side_files

        copy_side_files(hf_config, tmp)
    else:
        tensors = {name: t.contiguous() for name, t in adapters.items()}
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec["rank"], "lora_alpha": spec["alpha"],
                  "lora_dropout": spec["dropout"], "target_modules": list(spec["target_modules"]), "bias": "none",
                  "base_model_name_or_path": str(hf_config) if hf_config else None}
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return len(tensors)


def _merged(adapters: dict, spec: dict, hf_config: str | None) -> dict:
    """The base of ``hf_config`` (its safetensors) with every adapter merged in, in the base's dtype."""
    from safetensors.torch import load_file

    from rlplacement.backends.lora import merged
    from rlplacement.lora_format import PEFT_PREFIX

    if hf_config is None:
        raise ConfigError("export-hf --merge-lora: pass --hf-config with the base model's folder (its weights are "
                          "merged with the adapters)")
    files = sorted(Path(hf_config).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--hf-config {hf_config}: no safetensors there, so no base to merge the adapters into")
    base = {}
    for file in files:
        base.update(load_file(str(file)))
    scaling = spec["alpha"] / spec["rank"]
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        weight = name.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight")
        if weight not in base:
            raise ConfigError(f"--hf-config {hf_config}: no {weight} to merge the adapter {name} into: is it the "
                              f"run's base model?")
        base[weight] = merged(base[weight], a, adapters[name.replace(".lora_A.", ".lora_B.")], scaling)
    return base
