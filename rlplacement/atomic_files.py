"""Files that are either whole or absent: the one way the library publishes a file a reader may pick up
(a disk-delta's pointer, a checkpoint's marker).

Invariant: a reader sees the old file or the complete new one, never a part, across a crash too. The
bytes are written to a temporary name and fsynced, renamed over the final name (atomic on POSIX), and
the folder is fsynced so the rename itself survives a crash.
"""

from __future__ import annotations

import os
import tempfile
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
    ancestor is a writable folder).

    Writability is probed by creating and removing a file there: ``os.access`` answers yes to root for any
    folder, also a read-only mount or ``/proc``, and containers and CI run as root. The probe leaves nothing
    behind and creates no folder."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder: pass a folder")
    probe = target
    while not probe.exists():
        probe = probe.parent
    reason = "it is a file" if not probe.is_dir() else _cannot_create_in(probe)
    if reason:
        raise ConfigError(f"{flag} {path}: {probe} is not writable by this user ({reason}): choose a folder you can "
                          f"write, or change its permissions")


def _cannot_create_in(folder: Path) -> str | None:
    """None when a file can be created (and removed) in ``folder``, else why not."""
    try:
        fd, name = tempfile.mkstemp(prefix=".rlplacement-writable-", dir=folder)
    except OSError as exc:
        return f"creating a file there failed: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return None
