"""The disk-delta folder format: how a version is written and published, and how it is read back.

Layout of ``DIR`` (the ``--update-weight-disk-dir`` shared by the trainer and the engines)::

    DIR/weight_v{N:06d}/                 safetensors shards of zstd payloads + model.safetensors.index.json
    DIR/latest                           JSON {"version", "folder", "run_id", "epoch", "sender"}: the newest
                                         complete version and who published it
    DIR/abort_v{N:06d}.json              written (signed) by a sender whose weight source failed during version N
    DIR/.tmp-*                           an unfinished write (removed by the next update)

Invariants:

* A version is visible only when complete: it is written into ``DIR/.tmp-weight_v{N}-*``, every
  file and the folder are fsynced, the folder is renamed into place, and ``DIR/latest`` is
  written last the same way (tmp + fsync + rename + fsync of ``DIR``). A crash leaves at most a
  ``.tmp-*`` entry.
* Segments: the folder holds the versions of one segment, a (run_id, epoch) of the job (an epoch
  is a start of the run from a checkpoint). A sender of another segment first removes the
  pointer and every version, marker and tmp entry (:func:`start_segment`), then publishes; its
  first version is a keyframe. Within a segment ``latest`` only moves forward; across segments it
  may go back (a resume continues from its checkpoint's version).
* Receivers take only the pointer and abort markers of their own sender (run_id, epoch and
  sender id from the endpoint), so another run's pointer is never mistaken for theirs.
* The index holds ``version``, ``base_version`` (None: a keyframe whose tensors are all stored
  whole), ``delta_encoding`` (xor|overwrite), ``checksum`` (the kind, xxh3-64), ``run_id``,
  ``epoch``, ``sender``, ``signature`` (HMAC-SHA256 under the sender's key, :mod:`.signing`: an
  index not written by this job's trainer is refused), ``index_checksum`` (xxh3-64 of the index's
  own canonical JSON: a damaged index is refused whole, as corrupt), ``weight_map`` (stored tensor ->
  shard: a plain file name inside the version's folder, anything else refused) and ``tensors``:
  every tensor of the version, unchanged ones included, with dtype, shape, its checksum, and for
  stored ones the payload's checksum.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rlplacement.atomic_files import fsync_dir, write_atomic, write_synced
from rlplacement.transfer import delta_codec as codec
from rlplacement.transfer.base import TransferError, UpdateAborted
from rlplacement.transfer.disk_delta.signing import SenderIdentity, describe_record

if TYPE_CHECKING:
    import numpy as np

INDEX_NAME = "model.safetensors.index.json"
POINTER_NAME = "latest"
TMP_PREFIX = ".tmp-"
POLL_S = 0.02

# safetensors dtype codes <-> torch dtype names (the names ``bucket.dtype_name`` writes)
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
              "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def version_folder(version: int) -> str:
    return f"weight_v{version:06d}"


def abort_marker(version: int) -> str:
    return f"abort_v{version:06d}.json"


def index_checksum(index: dict) -> str:
    """xxh3-64 of the index's canonical JSON without its own ``index_checksum`` entry: an index edited
    or damaged after publishing (a shard name, an offset, a tensor checksum) is refused as a whole."""
    import xxhash

    body = {k: v for k, v in index.items() if k != "index_checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


# ---- writing ----------------------------------------------------------------------------------

def publish_file(root: Path, name: str, data: bytes) -> None:
    """``root/name`` replaced atomically, through a temporary name the folder's clean-up knows."""
    write_atomic(root / name, data, tmp=root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}")


