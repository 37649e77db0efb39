"""Mode ``disk-delta``: the trainer writes each version as per-tensor byte deltas into a shared
folder; engines are told to load version N and read it from there.

Data flow: trainer tensors -> diff against the bytes the engines hold (``delta_codec``) ->
``DIR/weight_v{N:06d}/`` (safetensors shards of zstd payloads + ``model.safetensors.index.json``)
-> ``DIR/latest`` -> each engine worker reads, verifies and stages the full new tensors -> commit.

Folder invariants:

* A version is visible only when complete: it is written into ``DIR/.tmp-weight_v{N}-*``, every
  file and the folder are fsynced, the folder is renamed into place, and ``DIR/latest`` (JSON
  ``{"version": N, "folder": ...}``) is written last the same way (tmp + fsync + rename + fsync
  of ``DIR``). A crash leaves at most a ``.tmp-*`` entry, removed by the next update.
* The index holds ``version``, ``base_version`` (None: a keyframe whose tensors are all stored
  whole), ``delta_encoding`` (xor|overwrite), ``checksum`` (the kind, xxh3-64), ``index_checksum``
  (xxh3-64 of the index's own canonical JSON: a damaged index is refused whole), ``weight_map``
  (stored tensor -> shard) and ``tensors``: every tensor of the version, unchanged ones
  included, with dtype, shape, its checksum, and for stored ones the payload's checksum.
* Base bytes are the version the engines hold. Version 0 is the Hugging Face checkpoint they
  started from (``base_dir``); without one the first version is a keyframe. The sender keeps
  the last bytes it published so it can diff the next step. Version N is a delta only on
  version N-1 and only when no ``listen`` came in between (engines that rejoin, e.g. after a
  failed update, may hold an older version); otherwise it is a keyframe.

Receiver rules: xor applies only on its base version (anything else is refused before
decoding); overwrite applies on any held bytes and is accepted when every resulting tensor's
checksum equals the version's (so re-applying it is harmless). Every payload's checksum is
checked before decoding and every result's after: corruption is refused naming the tensor, and
nothing reaches the model before ``commit`` (all or nothing, as in the other modes).

Coordination: ``driver.run_update`` starts the trainer's ``update`` and the engines' receive at
once; a receiver waits (bounded by the endpoint's timeout) for ``latest`` to reach its version,
or for ``DIR/abort_v{N:06d}.json``, which a sender whose weight source failed writes so the
engines stop at once instead of timing out. Over the endpoint, ``group_name`` carries the
folder (vLLM's init info has a fixed set of fields) and ``backend`` is ``"file"``.

One sender per folder. The receiver keeps a host copy of the bytes it serves (vLLM CPU repacks
its linear layers, so the model's own parameters cannot serve as the base).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

from rlplacement.transfer import delta_codec as codec
from rlplacement.transfer.options import DiskDeltaOptions
from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, ApplyFn, NamedTensor, TransferEndpoint, TransferError,
                                       UpdateAborted, UpdateReport, WeightMismatchError, WeightReceiver, WeightSender)

if TYPE_CHECKING:
    import numpy as np
    import torch

MODE = "disk-delta"
INDEX_NAME = "model.safetensors.index.json"


def index_checksum(index: dict) -> str:
    """xxh3-64 of the index's canonical JSON without its own ``index_checksum`` entry: an index edited
    or damaged after publishing (a shard name, an offset, a tensor checksum) is refused as a whole."""
    import xxhash

    body = {k: v for k, v in index.items() if k != "index_checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
POINTER_NAME = "latest"
TMP_PREFIX = ".tmp-"
KEEP_VERSIONS = 2  # the newest and its base: a receiver one step behind can still catch up
POLL_S = 0.02

# safetensors dtype codes <-> torch dtype names (the names ``bucket.dtype_name`` writes)
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
              "U64": "uint64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def version_folder(version: int) -> str:
    return f"weight_v{version:06d}"


def abort_marker(version: int) -> str:
    return f"abort_v{version:06d}.json"


# ---- files ------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> int:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return len(data)


def _publish_file(root: Path, name: str, data: bytes) -> None:
    """``root/name`` replaced atomically: tmp + fsync + rename + fsync of the folder."""
    tmp = root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    _write_synced(tmp, data)
    os.replace(tmp, root / name)
    _fsync_dir(root)


def read_pointer(root: Path) -> dict | None:
    """``DIR/latest`` as a dict, None while nothing is published."""
    try:
        return json.loads((Path(root) / POINTER_NAME).read_text())
    except FileNotFoundError:
        return None


def read_safetensors_bytes(path: Path) -> dict[str, tuple[str, tuple[int, ...], "np.ndarray"]]:
    """name -> (torch dtype name, shape, uint8 bytes) of one safetensors file, read raw (any dtype)."""
    import numpy as np

    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
        data = np.frombuffer(bytearray(fh.read()), dtype=np.uint8)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _ST_DTYPES:
            raise TransferError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which disk-delta does not read")
        begin, end = info["data_offsets"]
        out[name] = (_ST_DTYPES[info["dtype"]], tuple(info["shape"]), data[begin:end])
    return out


def read_checkpoint_bytes(model_dir: str | Path) -> dict[str, tuple[str, tuple[int, ...], "np.ndarray"]]:
    """Every tensor of a Hugging Face folder's ``*.safetensors`` files, as raw bytes."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise TransferError(f"base checkpoint {model_dir} has no *.safetensors files: disk-delta diffs against "
                            f"the checkpoint the engines started from (--hf-checkpoint)")
    out: dict = {}
    for f in files:
        out.update(read_safetensors_bytes(f))
    return out


