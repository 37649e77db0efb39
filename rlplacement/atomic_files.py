"""Files that are either whole or absent: the one way the library publishes a file a reader may pick up
(a disk-delta's pointer, a checkpoint's marker).

Invariant: a reader sees the old file or the complete new one, never a part, across a crash too. The
bytes are written to a temporary name and fsynced, renamed over the final name (atomic on POSIX), and
the folder is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlplacement.errors import ConfigError


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the entries of folder ``path`` (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: str | os.PathLike, data: bytes) -> int:
    """Write ``data`` to ``path`` and fsync it; returns the bytes written."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return len(data)


def write_atomic(path: str | os.PathLike, data: bytes | str, *, tmp: str | os.PathLike | None = None) -> None:
    """Replace ``path`` with ``data`` (str as UTF-8) whole: temporary file + fsync + rename + fsync of
    the folder. ``tmp``: the temporary name (default ``path`` + ``.tmp``), for a folder whose clean-up
    recognises its own leftovers by name."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(path.name + ".tmp")
    write_synced(tmp, data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def check_writable(path: str, flag: str) -> None:
    """``path`` is a folder this process may write into, or can be created as one (its nearest existing
    ancestor is a writable folder)."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder: pass a folder")
    probe = target
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {probe} is not writable by this user: choose a folder you can write, or "
                          f"change its permissions")
