"""A checkpoint folder is whole before a run loads it: every ``torch.distributed.checkpoint`` folder in it
(one holding ``.metadata``: a ``--save`` iteration, megatron's ``torch_dist`` conversion) has every file its
metadata names, each at least as long as the bytes the metadata places in it. Checked on the driver
before any process starts, so a truncated or missing shard is named in seconds instead of surfacing as
an ``EOFError`` inside a trainer rank half a minute later. (The metadata itself is read with torch's
reader, which unpickles it; verifying the files' bytes against recorded checksums is a separate step.)
"""

from __future__ import annotations

from pathlib import Path

from rlplacement.errors import ConfigError


def check_whole(folder: str | Path, flag: str = "--load") -> None:
    """Refuse, naming the file, a checkpoint folder with a missing, short or unreadable file."""
    from torch.distributed.checkpoint import FileSystemReader

    root = Path(folder)
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
    from rlplacement.backends import megatron_checkpoint, train_checkpoint

    if megatron_checkpoint.is_training_checkpoint(load):
        return train_checkpoint.latest(load)
    return megatron_checkpoint.checkpoint_dir(load)