def _host_bytes(tensor: "torch.Tensor") -> "np.ndarray":
    from rlplacement.transfer.bucket import as_bytes

    flat = as_bytes(tensor)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()


class _VersionWriter:
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
        self.wire_bytes += _write_synced(self.tmp / shard, save(self._pending))
        self.weight_map.update((n, shard) for n in self._pending)
        self._pending, self._pending_bytes = {}, 0

    def publish(self, index: dict) -> dict:
        """Index, fsyncs, rename into place, then ``latest``. Returns the index as written."""
        self._flush()
        index["weight_map"] = dict(self.weight_map)
        index["metadata"]["wire_bytes"] = self.wire_bytes
        index["index_checksum"] = index_checksum(index)
        blob = json.dumps(index, indent=1, sort_keys=True).encode()
        index["metadata"]["wire_bytes"] = self.wire_bytes = self.wire_bytes + len(blob)
        _write_synced(self.tmp / INDEX_NAME, blob)
        _fsync_dir(self.tmp)
        final = self.root / version_folder(self.version)
        if final.exists():  # an earlier attempt at this version number (never pointed to by now)
            shutil.rmtree(final)
        os.rename(self.tmp, final)
        _fsync_dir(self.root)
        _publish_file(self.root, POINTER_NAME, json.dumps({"version": self.version,
                                                           "folder": version_folder(self.version)}).encode())
        return index

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- sender -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeltaUpdateReport(UpdateReport):
    """UpdateReport plus the delta's own numbers; ``dataclasses.asdict`` carries them to the driver
    (``trainer.transfer_send`` returns it as a dict). ``density`` (changed bytes / total bytes) is
    ``perf/update_weights_density``; ``wire_bytes`` is what was written (compressed shards + index)."""

    changed_bytes: int = 0
    wire_bytes: int = 0
    density: float = 0.0
    encoding: str = ""
    base_version: int | None = None
    folder: str = ""

    @property
    def metrics(self) -> dict[str, float]:
        return {"perf/update_weights_density": self.density, "perf/update_weights_wire_bytes": self.wire_bytes}


