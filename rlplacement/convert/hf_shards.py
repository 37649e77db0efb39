"""A Hugging Face folder's weights written as safetensors shards: the writer both exports share."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class ShardWriter:
    """Tensors added one at a time, written in safetensors files of at most ``max_bytes`` each (a tensor larger
    than that gets a file of its own); :meth:`finish` names them as Hugging Face does (``model.safetensors``, or
    ``model-0000i-of-0000n.safetensors`` and an index) and returns the tensor names written. Files are written
    under a ``.tmp`` name and renamed only at :meth:`finish`."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        out.mkdir(parents=True, exist_ok=True)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        fname = f"part-{len(self.files):05d}.safetensors.tmp"
        save_file(self.pending, str(self.out / fname), metadata={"format": "pt"})
        self.files.append((fname, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self.files):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / tmp, self.out / final)
            weight_map.update({k: final for k in names})
        if n > 1:
            (self.out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                              indent=2))
        return list(weight_map)
