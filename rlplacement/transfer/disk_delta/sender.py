"""The trainer side of disk-delta: named tensors -> per-tensor deltas against the bytes the engines
hold -> one published version folder (:mod:`.folder_format`).

Receivers that keep slices (``transfer.shards``) publish them in the folder at join; every version's index
carries each such slice's checksum (``slice_checksums``), and the report's checksums are the slices' where
receivers keep slices, the whole tensor's where any receiver takes it whole.

Base bytes are the version the engines hold. Version 0 is the Hugging Face checkpoint they
started from (``base_dir``); without one the first version is a keyframe. The sender keeps the
last bytes it published so it can diff the next step. Version N is a delta only on version N-1
and only when no ``listen`` came in between (engines that rejoin, e.g. after a failed update, may
hold an older version); otherwise it is a keyframe. A failed update leaves no version behind and
publishes an abort marker. One sender per folder; it keeps the newest ``keep_versions`` folders.

Segments: the sender publishes for one (``run_id``, ``epoch``) of the job. Its first update on a
folder that records another segment removes that segment's files and writes a keyframe (the
engines may hold anything: fresh ones the checkpoint, kept ones a version of an earlier epoch),
so a resume may continue from a version lower than the folder's. Within its segment a version
not above the folder's ``latest`` is refused, so ``latest`` never moves backwards there. Every
index and abort marker is signed with this sender's own key (:mod:`.signing`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

from rlplacement.atomic_files import write_synced
from rlplacement.transfer import delta_codec as codec
from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, HFShapes, NamedTensor, TransferEndpoint, TransferError,
                                       UpdateAborted, UpdateReport, WeightSender, hf_shaped)
from rlplacement.transfer.disk_delta import folder_format
from rlplacement.transfer.disk_delta import MODE, DiskDeltaOptions
from rlplacement.transfer.disk_delta.signing import SenderIdentity, describe_record
from rlplacement.transfer.shards import kept_box

if TYPE_CHECKING:
    import numpy as np
    import torch

KEEP_VERSIONS = 2  # the newest and its base: a receiver one step behind can still catch up


def host_bytes(tensor: "torch.Tensor") -> "np.ndarray":
    from rlplacement.transfer.bucket import as_bytes

    flat = as_bytes(tensor)
    return (flat if flat.device.type == "cpu" else flat.cpu()).numpy()


@dataclasses.dataclass(frozen=True)
class DeltaUpdateReport(UpdateReport):
    """UpdateReport plus the delta's own numbers. ``density`` (changed bytes / total bytes) is
    ``perf/update_weights_density``; ``wire_bytes`` is what was written (compressed shards + index)."""

    changed_bytes: int = 0
    wire_bytes: int = 0
    density: float = 0.0
    encoding: str = ""
    base_version: int | None = None
    folder: str = ""

    @property
    def metrics(self) -> dict[str, Any]:
        return {**super().metrics, "perf/update_weights_density": self.density,
                "perf/update_weights_wire_bytes": self.wire_bytes}

    def merged_fields(self, reports) -> dict[str, Any]:
        """Several senders' shares: bytes changed and written summed, the density over the whole update; a
        keyframe if any sender wrote one (each sender's folder chains on its own)."""
        changed, total = sum(r.changed_bytes for r in reports), sum(r.bytes for r in reports)
        keyframe = any(r.base_version is None for r in reports)
        return {"changed_bytes": changed, "wire_bytes": sum(r.wire_bytes for r in reports),
                "density": changed / total if total else 0.0, "base_version": None if keyframe else self.base_version,
                "folder": ",".join(r.folder for r in reports)}


def reader_slices(name: str, readers: list) -> dict:
    """The slices of tensor ``name`` the receivers keep (``shards.region_key`` -> box), from what each
    published (``folder_format.read_keeps``)."""
    from rlplacement.transfer.shards import kept_box, region_key

    boxes = [kept_box(keeps, name) for keeps in readers]
    return {region_key(name, box): box for box in boxes if box is not None}


class DiskDeltaSender(WeightSender):
    """A sending trainer rank: named tensors -> per-tensor deltas against the last published bytes -> folder."""

    mode: ClassVar[str] = MODE

    def __init__(self, bucket_bytes: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: Any = None, disk_dir: str | os.PathLike | None = None, delta_encoding: str = "xor",
                 base_dir: str | os.PathLike | None = None, run_id: str = "", epoch: int = 0,
                 sender_index: int | None = None, keep_versions: int = KEEP_VERSIONS):
        """``bucket_bytes`` bounds one shard's payload bytes. ``disk_dir`` None: a fresh folder under
        the system temp dir (one host only; removed on close). ``base_dir``: the HF checkpoint the
        engines started from (version 0); None makes the first version a keyframe. ``run_id`` and
        ``epoch``: the segment this sender publishes (``DiskDeltaOptions``; "" makes a fresh run id).
        ``sender_index``: one of several senders, publishing in ``disk_dir/sender{i}``."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}: set --update-weight-buffer-size")
        self.options = DiskDeltaOptions(disk_dir=disk_dir, delta_encoding=delta_encoding, base_dir=base_dir,
                                        run_id=run_id, epoch=epoch, sender_index=sender_index)  # validates
        if keep_versions < 2:
            raise ValueError(f"keep_versions {keep_versions}: keep at least the newest version and its base")
        self.bucket_bytes, self.check_equal, self.timeout_s = bucket_bytes, check_equal, timeout_s
        self.encoding, self.keep_versions = delta_encoding, keep_versions
        self._owns_dir = disk_dir is None
        self.root = Path(disk_dir) if disk_dir is not None else Path(tempfile.mkdtemp(prefix="rlplacement-disk-delta-"))
        if sender_index is not None and disk_dir is not None:
            self.root = self.root / f"sender{sender_index}"
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self._held: dict[str, tuple[str, tuple[int, ...], "np.ndarray"]] | None = None
        self._held_sums: dict[str, str] = {}
        self._held_version: int | None = None
        self._endpoint: TransferEndpoint | None = None
        self._scratch = None  # uint8, the largest tensor's size: the xor of the tensor being encoded
        self._spare: dict[str, "np.ndarray"] = {}  # held arrays replaced by the last version, reused
        self._keyframe_next = False
        self.identity = SenderIdentity.fresh(run_id, epoch)
        """This sender's segment, id and signing key; receivers get them through the endpoint's mode_info."""
        self._published = False  # a version of this sender is in the folder (its segment has started)

    # -- protocol
    @property
    def transport(self) -> str:
        """Engines read each version from a shared folder."""
        return "file"

    def listen(self, world_size: int, *, host: str | None = None) -> TransferEndpoint:
        if world_size < 2:
            raise ValueError(f"world_size {world_size}: need the trainer plus at least one engine worker")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f"{folder_format.TMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"
            write_synced(probe, b"")
            probe.unlink()
        except OSError as exc:
            raise TransferError(f"--update-weight-disk-dir {self.root} is not a writable folder: {exc}") from exc
        self._endpoint = TransferEndpoint(MODE, host or "127.0.0.1", 0, world_size, "file", str(self.root.resolve()),
                                          self.timeout_s, self.check_equal, self.identity.mode_info())
        # (re)joining engines may hold anything we sent (a failed update leaves some on the old version)
        self._keyframe_next = bool(self._held_version)
        return self._endpoint

    def connect(self) -> None:
        if self._endpoint is None:
            raise TransferError("connect() before listen(): call listen(world_size) first")
        self._load_base()  # read the base checkpoint now, not inside the first timed update

    def update(self, version: int, named_tensors: Iterable[NamedTensor], *,
               resident: bool = False, hf_shapes: HFShapes | None = None) -> DeltaUpdateReport:
        if self._endpoint is None:
            raise TransferError("update() before listen()/connect()")
        if self._held_version is not None and version <= self._held_version:
            raise TransferError(f"update version {version} is not newer than the last published {self._held_version}")
        start = time.perf_counter()
        self._load_base()
        self._enter_segment(version)
        self._clean_leftovers()
        writer = folder_format.VersionWriter(self.root, version, self.bucket_bytes)
        try:
            index, new_held, (new_sums, checked) = self._write_version(writer, version,
                                                                       hf_shaped(named_tensors, hf_shapes))
            writer.publish(index, self.identity)
        except BaseException as exc:
            writer.discard()
            if isinstance(exc, Exception):
                self._abort(version, f"{type(exc).__name__}: {exc}")
                raise UpdateAborted(f"update to version {version} aborted: {type(exc).__name__}: {exc}") from exc
            raise
        base_version = index["base_version"]
        old_held = self._held or {}
        self._spare = {n: old_held[n][2] for n, held in new_held.items()
                       if n in old_held and held is not old_held[n]}
        self._held, self._held_sums, self._held_version = new_held, new_sums, version
        self._keyframe_next, self._published = False, True
        self._drop_old_versions(version)
        meta = index["metadata"]
        return DeltaUpdateReport(version, len(index["tensors"]), max(1, len(set(index["weight_map"].values()))),
                                 meta["total_bytes"], time.perf_counter() - start,
                                 checked if self.check_equal else None,
                                 changed_bytes=meta["changed_bytes"], wire_bytes=meta["wire_bytes"],
                                 density=meta["density"], encoding=self.encoding, base_version=base_version,
                                 folder=str(self.root / folder_format.version_folder(version)),
                                 transport=self.transport)

    def close(self) -> None:
        self._endpoint = None
        if self._owns_dir:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- internals
    def _abort(self, version: int, reason: str) -> None:
        try:
            folder_format.publish_abort(self.root, version, reason, self.identity)
        except OSError:
            pass  # the receivers then time out instead; the original error matters more

    def _enter_segment(self, version: int) -> None:
        """Start this sender's segment in the folder (its first update there), or check that ``version``
        moves its ``latest`` forward; a refusal names the pointer and stops the receivers at once."""
        pointer = folder_format.read_pointer(self.root)
        ours = pointer is not None and (pointer.get("run_id"), pointer.get("epoch")) == self.identity.segment
        if ours and pointer["version"] >= version:
            reason = (f"update version {version} is not newer than version {pointer['version']} that "
                      f"{self.identity.describe()} already published in {self.root / folder_format.POINTER_NAME}: "
                      f"within a run's epoch versions only go forward (send a higher version; a resume is a new "
                      f"epoch)")
            self._abort(version, reason)
            raise TransferError(reason)
        if ours or (pointer is None and self._published):
            return
        if self._published:  # another run wrote here after this sender's last version
            reason = (f"{self.root / folder_format.POINTER_NAME} now holds version {pointer['version']} of "
                      f"{describe_record(pointer)}, published after this sender's ({self.identity.describe()}) "
                      f"last version: one sender per --update-weight-disk-dir")
            self._abort(version, reason)
            raise TransferError(reason)
        if folder_format.start_segment(self.root):
            self._keyframe_next = True  # the engines may hold anything: another run's, or an earlier epoch's

    def _load_base(self) -> None:
        if self._held is None and self.base_dir is not None:
            self._held = folder_format.read_checkpoint_bytes(self.base_dir)
            self._held_sums = {n: codec.checksum(a) for n, (_, _, a) in self._held.items()}
            self._held_version = 0

    def _write_version(self, writer: folder_format.VersionWriter, version: int, named_tensors: Iterable[NamedTensor]):
        import numpy as np

        from rlplacement.transfer.bucket import dtype_name

        # a delta only on the version just before this one, and only while the engines are known to
        # hold it; otherwise a keyframe that any engine can load
        delta = self._held is not None and self._held_version == version - 1 and not self._keyframe_next
        held = self._held if delta else {}
        readers = folder_format.read_keeps(self.root, self._endpoint.world_size)
        entries: dict[str, dict] = {}
        new_held, new_sums, checked = {}, {}, {}
        total = changed = 0
        for name, tensor in named_tensors:
            if name in entries:
                raise TransferError(f"tensor {name!r} appears twice in one update")
            dtype, shape, new = dtype_name(tensor.dtype), tuple(tensor.shape), host_bytes(tensor)
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
            slices = reader_slices(name, readers)
            if slices:
                itemsize = int(new.size) // max(1, math.prod(shape))
                entry["slice_checksums"] = {key: codec.checksum(codec.cut_bytes(new, shape, itemsize, box))
                                            for key, box in slices.items()}
                checked.update(entry["slice_checksums"])
            if any(kept_box(keeps, name) is None for keeps in readers):  # some reader takes it whole
                checked[name] = entry["checksum"]
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
        return index, new_held, (new_sums, checked)

    def _clean_leftovers(self) -> None:
        """Remove tmp entries of crashed writes and abort markers of earlier versions."""
        for entry in self.root.iterdir():
            if entry.name.startswith(folder_format.TMP_PREFIX) or entry.name.startswith("abort_v"):
                shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def _drop_old_versions(self, newest: int) -> None:
        for entry in self.root.glob("weight_v*"):
            try:
                v = int(entry.name.removeprefix("weight_v"))
            except ValueError:
                continue
            if v <= newest - self.keep_versions:
                shutil.rmtree(entry, ignore_errors=True)