class DiskDeltaSender(WeightSender):
    """Trainer rank 0: named tensors -> per-tensor deltas against the last published bytes -> folder."""

    mode: ClassVar[str] = MODE

    def __init__(self, buffer_size: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: Any = None, disk_dir: str | os.PathLike | None = None, delta_encoding: str = "xor",
                 base_dir: str | os.PathLike | None = None, keep_versions: int = KEEP_VERSIONS):
        """``buffer_size`` bounds one shard's payload bytes. ``disk_dir`` None: a fresh folder under
        the system temp dir (one host only; removed on close). ``base_dir``: the HF checkpoint the
        engines started from (version 0); None makes the first version a keyframe."""
        if buffer_size <= 0:
            raise ValueError(f"buffer_size must be positive, got {buffer_size}: set --update-weight-buffer-size")
        self.options = DiskDeltaOptions(disk_dir, delta_encoding, base_dir)  # validates
        if keep_versions < 2:
            raise ValueError(f"keep_versions {keep_versions}: keep at least the newest version and its base")
        self.buffer_size, self.check_equal, self.timeout_s = buffer_size, check_equal, timeout_s
        self.encoding, self.keep_versions = delta_encoding, keep_versions
        self._owns_dir = disk_dir is None
        self.root = Path(disk_dir) if disk_dir is not None else Path(tempfile.mkdtemp(prefix="rlplacement-disk-delta-"))
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self._held: dict[str, tuple[str, tuple[int, ...], "np.ndarray"]] | None = None
        self._held_sums: dict[str, str] = {}
        self._held_version: int | None = None
        self._endpoint: TransferEndpoint | None = None
        self._scratch = None  # uint8, the largest tensor's size: the xor of the tensor being encoded
        self._spare: dict[str, "np.ndarray"] = {}  # held arrays replaced by the last version, reused
        self._keyframe_next = False

    # -- protocol
    def listen(self, world_size: int, *, host: str | None = None) -> TransferEndpoint:
        if world_size < 2:
            raise ValueError(f"world_size {world_size}: need the trainer plus at least one engine worker")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f"{TMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"
            _write_synced(probe, b"")
            probe.unlink()
        except OSError as exc:
            raise TransferError(f"--update-weight-disk-dir {self.root} is not a writable folder: {exc}") from exc
        self._endpoint = TransferEndpoint(MODE, host or "127.0.0.1", 0, world_size, "file", str(self.root.resolve()),
                                          self.timeout_s, self.check_equal)
        # (re)joining engines may hold anything we sent (a failed update leaves some on the old version)
        self._keyframe_next = bool(self._held_version)
        return self._endpoint

    def connect(self) -> None:
        if self._endpoint is None:
            raise TransferError("connect() before listen(): call listen(world_size) first")
        self._load_base()  # read the base checkpoint now, not inside the first timed update

    def update(self, version: int, named_tensors: Iterable[NamedTensor]) -> DeltaUpdateReport:
        if self._endpoint is None:
            raise TransferError("update() before listen()/connect()")
        if self._held_version is not None and version <= self._held_version:
            raise TransferError(f"update version {version} is not newer than the last published {self._held_version}")
        start = time.perf_counter()
        self._load_base()
        self._clean_leftovers()
        writer = _VersionWriter(self.root, version, self.buffer_size)
        try:
            index, new_held, new_sums = self._write_version(writer, version, named_tensors)
            writer.publish(index)
        except BaseException as exc:
            writer.discard()
            if isinstance(exc, Exception):
                try:
                    _publish_file(self.root, abort_marker(version),
                                  json.dumps({"version": version, "reason": f"{type(exc).__name__}: {exc}"}).encode())
                except OSError:
                    pass  # the receivers then time out instead; the original error matters more
                raise UpdateAborted(f"update to version {version} aborted: {type(exc).__name__}: {exc}") from exc
            raise
        base_version = index["base_version"]
        old_held = self._held or {}
        self._spare = {n: old_held[n][2] for n, held in new_held.items()
                       if n in old_held and held is not old_held[n]}
        self._held, self._held_sums, self._held_version = new_held, new_sums, version
        self._keyframe_next = False
        self._drop_old_versions(version)
        meta = index["metadata"]
        return DeltaUpdateReport(version, len(index["tensors"]), max(1, len(set(index["weight_map"].values()))),
                                 meta["total_bytes"], time.perf_counter() - start,
                                 dict(new_sums) if self.check_equal else None,
                                 changed_bytes=meta["changed_bytes"], wire_bytes=meta["wire_bytes"],
                                 density=meta["density"], encoding=self.encoding, base_version=base_version,
                                 folder=str(self.root / version_folder(version)))

    def close(self) -> None:
        self._endpoint = None
        if self._owns_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- internals
    def _load_base(self) -> None:
        if self._held is None and self.base_dir is not None:
            self._held = read_checkpoint_bytes(self.base_dir)
            self._held_sums = {n: codec.checksum(a) for n, (_, _, a) in self._held.items()}
            self._held_version = 0

    def _write_version(self, writer: _VersionWriter, version: int, named_tensors: Iterable[NamedTensor]):
        import numpy as np

        from rlplacement.transfer.bucket import dtype_name

        # a delta only on the version just before this one, and only while the engines are known to
        # hold it; otherwise a keyframe that any engine can load
        delta = self._held is not None and self._held_version == version - 1 and not self._keyframe_next
        held = self._held if delta else {}
        entries: dict[str, dict] = {}
        new_held, new_sums = {}, {}
        total = changed = 0
        for name, tensor in named_tensors:
            if name in entries:
                raise TransferError(f"tensor {name!r} appears twice in one update")
            dtype, shape, new = dtype_name(tensor.dtype), tuple(tensor.shape), _host_bytes(tensor)
            old = held.get(name)
            comparable = old is not None and old[0] == dtype and old[1] == shape
            if self._scratch is None or self._scratch.size < new.size:
                self._scratch = np.empty(max(new.size, 1), dtype=np.uint8)
            enc = codec.encode(new, old[2] if comparable else None, self.encoding, self._scratch)
            entry = {"dtype": dtype, "shape": list(shape), "nbytes": int(new.size), "encoding": enc.encoding,
                     "checksum": codec.checksum(new), "changed_bytes": enc.changed_bytes, **enc.extra}
            if enc.encoding == codec.UNCHANGED:
                new_held[name] = old
            else:
                if comparable:
                    entry["base_checksum"] = self._held_sums[name]
                entry["payload_checksum"] = codec.checksum(memoryview(enc.payload))
                writer.add(name, enc.payload)
                # a copy: the trainer changes its tensor in place next step. Into the array this
                # tensor's bytes of two versions ago used (no longer anyone's base), if it fits.
                keep = self._spare.pop(name, None)
                keep = keep if keep is not None and keep.size == new.size and keep.flags.writeable else np.empty_like(new)
                np.copyto(keep, new)
                new_held[name] = (dtype, shape, keep)
            new_sums[name] = entry["checksum"]
            entries[name] = entry
            total += int(new.size)
            changed += enc.changed_bytes
        if not entries:
            raise TransferError("the update holds no tensors; send the model's HF-named tensors")
        index = {"version": version, "base_version": self._held_version if delta else None,
                 "delta_encoding": self.encoding, "checksum": codec.CHECKSUM_KIND, "compression": codec.COMPRESSION,
                 "base_checkpoint": str(self.base_dir.resolve()) if self.base_dir is not None else None,
                 "tensors": entries,
                 "metadata": {"total_bytes": total, "changed_bytes": changed,
                              "density": changed / total if total else 0.0}}
        return index, new_held, new_sums

    def _clean_leftovers(self) -> None:
        """Remove tmp entries of crashed writes and abort markers of earlier versions."""
        for entry in self.root.iterdir():
            if entry.name.startswith(TMP_PREFIX) or entry.name.startswith("abort_v"):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def _drop_old_versions(self, newest: int) -> None:
        for entry in self.root.glob("weight_v*"):
            try:
                v = int(entry.name.removeprefix("weight_v"))
            except ValueError:
                continue
            if v <= newest - self.keep_versions:
                shutil.rmtree(entry, ignore_errors=True)


