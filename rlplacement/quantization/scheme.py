"""Which tensors of a model folder are block-quantized FP8, read from its ``config.json`` and its safetensors
headers, with every scheme the library cannot serve refused by name before anything starts.

The folder's own tensors decide what an update quantizes: a weight is quantized exactly where the folder holds
it as ``float8_e4m3fn`` beside a ``<module>.weight_scale_inv``; everything else (embeddings, norms, the output
layer, routers, whatever ``ignored_layers`` / ``modules_to_not_convert`` leave out) goes in the model's dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from rlplacement.errors import ConfigError
from rlplacement.quantization.fp8_block import SCALE_SUFFIX


@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """A folder's block FP8 scheme: ``block`` [rows, cols] and the names of its quantized weights."""

    block: tuple[int, int]
    quantized: frozenset[str]

    def scale_name(self, weight_name: str) -> str:
        return weight_name[: -len("weight")] + SCALE_SUFFIX


def read_config_scheme(config: dict, where: str) -> tuple[int, int] | None:
    """The block of ``config``'s ``quantization_config`` (None when it has none); refused by name where the
    library cannot serve it: another method than fp8, another format than e4m3, static activation scales, no
    block size (per-tensor scales), a block that is not two positive integers."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not served; the engines serve "
                          f"block FP8 (quant_method \"fp8\") or the model's own dtype: point it at a bf16 folder or "
                          f"one made by `rlplacement convert --to-fp8`")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}: quantization_config.fmt {fmt!r}: only e4m3 is served (the trainer quantizes "
                          f"every update to float8_e4m3fn); convert the bf16 folder with `rlplacement convert --to-fp8`")
    block = qc.get("weight_block_size")
    if block is None:
        raise ConfigError(f"{where}: quantization_config has no weight_block_size (per-tensor FP8 scales): only block "
                          f"scales are served; convert the bf16 folder with `rlplacement convert --to-fp8`")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: quantization_config.activation_scheme {qc.get('activation_scheme')!r} with block "
                          f"scales: only dynamic activation scales go with block weights; set \"dynamic\"")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size {block!r} must be two positive integers "
                          f"(rows, cols), e.g. [128, 128]")
    return (block[0], block[1])


def read_scheme(hf_dir: str | os.PathLike) -> Fp8Scheme | None:
    """The FP8 scheme of the folder ``hf_dir`` (None for a folder in the model's own dtype)."""
    from rlplacement.hf_folder import safetensors_dtypes

    where = str(hf_dir)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    block = read_config_scheme(config, where)
    if block is None:
        return None
    dtypes = safetensors_dtypes(hf_dir) or {}
    quantized = {name for name, dtype in dtypes.items()
                 if dtype == "F8_E4M3" and name.endswith(".weight")
                 and name[: -len("weight")] + SCALE_SUFFIX in dtypes}
    unscaled = sorted(name for name, dtype in dtypes.items() if dtype == "F8_E4M3" and name not in quantized)
    if unscaled:
        raise ConfigError(f"{where}: {len(unscaled)} float8 tensors have no {SCALE_SUFFIX} beside them (first "
                          f"{unscaled[0]}): the folder is not block FP8; make it with `rlplacement convert --to-fp8`")
    if not quantized:
        raise ConfigError(f"{where}: config.json declares FP8 but no tensor is stored as float8_e4m3fn: make the "
                          f"folder with `rlplacement convert --to-fp8`")
    return Fp8Scheme(block, frozenset(quantized))
