"""The one reader of a Hugging Face model folder's weights, and the copy of its other files.

A folder holds either ``model.safetensors`` or shards listed by ``model.safetensors.index.json``.
:class:`HFTensors` opens each shard once, on first use, and reads one tensor at a time, so a loader
holds a single tensor beside the model it fills, never the whole checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlplacement.errors import ConfigError

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_index(hf_dir: str | os.PathLike) -> dict[str, str]:
    """HF tensor name -> safetensors file name, for single-file and sharded folders."""
    path = Path(hf_dir)
    index_file = path / INDEX_NAME
    if index_file.is_file():
        return dict(json.loads(index_file.read_text())["weight_map"])
    single = path / SINGLE_NAME
    if not single.is_file():
        raise FileNotFoundError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: SINGLE_NAME for k in f.keys()}


class HFTensors:
    """Read tensors of an HF folder by name; ``names`` lists every tensor the folder holds."""

    def __init__(self, hf_dir: str | os.PathLike):
        self.hf_dir = Path(hf_dir)
        self.index = weight_index(hf_dir)
        self._handles: dict[str, Any] = {}

    @property
    def names(self) -> list[str]:
        return list(self.index)

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def get(self, name: str) -> "torch.Tensor":
        """The tensor ``name`` as stored (dtype and shape of the file); KeyError naming the folder if absent."""
        from safetensors import safe_open

        if name not in self.index:
            raise KeyError(f"{self.hf_dir}: tensor {name!r} not found in the safetensors files")
        fname = self.index[name]
        if fname not in self._handles:
            self._handles[fname] = safe_open(str(self.hf_dir / fname), framework="pt")
        return self._handles[fname].get_tensor(name)


def safetensors_headers(folder: str | os.PathLike) -> dict[str, dict] | None:
    """Tensor name -> its safetensors header entry (``dtype``, ``shape``, ``data_offsets``) over every
    ``*.safetensors`` file in ``folder`` (None if it has none): no weight is read."""
    files = sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []
    if not files:
        return None
    entries: dict[str, dict] = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        entries.update((k, v) for k, v in header.items() if k != "__metadata__")
    return entries


def safetensors_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from the headers of ``folder``'s safetensors files (None if it has none)."""
    entries = safetensors_headers(folder)
    return None if entries is None else {k: tuple(v["shape"]) for k, v in entries.items()}


def safetensors_dtypes(folder: str | os.PathLike) -> dict[str, str] | None:
    """Tensor name -> safetensors dtype name (``BF16``, ``F8_E4M3``, ...) from ``folder``'s headers."""
    entries = safetensors_headers(folder)
    return None if entries is None else {k: v["dtype"] for k, v in entries.items()}


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy an HF folder's non-weight files (config, tokenizer, generation config) into ``dst``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for item in Path(src).iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name != INDEX_NAME:
            shutil.copy2(item, dst / item.name)


def check_safetensors(hf: str, flag: str = "--hf-checkpoint") -> None:
    """Every ``*.safetensors`` file of ``hf`` opens: its header is JSON of a sane length and every tensor's
    bytes lie inside the file; the index names only shards that exist. Reads headers only (a few KB per
    file), so a truncated or garbage file is named here instead of by an engine aborting minutes later."""
    folder = Path(hf)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{flag} {hf}: no *.safetensors weights there; save the model with safe_serialization=True")
    for file in files:
        _check_safetensors_file(file)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); restore the file or "
                              f"save the model again") from None
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ConfigError(f"{index} names shard(s) that are not in {hf}: {', '.join(missing)}; copy the whole "
                              f"model folder")


def _check_safetensors_file(file: Path) -> None:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if header_len is None or header_len > size - 8 or header_len > 100 * 2**20:
            raise ConfigError(f"{file}: not a safetensors file (its {size} bytes hold no valid header: truncated or "
                              f"another format); save the model again with safe_serialization=True")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: its safetensors header is not valid JSON ({exc}): the file is damaged; copy "
                              f"or save it again") from None
    data_bytes = size - 8 - header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        end = entry.get("data_offsets", [0, 0])[1] if isinstance(entry, dict) else None
        if not isinstance(end, int) or end > data_bytes:
            raise ConfigError(f"{file}: tensor {name!r} ends at byte {end} of {data_bytes} the file holds: the file is "
                              f"truncated; copy or save it again")
