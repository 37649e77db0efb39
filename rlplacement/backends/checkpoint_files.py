"""A checkpoint folder is whole, unchanged and of the right model before a run loads it.

Three checks, all on the driver before any process starts (``job_start``) and again in the trainer at
load (``train_checkpoint.restore``: the path a restarted trainer or a direct ``make_backend`` takes):

- **Checksums.** Every ``--save`` iteration publishes ``checkpoint_manifest.json`` (``checkpoint_manifest``):
  each file's size and xxh3-64 digest, plus a digest of the manifest itself. Checked with JSON and raw
  bytes only, so a flipped byte in a shard, in ``.metadata`` (which torch unpickles) or in an RNG file
  (``torch.load``) is refused naming the file before anything is unpickled.
- **Wholeness.** Every ``torch.distributed.checkpoint`` folder (``.metadata``: a ``--save`` iteration,
  megatron's ``torch_dist`` conversion) has every file its metadata names, each at least as long as the
  bytes the metadata places in it (:func:`check_whole`; conversions carry no manifest, so this is
  their only check).
- **Identity.** The manifest records the model the run trained (``model_identity`` of its HF
  folder: architecture, sizes, vocabulary, dtype, every weight's name and shape);
  :func:`check_identity` refuses a ``--hf-checkpoint`` that differs, naming the field and both values.

Torch-free at import (preflight runs without torch).
"""

from __future__ import annotations

from pathlib import Path

from rlplacement.backends.checkpoint_manifest import check_identity, read_manifest, verify
from rlplacement.errors import ConfigError

__all__ = ["check_whole", "loaded_folder", "check_load", "check_identity", "verify"]


def check_whole(folder: str | Path, flag: str = "--load") -> None:
    """Refuse, naming the file, a checkpoint folder with a changed, missing, short or unreadable file: its
    manifest first (:func:`verify`: nothing is unpickled before the bytes are known good), then every DCP
    folder's metadata against its files."""
    from torch.distributed.checkpoint import FileSystemReader

    root = Path(folder)
    verify(root, flag)
    for metadata in sorted(root.rglob(".metadata")):
        shard_dir = metadata.parent
        try:
            storage = FileSystemReader(str(shard_dir)).read_metadata().storage_data or {}
        except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same refusal
            raise ConfigError(f"{flag} {root}: {metadata} cannot be read ({type(exc).__name__}: {exc}): the "
                              f"checkpoint is damaged; load an earlier one or save again") from None
        needed: dict[str, int] = {}
        for info in storage.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(needed.items()):
            file = shard_dir / name
            if not file.is_file():
                raise ConfigError(f"{flag} {root}: {file} is missing (its metadata names it): copy the whole "
                                  f"checkpoint folder, or load an earlier one")
            size = file.stat().st_size
            if size < end:
                raise ConfigError(f"{flag} {root}: {file} holds {size} bytes but its metadata places data up to "
                                  f"byte {end}: the file is truncated; copy it again or load an earlier checkpoint")


def loaded_folder(load: str | Path) -> Path:
    """The folder a ``--load`` reads: a ``--save`` folder's latest published iteration, or a conversion's."""
    from rlplacement.backends import train_checkpoint
    from rlplacement.backends.megatron import checkpoint_layout as megatron_checkpoint

    if megatron_checkpoint.is_training_checkpoint(load):
        return train_checkpoint.latest(load)
    return megatron_checkpoint.checkpoint_dir(load)


def check_load(load: str | Path, hf_checkpoint: str | Path | None) -> None:
    """Everything checked of a ``--load`` before any process starts: the files (:func:`check_whole`) and,
    for a ``--save`` folder, that it was trained from ``hf_checkpoint``'s model (:func:`check_identity`)."""
    folder = loaded_folder(load)
    check_whole(folder)
    manifest = read_manifest(folder)
    if manifest is not None and hf_checkpoint:
        check_identity(manifest.get("model") or {}, hf_checkpoint, f"--load {load}")


