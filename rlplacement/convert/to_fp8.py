"""``rlplacement convert --to-fp8``: a bf16 (or fp32) Hugging Face folder -> a block-quantized FP8 folder the
engines serve while the trainer trains from the original.

What is quantized: every 2-D linear weight inside the decoder layers (attention, MLP, each expert) except the
router (``mlp.gate``); embeddings, norms and the output layer keep the folder's dtype, and every module left
out is listed in ``modules_to_not_convert`` so the engine builds it unquantized. The scheme written is the one
Miles, slime and Qwen's published FP8 folders use: ``quant_method`` fp8, ``fmt`` e4m3, ``activation_scheme``
dynamic, ``weight_block_size`` [rows, cols].

Published by rename: the folder is written under ``<save>.tmp`` and renamed to ``--save`` whole, so a reader
never sees a half-written folder; a rerun on a finished folder does nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from rlplacement.errors import ConfigError

LINEAR_IN_LAYER = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*\.weight$")
ROUTER = re.compile(r"\.mlp\.gate\.weight$")
MAX_SHARD_BYTES = 5 << 30


def quantized_by_conversion(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the conversion quantizes the tensor ``name`` of ``shape``."""
    return len(shape) == 2 and bool(LINEAR_IN_LAYER.match(name)) and not ROUTER.search(name)


def validate(hf: str, save: str, block: tuple[int, int]) -> dict:
    """The source's config.json; refused by name before anything is written: a missing folder, a folder already
    quantized, ``--save`` equal to the source, ``--save`` holding something that is not this conversion."""
    from rlplacement.atomic_files import check_writable
    from rlplacement.hf_folder import check_safetensors

    config_file = Path(hf) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--hf-checkpoint {hf}: no config.json there; pass a Hugging Face model folder")
    config = json.loads(config_file.read_text())
    if config.get("quantization_config"):
        raise ConfigError(f"--hf-checkpoint {hf} is quantized already (quantization_config in config.json): "
                          f"convert the bf16 folder it was made from")
    if any(b <= 0 for b in block):
        raise ConfigError(f"--fp8-block-size {block[0]} {block[1]}: both must be positive (rows, cols)")
    check_safetensors(hf)
    check_writable(save, "--save")
    if Path(save).exists() and Path(save).resolve() == Path(hf).resolve():
        raise ConfigError(f"--save {save} is --hf-checkpoint's folder: pass a new folder to --save")
    if Path(save).exists() and any(Path(save).iterdir()):
        raise ConfigError(f"--save {save} is not empty and not an FP8 conversion: pass a new or empty folder")
    return config


def finished(save: str, block: tuple[int, int]) -> bool:
    """``--save`` holds a finished conversion with ``block`` (a rerun's fast path); a finished one with another
    block is refused by name."""
    config_file = Path(save) / "config.json"
    if not config_file.is_file():
        return False
    qc = json.loads(config_file.read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return False
    if tuple(qc.get("weight_block_size") or ()) != tuple(block):
        raise ConfigError(f"--save {save} holds an FP8 conversion with block {qc.get('weight_block_size')}, not "
                          f"--fp8-block-size {block[0]} {block[1]}: convert into another folder")
    return True


def convert(hf: str, save: str, block: tuple[int, int], progress: bool = True) -> int:
    """Write the FP8 folder; returns the number of weights quantized."""
    import torch
    from tqdm import tqdm

    from rlplacement.atomic_files import fsync_dir
    from rlplacement.convert.hf_shards import ShardWriter
    from rlplacement.hf_folder import HFTensors, copy_side_files
    from rlplacement.quantization import fp8_block

    config = validate(hf, save, block)
    out = Path(save)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tensors = HFTensors(hf)
    writer = ShardWriter(tmp, MAX_SHARD_BYTES)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kept: set[str] = set()
    count = 0
    for name in tqdm(sorted(tensors.names), desc="convert --to-fp8", unit="tensor", disable=not progress):
        tensor = tensors.get(name)
        if quantized_by_conversion(name, tuple(tensor.shape)):
            q, scale_inv = fp8_block.quantize(tensor.to(device), block)
            writer.add(name, q.cpu())
            writer.add(name[: -len("weight")] + fp8_block.SCALE_SUFFIX, scale_inv.cpu())
            count += 1
        else:
            writer.add(name, tensor)
            kept.add(name.rsplit(".", 1)[0])
    writer.finish()
    copy_side_files(hf, tmp)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": sorted(kept)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if out.exists():
        out.rmdir()  # empty (validate)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    return count