# ---- receiver ---------------------------------------------------------------------------------

# (folder, rank) -> (version, held bytes, held checksums) of the last commit in this process: a
# receiver rebuilt on reconnect (the vLLM backend makes a new one per init) adopts it.
_COMMITTED: dict[tuple[str, int], tuple[int, dict, dict]] = {}


class DiskDeltaReceiver(WeightReceiver):
    """One engine worker: wait for version N in the folder, verify, stage base + delta, commit."""

    mode: ClassVar[str] = MODE

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0,
                 base_dir: str | os.PathLike | None = None):
        """``base_dir``: the HF checkpoint this engine started from (version 0); None uses the one the
        version's index names (``base_checkpoint``), which suits a shared filesystem."""
        import torch

        self.device = torch.device(device)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.root: Path | None = None
        self.rank: int | None = None
        self._group = None  # no process group; kept for callers that print the group's rank
        self._timeout_s = DEFAULT_TIMEOUT_S
        self._version = version
        self._held: dict[str, tuple[str, tuple[int, ...], "np.ndarray"]] | None = None
        self._held_sums: dict[str, str] = {}
        self._pending: int | None = None
        self._staged: list[NamedTensor] | None = None
        self._staged_held: tuple[dict, dict] | None = None
        self.last_index: dict | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def staged(self) -> list[NamedTensor] | None:
        return self._staged

    def _where(self) -> str:
        return f"disk-delta receiver rank {self.rank}"

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        if endpoint.mode != self.mode:
            raise TransferError(f"endpoint is for mode {endpoint.mode!r}, receiver is {self.mode!r}")
        if not 0 < rank < endpoint.world_size:
            raise TransferError(f"receiver rank {rank} outside 1..{endpoint.world_size - 1}")
        root = Path(endpoint.group_name)
        if not root.is_dir():
            raise TransferError(f"--update-weight-disk-dir {root} is not a folder this engine can read "
                                f"(disk-delta needs a folder shared by the trainer and the engines)")
        self.root, self.rank, self._timeout_s = root, rank, endpoint.timeout_s
        cached = _COMMITTED.get((str(root), rank))
        if self._held is None and cached is not None and cached[0] == self._version:
            _, self._held, self._held_sums = cached

    def begin(self, version: int) -> None:
        if self.root is None:
            raise TransferError("begin() before connect(): the engine has not joined a disk-delta folder")
        if version <= self._version:
            raise TransferError(f"update version {version} is not newer than the served version {self._version}")
        self._pending, self._staged, self._staged_held = version, None, None

    def receive(self) -> UpdateReport:
        if self._pending is None:
            raise TransferError("receive() without begin(version)")
        start = time.perf_counter()
        try:
            folder = self._wait_for(self._pending)
            index = self._read_index(folder)
            staged, held, sums, stored_bytes = self._stage(folder, index)
        except BaseException:
            self._pending = self._staged = self._staged_held = None
            raise
        self._staged, self._staged_held, self.last_index = staged, (held, sums), index
        return UpdateReport(self._pending, len(staged), len(set(index["weight_map"].values())),
                            stored_bytes, time.perf_counter() - start)

    def commit(self, apply: ApplyFn) -> int:
        if self._staged is None or self._pending is None:
            raise TransferError("commit() without a fully received update")
        staged, version, (held, sums) = self._staged, self._pending, self._staged_held
        self._staged = self._pending = self._staged_held = None
        apply(staged)
        self._held, self._held_sums, self._version = held, sums, version
        _COMMITTED[(str(self.root), self.rank)] = (version, held, sums)
        return version

    def abort(self) -> None:
        self._staged = self._pending = self._staged_held = None

    def close(self) -> None:
        self.root = None

    # -- internals
    def _wait_for(self, version: int) -> Path:
        deadline = time.monotonic() + self._timeout_s
        marker = self.root / abort_marker(version)
        while True:
            pointer = read_pointer(self.root)
            if pointer is not None and int(pointer["version"]) >= version:
                folder = self.root / version_folder(version)
                if not folder.is_dir():
                    raise TransferError(f"version {version} is no longer in {self.root} (latest is "
                                        f"{pointer['version']}): this engine fell too far behind")
                return folder
            if marker.exists():
                reason = json.loads(marker.read_text()).get("reason", "")
                raise UpdateAborted(f"trainer aborted update to version {version}: {reason}")
            if time.monotonic() > deadline:
                latest = pointer["version"] if pointer else "none"
                raise TransferError(f"version {version} was not published in {self.root} within "
                                    f"{self._timeout_s:.0f}s (latest: {latest})")
            time.sleep(POLL_S)

    def _read_index(self, folder: Path) -> dict:
        try:
            index = json.loads((folder / INDEX_NAME).read_text())
        except (OSError, ValueError) as exc:
            raise TransferError(f"{folder / INDEX_NAME} is unreadable or corrupt: {exc}") from exc
        if index.get("index_checksum") != index_checksum(index):
            raise TransferError(f"{folder / INDEX_NAME} is corrupt: its content does not match its index_checksum "
                                f"{index.get('index_checksum')!r}; the engine keeps version {self._version}")
        if index.get("version") != self._pending:
            raise TransferError(f"{folder / INDEX_NAME} holds version {index.get('version')}, expected {self._pending}")
        if index.get("checksum") != codec.CHECKSUM_KIND:
            raise TransferError(f"{folder / INDEX_NAME}: checksum kind {index.get('checksum')!r} is not "
                                f"{codec.CHECKSUM_KIND!r}")
        base, encoding = index.get("base_version"), index.get("delta_encoding")
        if encoding not in codec.ENCODINGS:
            raise TransferError(f"{folder / INDEX_NAME}: unknown delta_encoding {encoding!r}")
        if encoding == "xor" and base is not None and base != self._version:
            raise TransferError(f"{self._where()}: version {self._pending} is an xor delta on version {base}, but this "
                                f"engine serves version {self._version}; xor applies exactly once, on its base")
        return index

    def _base_for(self, index: dict) -> dict:
        if self._held is not None or index["base_version"] is None:
            return self._held or {}
        if self._version != 0:
            raise TransferError(f"{self._where()}: serves version {self._version} but holds none of its bytes "
                                f"(the process restarted?); it cannot apply a delta on version {index['base_version']}")
        base_dir = self.base_dir or (Path(index["base_checkpoint"]) if index.get("base_checkpoint") else None)
        if base_dir is None:
            raise TransferError(f"{self._where()}: version {index['version']} is a delta on the base checkpoint, "
                                f"but neither the receiver nor the index names it")
        self._held = read_checkpoint_bytes(base_dir)
        self._held_sums = {}
        return self._held

    def _held_sum(self, name: str, held: dict) -> str:
        if name not in self._held_sums:
            self._held_sums[name] = codec.checksum(held[name][2])
        return self._held_sums[name]

    def _stage(self, folder: Path, index: dict):
        import torch

        from rlplacement.transfer.bucket import dtype_from_name

        held = self._base_for(index)
        payloads = self._read_payloads(folder, index)
        staged, new_held, new_sums = [], {}, {}
        stored_bytes = 0
        where = f"{self._where()}, version {index['version']}"
        for name, e in index["tensors"].items():
            dtype, shape, want = e["dtype"], tuple(e["shape"]), e["checksum"]
            base = held.get(name)
            if e["encoding"] == codec.UNCHANGED:
                if base is None or self._held_sum(name, held) != want:
                    raise WeightMismatchError(name, want, "<missing>" if base is None else self._held_sum(name, held),
                                              f"{where} (unchanged tensor; the engine serves version {self._version})")
                data = base[2]
            else:
                payload = payloads[name]
                got = codec.checksum(payload)
                if got != e["payload_checksum"]:
                    raise TransferError(f"{where}: tensor {name!r} is corrupt in {index['weight_map'][name]} "
                                        f"(payload checksum {got}, index says {e['payload_checksum']})")
                stored_bytes += payload.size
                if e["encoding"] == "xor" and e.get("base_checksum") and (
                        base is None or self._held_sum(name, held) != e["base_checksum"]):
                    raise TransferError(f"{where}: tensor {name!r} differs from the xor delta's base "
                                        f"(version {index['base_version']}); refusing to apply it")
                try:
                    data = codec.decode(e["encoding"], payload, base[2] if base is not None else None,
                                        int(e["nbytes"]), e)
                except codec.DeltaDecodeError as exc:
                    raise TransferError(f"{where}: tensor {name!r} does not decode: {exc}") from exc
                got = codec.checksum(data)
                if got != want:
                    raise WeightMismatchError(name, want, got, where)
            new_held[name], new_sums[name] = (dtype, shape, data), want
            tensor = torch.from_numpy(data).view(dtype_from_name(dtype)).view(shape)
            staged.append((name, tensor if self.device.type == "cpu" else tensor.to(self.device)))
        return staged, new_held, new_sums, stored_bytes

    def _read_payloads(self, folder: Path, index: dict) -> dict[str, "np.ndarray"]:
        """Every stored payload, shard by shard; a shard that does not parse is refused naming it."""
        import numpy as np

        by_shard: dict[str, list[str]] = {}
        for name, shard in index["weight_map"].items():
            by_shard.setdefault(shard, []).append(name)
        out = {}
        for shard, names in sorted(by_shard.items()):
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
