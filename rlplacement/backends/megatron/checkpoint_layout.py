"""The converted checkpoint folder, as Megatron's ``--load`` expects it, plus what export needs.

```
SAVE/release/                          dist_checkpointing (torch_dist) files
SAVE/hf_config/                        the source HF folder minus weights (config, tokenizer)
SAVE/rlplacement_convert.json          vocab sizes, family, layer spec and sizes used at conversion
SAVE/latest_checkpointed_iteration.txt "release", written last (tmp + fsync + rename)
```
Invariant: the marker exists only if everything before it is complete, so a folder with files but
no marker is a half-finished conversion and is redone from scratch.

A ``--save`` folder of the megatron backend has the same ``hf_config/`` and ``rlplacement_convert.json``
beside ``backends/train_checkpoint``'s iteration folders (dist_checkpointing files of the model, the
optimizer and, with ``--use-kl-loss``, the frozen reference); its marker names an iteration.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

RELEASE = "release"
MARKER = "latest_checkpointed_iteration.txt"
META = "rlplacement_convert.json"
HF_CONFIG_DIR = "hf_config"


def state(save_dir: str | os.PathLike) -> str:
    """``finished`` (marker present), ``partial`` (files but no marker) or ``empty``."""
    path = Path(save_dir)
    if (path / MARKER).is_file():
        return "finished"
    if path.is_dir() and any(path.iterdir()):
        return "partial"
    return "empty"


def clear_partial(save_dir: str | os.PathLike) -> None:
    """Remove what a half-finished conversion left; only our own entries, never unrelated files."""
    path = Path(save_dir)
    for name in (RELEASE, HF_CONFIG_DIR, META, MARKER + ".tmp"):
        target = path / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def read_meta(load_dir: str | os.PathLike) -> dict:
    path = Path(load_dir)
    if state(path) != "finished":
        raise FileNotFoundError(f"{path} is not a finished torch_dist checkpoint (no {MARKER}): run "
                                f"`rlplacement convert --hf-checkpoint HF_DIR --save {path}` first")
    meta_file = path / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{meta_file} missing: the checkpoint was not written by rlplacement convert; "
                                f"pass --hf-config with the model's HF folder")
    return json.loads(meta_file.read_text())


def checkpoint_dir(load_dir: str | os.PathLike) -> Path:
    path = Path(load_dir)
    tag = (path / MARKER).read_text().strip()
    return path / (RELEASE if tag == "release" else f"iter_{int(tag):07d}")


def is_training_checkpoint(load_dir: str | os.PathLike) -> bool:
    """Whether ``load_dir`` is a ``--save`` folder (its marker names an iteration), not a conversion."""
    marker = Path(load_dir) / MARKER
    return marker.is_file() and marker.read_text().strip().isdigit()


def describe(root: str | os.PathLike, hf_dir: str | os.PathLike, meta: dict) -> None:
    """Rank 0, before a ``--save`` folder's first iteration is published: the model's description (HF side
    files and the conversion metadata) at its root, so ``--load`` rebuilds the model from it alone."""
    from rlplacement.atomic_files import write_atomic
    from rlplacement.hf_folder import copy_side_files

    path = Path(root)
    if not (path / META).is_file():
        path.mkdir(parents=True, exist_ok=True)
        copy_side_files(hf_dir, path / HF_CONFIG_DIR)
        write_atomic(path / META, json.dumps(meta, indent=2))
