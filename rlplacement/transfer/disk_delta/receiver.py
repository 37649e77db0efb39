"""The engine side of disk-delta: wait for version N in the folder (:mod:`.folder_format`), verify
it, stage base + delta, commit (the staging and version plumbing is :class:`StagingReceiver`'s).

Rules: a receiver takes only what its own sender published (the pointer and abort markers carry the
sender's run, epoch and id; every index is signed with the key it got at connect: anything else is
refused naming the file). xor applies only on its base version of the same segment (anything else
is refused before decoding; a keyframe has no base, so an engine kept from an earlier epoch takes
the new segment's first version); overwrite applies on any held bytes and is accepted when every
resulting tensor's checksum equals the version's (so re-applying it is harmless). Every payload's checksum is checked before
decoding and every result's after: corruption is refused naming the tensor, and nothing reaches
the model before ``commit``. The receiver keeps a host copy of the bytes it serves (vLLM CPU
repacks its linear layers, so the model's own parameters cannot serve as the base). A worker that keeps
slices (``transfer.shards``) decodes, checks (against the index's ``slice_checksums``) and holds only those:
its host copy is its share of the model, and decoding a slice holds a few rows of its tensor at a time
(``delta_codec.decode_slice``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from rlplacement.errors import DeltaDecodeError
from rlplacement.transfer import delta_codec as codec
from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, ApplyFn, NamedTensor, TransferEndpoint, TransferError,
                                       WeightMismatchError)
from rlplacement.transfer.disk_delta import folder_format
from rlplacement.transfer.disk_delta import MODE
from rlplacement.transfer.disk_delta.signing import SenderIdentity
from rlplacement.transfer.shards import kept_box, keeps_to_json, region_key
from rlplacement.transfer.slice_tensor import as_whole
from rlplacement.transfer.staging import StagingReceiver

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger(__name__)

# (folder, rank) -> (version, held bytes, held checksums, segment) of the last commit in this process: a
# receiver rebuilt on reconnect (the vLLM backend makes a new one per init) adopts it.
_COMMITTED: dict[tuple[str, int], tuple[int, dict, dict, tuple[str, int] | None]] = {}


class DiskDeltaReceiver(StagingReceiver):
    """One engine worker: wait for version N in the folder, verify, stage base + delta, commit."""

    mode: ClassVar[str] = MODE
    not_joined: ClassVar[str] = "the engine has not joined a disk-delta folder"
    accepts_slices: ClassVar[bool] = True  # reads its slices of each version and holds only those

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0,
                 base_dir: str | os.PathLike | None = None):
        """``base_dir``: the HF checkpoint this engine started from (version 0); None uses the one the
        version's index names (``base_checkpoint``), which suits a shared filesystem."""
        super().__init__(device, version=version)
        self.base_dir = Path(base_dir) if base_dir is not None else None
        self.root: Path | None = None
        self._group = None  # no process group; kept for callers that print the group's rank
        self._timeout_s = DEFAULT_TIMEOUT_S
        self._held: dict[str, tuple[str, tuple[int, ...], "np.ndarray"]] | None = None
        self._held_sums: dict[str, str] = {}
        self._staged_held: tuple[dict, dict] | None = None  # what ``commit`` makes the held bytes
        self.last_index: dict | None = None
        self.identity: SenderIdentity | None = None  # the sender of the endpoint this receiver joined
        self._segment: tuple[str, int] | None = None  # (run_id, epoch) of the version served; None: the checkpoint
        self._staged_segment: tuple[str, int] | None = None
        self._sliced: dict[str, tuple] = {}  # of the version staged last: name -> (box, HF shape)

    def _joined(self) -> bool:
        return self.root is not None

    def _where(self) -> str:
        return f"disk-delta receiver rank {self.rank}"

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        self._check_endpoint(endpoint, rank)
        root = Path(endpoint.group_name)
        if not root.is_dir():
            raise TransferError(f"--update-weight-disk-dir {root} is not a folder this engine can read "
                                f"(disk-delta needs a folder shared by the trainer and the engines)")
        self.identity = SenderIdentity.from_mode_info(endpoint.mode_info, f"disk-delta receiver rank {rank}")
        self.root, self._timeout_s = root, endpoint.timeout_s
        self._publish_keeps(root, rank)
        cached = _COMMITTED.get((str(root), rank))
        if self._held is None and cached is not None and cached[0] == self._version:
            _, self._held, self._held_sums, self._segment = cached

    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        folder = folder_format.wait_for_version(self.root, self._pending, self._timeout_s, self.identity)
        index = folder_format.read_index(folder, self._pending, self._version, self.identity)
        base, segment = index.get("base_version"), (index["run_id"], index["epoch"])
        if index["delta_encoding"] == "xor" and base is not None:
            if base != self._version:
                raise TransferError(f"{self._where()}: version {self._pending} is an xor delta on version {base}, "
                                    f"but this engine serves version {self._version}; xor applies exactly once, "
                                    f"on its base")
            if base != 0 and self._segment != segment:  # version 0 is the checkpoint, the same in every segment
                raise TransferError(f"{self._where()}: version {self._pending} is an xor delta on version {base} of "
                                    f"run {segment[0]} epoch {segment[1]}, but this engine's version {self._version} "
                                    f"is of {self._describe_segment()}; xor applies only on its own base")
        staged, held, sums, stored_bytes = self._decode(folder, index)
        self._staged_held, self._staged_segment, self.last_index = (held, sums), segment, index
        return staged, len(set(index["weight_map"].values())), stored_bytes

    def _publish_keeps(self, root: Path, rank: int) -> None:
        """Tell the sender which slices this worker keeps (``DIR/keeps.rank{r}.json``); a worker that keeps
        none removes an older run's file, if any. A folder this engine cannot write to leaves it taking whole
        tensors (a warning says so): engines that only read the folder still work."""
        path = root / folder_format.keeps_file(rank)
        try:
            if self.keeps:
                folder_format.publish_file(root, path.name, keeps_to_json(self.keeps).encode())
            else:
                path.unlink(missing_ok=True)
        except OSError as exc:
            if self.keeps:
                logger.warning("disk-delta receiver rank %s takes whole tensors: cannot publish its slices in %s "
                               "(%s)", rank, root, exc)
                self.keeps = None

    @property
    def sliced(self) -> dict[str, tuple]:
        return self._sliced

    @property
    def staging_bytes(self) -> int:
        """The host copy of the served bytes kept for the next delta (a worker's slices where it keeps them)."""
        return sum(int(a.size) for _, _, a in (self._held or {}).values())

    def on_committed(self, version: int) -> None:
        super().on_committed(version)
        held_and_sums, self._staged_held = self._staged_held, None
        self._held, self._held_sums = held_and_sums
        self._segment = self._staged_segment
        _COMMITTED[(str(self.root), self.rank)] = (version, *held_and_sums, self._segment)

    def _describe_segment(self) -> str:
        if self._segment is None:
            return "the checkpoint" if self._version == 0 else "an unknown run (this receiver did not load it)"
        return f"run {self._segment[0]} epoch {self._segment[1]}"

    def abort(self) -> None:
        super().abort()
        self._staged_held = None

    def close(self) -> None:
        self.root = None

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
        # only this version's tensors: one of several senders' folders holds its share of the model
        names = set(index["tensors"])
        self._held = folder_format.read_checkpoint_bytes(base_dir, names=names, keeps=self.keeps)
        self._held_sums = {}
        return self._held

    def _held_sum(self, name: str, held: dict) -> str:
        if name not in self._held_sums:
            self._held_sums[name] = codec.checksum(held[name][2])
        return self._held_sums[name]

    def _decode(self, folder: Path, index: dict):
        """Verify and decode every tensor of ``index`` on the held bytes: (staged, held, sums, stored bytes)."""
        import torch

        from rlplacement.transfer.bucket import dtype_from_name

        held = self._base_for(index)
        payloads = folder_format.read_payloads(folder, index)
        staged, new_held, new_sums = [], {}, {}
        stored_bytes = 0
        where = f"{self._where()}, version {index['version']}"
        self._sliced, self.verified_checksums = {}, None
        checked: dict[str, str] = {}
        for name, e in index["tensors"].items():
            dtype, shape, want = e["dtype"], tuple(e["shape"]), e["checksum"]
            box = kept_box(self.keeps, name)
            if box is not None:
                want = (e.get("slice_checksums") or {}).get(region_key(name, box))
                if want is None:
                    raise TransferError(f"{where}: the index has no checksum of this worker's slice "
                                        f"{region_key(name, box)} (the trainer read no slices of this worker when "
                                        f"it wrote the version: was {self.root} written for other engines?)")
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
                # a slice's base is checked through its result's checksum: the index sums whole bases
                if box is None and e["encoding"] == "xor" and e.get("base_checksum") and (
                        base is None or self._held_sum(name, held) != e["base_checksum"]):
                    raise TransferError(f"{where}: tensor {name!r} differs from the xor delta's base "
                                        f"(version {index['base_version']}); refusing to apply it")
                try:
                    if box is None:
                        data = codec.decode(e["encoding"], payload, base[2] if base is not None else None,
                                            int(e["nbytes"]), e)
                    else:
                        itemsize = dtype_from_name(dtype).itemsize
                        data = codec.decode_slice(e["encoding"], payload, base[2] if base is not None else None,
                                                  int(e["nbytes"]), e, shape, itemsize, box)
                except DeltaDecodeError as exc:
                    raise TransferError(f"{where}: tensor {name!r} does not decode: {exc}") from exc
                got = codec.checksum(data)
                if got != want:
                    raise WeightMismatchError(name, want, got, where)
            kept_shape = shape if box is None else tuple(b - a for a, b in box)
            new_held[name], new_sums[name] = (dtype, kept_shape, data), want
            checked[region_key(name, box)] = want
            tensor = (torch.from_numpy(data).view(dtype_from_name(dtype)).view(kept_shape) if data.size
                      else torch.empty(kept_shape, dtype=dtype_from_name(dtype)))  # a piece outside the slice
            if self.device.type != "cpu":
                tensor = tensor.to(self.device)
            if box is not None:
                self._sliced[name] = (box, shape)
                tensor = as_whole(tensor, box, shape, name)
            staged.append((name, tensor))
        if self.keeps:  # what this worker checked stands for what it serves (a sliced tensor cannot be hashed whole)
            self.verified_checksums = checked
        return staged, new_held, new_sums, stored_bytes