def read_pointer(root: Path) -> dict | None:
    """``DIR/latest`` as a dict, None while nothing is published (or while it is not a JSON object)."""
    try:
        pointer = json.loads((Path(root) / POINTER_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pointer if isinstance(pointer, dict) and isinstance(pointer.get("version"), int) else None


def read_safetensors_bytes(path: Path, names: set[str] | None = None,
                           keeps: dict | None = None) -> dict[str, tuple[str, tuple[int, ...], "np.ndarray"]]:
    """name -> (torch dtype name, shape, uint8 bytes) of one safetensors file, read raw (any dtype); with
    ``names``, only those tensors, copied out so the rest of the file is not kept. ``keeps`` (name -> box,
    ``transfer.shards.Keeps``): those tensors as the bytes of their box only (the shape is the box's), the
    file read through a memory map so the rest of them is never copied."""
    import numpy as np

    from rlplacement.transfer.delta_codec import cut_bytes
    from rlplacement.transfer.shards import kept_box

    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        if not keeps:
            data = np.frombuffer(bytearray(fh.read()), dtype=np.uint8)
        elif path.stat().st_size > 8 + n:
            data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
        else:
            data = np.zeros(0, dtype=np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or (names is not None and name not in names):
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise TransferError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which disk-delta does not read")
        begin, end = info["data_offsets"]
        dtype, shape, raw = _ST_DTYPES[info["dtype"]], tuple(info["shape"]), data[begin:end]
        box = kept_box(keeps, name)
        if box is not None:
            itemsize = (end - begin) // max(1, int(np.prod(shape)))
            out[name] = (dtype, tuple(b - a for a, b in box), cut_bytes(raw, shape, itemsize, box))
        else:
            out[name] = (dtype, shape, raw if names is None and not keeps else raw.copy())
    return out


def keeps_file(rank: int) -> str:
    """Where engine worker ``rank`` publishes the slices it keeps, for the sender's slice checksums."""
    return f"keeps.rank{rank}.json"


def read_keeps(root: Path, world_size: int) -> list:
    """The slices each receiver of a ``world_size`` group published (``transfer.shards.keeps_from_json``; None:
    whole tensors, or nothing published)."""
    from rlplacement.transfer.shards import keeps_from_json

    out = []
    for rank in range(1, world_size):
        try:
            out.append(keeps_from_json((root / keeps_file(rank)).read_text()))
        except (OSError, ValueError):
            out.append(None)
    return out


def read_checkpoint_bytes(model_dir: str | Path, names: set[str] | None = None,
                          keeps: dict | None = None) -> dict[str, tuple[str, tuple[int, ...], "np.ndarray"]]:
    """Every tensor of a Hugging Face folder's ``*.safetensors`` files (or those of ``names``), as raw bytes;
    those of ``keeps``, their box only (:func:`read_safetensors_bytes`)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise TransferError(f"base checkpoint {model_dir} has no *.safetensors files: disk-delta diffs against "
                            f"the checkpoint the engines started from (--hf-checkpoint)")
    out: dict = {}
    for f in files:
        out.update(read_safetensors_bytes(f, names, keeps))
    return out


class VersionWriter:
    """Writes one version into a tmp folder shard by shard, then publishes it (see module doc)."""

    def __init__(self, root: Path, version: int, shard_bytes: int):
        self.root, self.version, self.shard_bytes = root, version, max(1, shard_bytes)
        self.tmp = root / f"{TMP_PREFIX}{version_folder(version)}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self.weight_map: dict[str, str] = {}
        self.wire_bytes = 0
        self._pending: dict[str, "np.ndarray"] = {}
        self._pending_bytes = 0
        self._shards = 0
        self._renamed: Path | None = None

    def add(self, name: str, payload: bytes) -> None:
        import numpy as np

        self._pending[name] = np.frombuffer(payload, dtype=np.uint8)
        self._pending_bytes += len(payload)
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.numpy import save

        if not self._pending:
            return
        self._shards += 1
        shard = f"delta-{self._shards:05d}.safetensors"
        self.wire_bytes += write_synced(self.tmp / shard, save(self._pending))
        self.weight_map.update((n, shard) for n in self._pending)
        self._pending, self._pending_bytes = {}, 0

    def publish(self, index: dict, identity: SenderIdentity) -> dict:
        """Index (signed by ``identity``), fsyncs, rename into place, then ``latest``. Returns the index."""
        self._flush()
        index["weight_map"] = dict(self.weight_map)
        index["metadata"]["wire_bytes"] = self.wire_bytes
        identity.sign(index)
        index["index_checksum"] = index_checksum(index)
        blob = json.dumps(index, indent=1, sort_keys=True).encode()
        index["metadata"]["wire_bytes"] = self.wire_bytes = self.wire_bytes + len(blob)
        write_synced(self.tmp / INDEX_NAME, blob)
        fsync_dir(self.tmp)
        final = self.root / version_folder(self.version)
        if final.exists():  # an earlier attempt at this version number (never pointed to by now)
            shutil.rmtree(final)
        os.rename(self.tmp, final)
        self._renamed = final
        fsync_dir(self.root)
        pointer = {"version": self.version, "folder": version_folder(self.version), **identity.stamp()}
        publish_file(self.root, POINTER_NAME, json.dumps(pointer).encode())
        return index

    def discard(self) -> None:
        """Remove what this write left: its tmp folder, and its version folder when ``latest`` does not name
        it (a pointer that failed to publish, on a full disk: the space goes back, so the abort marker fits)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        if self._renamed is not None:
            pointer = read_pointer(self.root)
            if pointer is None or pointer.get("folder") != self._renamed.name:
                shutil.rmtree(self._renamed, ignore_errors=True)


def publish_abort(root: Path, version: int, reason: str, identity: SenderIdentity) -> None:
    """``DIR/abort_v{N}.json``, signed: this sender's receivers waiting for version N stop at once
    instead of timing out (another sender's receivers ignore it)."""
    marker = identity.sign({"version": version, "reason": reason})
    publish_file(root, abort_marker(version), json.dumps(marker).encode())


def _remove(entry: Path) -> None:
    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else entry.unlink(
        missing_ok=True)


def start_segment(root: Path) -> bool:
    """Make ``root`` hold no segment: the pointer first (so it never names a removed folder), then every
    version, abort marker and tmp entry; files of other names are left alone. Called by the first
    update of a sender whose segment the folder does not record, so no receiver of that segment reads
    here yet. Returns whether another segment's versions were there (its first version is then a
    keyframe)."""
    pointer = read_pointer(root)
    (root / POINTER_NAME).unlink(missing_ok=True)
    had_versions = pointer is not None
    for entry in root.iterdir():
        if entry.name.startswith("weight_v"):
            had_versions = True
        if entry.name.startswith(("weight_v", "abort_v", TMP_PREFIX)):
            _remove(entry)
    fsync_dir(root)
    return had_versions


# ---- reading ----------------------------------------------------------------------------------

def wait_for_version(root: Path, version: int, timeout_s: float, identity: SenderIdentity) -> Path:
    """The folder of ``version`` once ``latest``, as published by ``identity``'s sender, reaches it; raises
    on that sender's abort marker or the timeout. Another sender's pointer or marker (another run or
    epoch, a sender replaced in this one) is not this receiver's and is waited past."""
    deadline = time.monotonic() + timeout_s
    marker = root / abort_marker(version)
    while True:
        pointer = read_pointer(root)
        if identity.owns(pointer) and pointer["version"] >= version:
            folder = root / version_folder(version)
            if not folder.is_dir():
                raise TransferError(f"version {version} is no longer in {root} (latest is "
                                    f"{pointer['version']}): this engine fell too far behind")
            return folder
        aborted = _read_marker(marker, identity)
        if aborted is not None:
            raise UpdateAborted(f"trainer aborted update to version {version}: {aborted.get('reason', '')}")
        if time.monotonic() > deadline:
            latest = "none" if pointer is None else (
                pointer["version"] if identity.owns(pointer)
                else f"version {pointer['version']} of another sender ({describe_record(pointer)})")
            raise TransferError(f"version {version} was not published in {root} within "
                                f"{timeout_s:.0f}s by the trainer of {identity.describe()} (latest: {latest})")
        time.sleep(POLL_S)


def _read_marker(path: Path, identity: SenderIdentity) -> dict | None:
    """The abort marker at ``path`` when ``identity``'s sender wrote and signed it, else None."""
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and identity.owns(marker) and identity.verifies(marker) else None


def read_index(folder: Path, version: int, served: int, identity: SenderIdentity) -> dict:
    """The index of ``folder``, refused unless intact, signed with ``identity``'s key, of ``version``, in a
    known checksum kind and encoding, with every shard a file name inside ``folder``. ``served``: the
    version the engine keeps if it is refused (for the message)."""
    path = folder / INDEX_NAME
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TransferError(f"{path} is unreadable or corrupt: {exc}") from exc
    if not isinstance(index, dict):
        raise TransferError(f"{path} is corrupt: not a JSON object; the engine keeps version {served}")
    if index.get("index_checksum") != index_checksum(index):
        raise TransferError(f"{path} is corrupt: its content does not match its index_checksum "
                            f"{index.get('index_checksum')!r}; the engine keeps version {served}")
    if not identity.verifies(index):
        raise TransferError(f"{path} is not signed by this job's trainer ({identity.describe()}): its signature "
                            f"does not match the key the engine got at connect, so it was edited or written by "
                            f"another run ({describe_record(index)}); the engine keeps version {served}")
    if index.get("version") != version:
        raise TransferError(f"{path} holds version {index.get('version')}, expected {version}")
    if index.get("checksum") != codec.CHECKSUM_KIND:
        raise TransferError(f"{path}: checksum kind {index.get('checksum')!r} is not {codec.CHECKSUM_KIND!r}")
    if index.get("delta_encoding") not in codec.ENCODINGS:
        raise TransferError(f"{path}: unknown delta_encoding {index.get('delta_encoding')!r}")
    for name, shard in index["weight_map"].items():
        if not _plain_file_name(shard):
            raise TransferError(f"{path}: shard path {shard!r} of tensor {name!r} is not a file name inside {folder} "
                                f"(absolute, '..' or a sub-folder): refused; the engine keeps version {served}")
    return index


def _plain_file_name(shard: object) -> bool:
    return isinstance(shard, str) and shard not in ("", ".", "..") and "/" not in shard and "\\" not in shard \
        and "\0" not in shard and os.path.basename(shard) == shard


def read_payloads(folder: Path, index: dict) -> dict[str, "np.ndarray"]:
    """Every stored payload, shard by shard; a shard that does not parse is refused naming it."""
    import numpy as np

    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        by_shard.setdefault(shard, []).append(name)
    out = {}
    inside = folder.resolve()
    for shard, names in sorted(by_shard.items()):
        resolved = (folder / shard).resolve()
        if resolved.parent != inside:  # a symlink out of the folder
            raise TransferError(f"{folder / INDEX_NAME}: shard path {shard!r} resolves to {resolved}, outside "
                                f"{folder}: refused")
        try:
            tensors = read_safetensors_bytes(folder / shard)
        except Exception as exc:  # noqa: BLE001 - any parse failure is corruption of this shard
            raise TransferError(f"{folder / shard} (tensors {', '.join(names[:3])}{'...' if len(names) > 3 else ''})"
                                f" is corrupt: {type(exc).__name__}: {exc}") from exc
        for name in names:
            if name not in tensors:
                raise TransferError(f"tensor {name!r} is missing from {folder / shard}")
            out[name] = np.ascontiguousarray(tensors[name][2])
    missing = [n for n, e in index["tensors"].items() if e["encoding"] != codec.UNCHANGED and n not in out]
    if missing:
        raise TransferError(f"{folder / INDEX_NAME}: tensor {missing[0]!r} is stored but not in the weight_map")
    return out
