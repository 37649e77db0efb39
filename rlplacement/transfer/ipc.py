"""Mode ``cuda_ipc``: the colocated path (``--colocate``): trainer rank 0 and the engine workers
share the GPU(s), so a bucket is handed over as a memory handle instead of being sent.

Per bucket the sender packs the flat buffer (``bucket.pack_into``) into one of two exportable
slot buffers (``shared_buffers.SharedSlots``: CUDA IPC on GPU, a /dev/shm mapping on CPU) and
broadcasts the bucket's JSON manifest with the slot's handle descriptor; each receiver opens the
handle (once per slot buffer, kept open across buckets and updates), copies the bucket into its
own staging buffer, checks checksums, and acknowledges. The sender refills a slot only after
every receiver acknowledged the bucket last in it, so packing bucket i+1 overlaps the receivers
copying bucket i.

Control channel: the private gloo group of ``group.py`` (manifests as broadcasts from rank 0,
acknowledgements as one small all-reduce per bucket: an int32 per rank, non-zero where that
rank failed; a direct update's as one int32 message from each receiver, half an all-reduce's
latency). It is CPU-side, so it works on both devices; NCCL is not an option here anyway, since
it refuses two ranks on one GPU, and a Ray round-trip per bucket would cost ~ms. Every wait is
bounded by the group's timeout, and a dead peer breaks the group at once.

All or nothing across engines: a receiver that fails on a bucket (cannot open the handle, copy
fails, checksum differs) keeps acknowledging with its failure flag set; the sender then stops
and broadcasts ABORT, so every engine keeps its previous version whole and the group stays
usable. The failing receiver raises its own error, the others ``UpdateAborted`` naming its rank.

Direct path (``ipc_direct``): when the trainer's tensors are resident (``update(..., resident=True)``)
and exportable, one DIRECT frame carries a manifest of the trainer's own allocations instead of
buckets. Receivers map them, verify (with check_equal the trainer sends its checksums in a frame of
their own after the manifest, so both sides hash at once), and acknowledge (all or nothing, as above); after END each
receiver commits straight from the trainer's memory, unmaps, and acknowledges once more, and only
then does the sender's ``update`` return: the trainer's weights must not change or be freed while
an engine reads them. A receiver that drops the staged update instead (``abort``, a refused
validation) acknowledges with its failure flag; the sender raises ``UpdateRefused`` naming it,
while the others serve the new version.

Steady state (``KIND_DIRECT_COMMIT``): when the manifest is the one every receiver mapped and kept
at the last update (``keep_mapped``, nothing moved, no checksums to compare), there is nothing left
that could fail for one receiver and not another before the commit, so the first round (map,
acknowledge, END) is skipped: receivers commit at once and acknowledge once. A receiver that still
cannot commit keeps its version and says so in that acknowledgement (``UpdateRefused``, as above).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, BucketManifest, NamedTensor, TransferError,
                                       UpdateRefused, WeightMismatchError, tensor_checksum)
from rlplacement.transfer.broadcast import (KIND_ABORT, KIND_END, BroadcastReceiver, BroadcastSender,
                                            _AbortUpdate, _guard)
from rlplacement.transfer.bucket import FlatBuffers, GroupFn, fused_group_of, pack_into
from rlplacement.transfer.ipc_direct import AllocationExports, MappedAllocations
from rlplacement.transfer.shared_buffers import OpenedBuffer, SharedSlots

KIND_DIRECT = 4  # a manifest of the trainer's own allocations instead of buckets
KIND_CHECKSUMS = 5  # after a direct manifest, with check_equal: the trainer's per-tensor checksums
KIND_DIRECT_COMMIT = 6  # the manifest every receiver holds mapped: commit at once, acknowledge once
DIRECT_ACK_TAG = 6  # a direct update's acknowledgements: one int32 from each receiver to the sender

if TYPE_CHECKING:
    import torch


class _ReceiversFailed(_AbortUpdate):
    what = "a receiver could not stage it"


def _failed_ranks(status: "torch.Tensor") -> list[int]:
    return [rank for rank, flag in enumerate(status.tolist()) if flag]


@dataclasses.dataclass
class _Ack:
    work: object
    status: "torch.Tensor"
    index: int


class IpcSender(BroadcastSender):
    """Trainer rank 0 under --colocate: one exported buffer per slot, two slots, one handle each."""

    mode: ClassVar[str] = "cuda_ipc"
    NUM_SLOTS = 2

    def __init__(self, buffer_size: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: "torch.device | str | None" = None, group_of: GroupFn = fused_group_of):
        import torch

        super().__init__(buffer_size, check_equal=check_equal, timeout_s=timeout_s, device=device, group_of=group_of)
        self.backend, self.wire_device = "gloo", torch.device("cpu")  # control only; bytes go by handle
        self.buffers = SharedSlots(self.device, min_nbytes=buffer_size)
        self.exports = AllocationExports(self.device) if self.device.type == "cuda" else None
        self._direct_sent: bytes | None = None  # the direct manifest every receiver holds
        self._direct_kept: bytes | None = None  # the direct manifest every receiver mapped and kept mapped
        self.last_direct_rounds = 0  # acknowledgement rounds of the last direct update (2, or 1 when kept)

    def connect(self) -> None:
        super().connect()
        self._direct_sent = self._direct_kept = None

    def keep_mapped_between_updates(self) -> bool:
        if self.exports is None:  # on CPU the direct path does not run: nothing is mapped elsewhere
            return False
        self.exports.keep_mapped = True
        return True

    @property
    def mapped_elsewhere(self) -> bool:
        return self.exports is not None and self.exports.mapped_elsewhere

    def receivers_unmapped(self) -> None:
        if self.exports is not None:
            self.exports.mapped_elsewhere = False

    def _forget_sent(self) -> None:
        super()._forget_sent()
        self._direct_sent = self._direct_kept = None

    def _send_update(self, version: int, named_tensors, resident: bool, hf_shapes=None):
        if not resident or self.exports is None:
            return super()._send_update(version, named_tensors, resident, hf_shapes)
        tensors = list(_guard(named_tensors))  # resident: listing them holds no extra memory
        self.instants.mark("listed")
        blob, self.fallback = self.exports.manifest(tensors, hf_shapes)
        if blob is None:
            return super()._send_update(version, tensors, resident, hf_shapes)
        import torch

        self.instants.mark("manifest")
        torch.cuda.synchronize(self.device)  # the optimizer's last kernels have written what engines read
        self.instants.mark("synced")
        # the receivers still hold every mapping of this manifest unless the trainer was told they let go
        kept = blob is self._direct_kept and self.exports.mapped_elsewhere
        self.exports.mapped_elsewhere = self.exports.mapped_elsewhere or self.exports.keep_mapped
        if kept and not self.check_equal:
            return self._commit_at_once(version, tensors)
        self._direct_kept, self.last_direct_rounds = None, 2
        self._send_frame(KIND_DIRECT, version, b"" if blob is self._direct_sent else blob, len(tensors))
        self._direct_sent = blob
        self.instants.mark("direct_sent")
        checksums = None
        if self.check_equal:  # hashed here while every receiver hashes what it mapped: one pass of wall time
            checksums = {n: tensor_checksum(t) for n, t in tensors}
            self._send_frame(KIND_CHECKSUMS, version, json.dumps(checksums).encode(), len(tensors))
        failed = _failed_ranks(self._direct_acks())
        self.instants.mark("mapped_acked")
        if failed:
            raise _ReceiversFailed(f"engine worker rank(s) {', '.join(map(str, failed))} could not map or "
                                   f"verify the trainer's weights")
        self._send_frame(KIND_END, version, b"", len(tensors))
        self._direct_kept = blob if self.exports.keep_mapped else None
        return self._committed(version, tensors, checksums)

    def _commit_at_once(self, version: int, tensors: list[NamedTensor]):
        """The steady-state direct update: one frame, one acknowledgement (see the module docstring)."""
        self.last_direct_rounds = 1
        self._send_frame(KIND_DIRECT_COMMIT, version, b"", len(tensors))
        self.instants.mark("direct_sent")
        return self._committed(version, tensors, None)

    def _committed(self, version: int, tensors: list[NamedTensor], checksums):
        failed = _failed_ranks(self._direct_acks())  # each receiver committed (or dropped) and unmapped (or kept)
        self.instants.mark("committed_acked")
        if failed:
            self._direct_kept = None  # a receiver that failed may not hold every mapping any more
            raise UpdateRefused(f"engine worker rank(s) {', '.join(map(str, failed))} did not commit update "
                                f"{version} from the trainer's memory and keep their previous version; the "
                                f"other engines serve {version}")
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        return len(tensors), 1, nbytes, checksums, "direct"

    def _direct_acks(self) -> "torch.Tensor":
        """Every receiver's flag (non-zero: failed), one message each (the bucket path's per-bucket
        acknowledgements are all-reduces, overlapped with packing; here nothing overlaps them)."""
        import torch

        status = torch.zeros(self._endpoint.world_size, dtype=torch.int32)
        works = [self._group.recv(status[rank:rank + 1], rank, DIRECT_ACK_TAG) for rank in range(1, status.numel())]
        for work in works:
            work.wait()
        return status

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        if not manifest.nbytes:
            return None
        slot = manifest.index % self.NUM_SLOTS
        self._wait_ack(slot)
        buf, desc = self.buffers.get(slot, manifest.nbytes)
        pack_into(buf, bucket, manifest)
        if buf.device.type == "cuda":
            import torch

            torch.cuda.current_stream(buf.device).synchronize()  # receivers read it from another process
        return slot, desc

    def _manifest_wire(self, manifest: BucketManifest, prepared) -> dict:
        wire = manifest.to_wire()
        if prepared is not None:
            slot, desc = prepared
            wire["payload"] = {**desc, "slot": slot}
        return wire

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        import torch

        if prepared is None:
            return
        status = torch.zeros(self._endpoint.world_size, dtype=torch.int32)
        self._in_flight[prepared[0]] = _Ack(self._group.all_reduce_sum(status, async_op=True), status, manifest.index)

    def _wait_ack(self, slot: int) -> None:
        ack = self._in_flight.pop(slot, None)
        if ack is None:
            return
        ack.work.wait()
        failed = _failed_ranks(ack.status)
        if failed:
            raise _ReceiversFailed(f"engine worker rank(s) {', '.join(map(str, failed))} failed on bucket {ack.index}")
        self.buffers.release(slot)  # every receiver has it open: its name may go

    def _drain(self) -> None:
        for slot in sorted(self._in_flight, key=lambda s: self._in_flight[s].index):
            self._wait_ack(slot)

    def _drain_quietly(self) -> None:
        acks, self._in_flight = self._in_flight, {}
        for ack in sorted(acks.values(), key=lambda a: a.index):
            ack.work.wait()

    def close(self) -> None:
        super().close()
        self._in_flight = {}
        self.buffers.close()
        if self.exports is not None:
            self.exports.close()


class IpcReceiver(BroadcastReceiver):
    """One engine worker: open the sender's slot buffers, copy each bucket into staging, acknowledge."""

    mode: ClassVar[str] = "cuda_ipc"

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        super().__init__(device, version=version)
        self._opened: dict[int, OpenedBuffer] = {}
        self.handles_opened = 0
        self.direct = MappedAllocations(self.device)
        self._held = False  # a direct update is staged: the sender waits for our commit-or-drop ack

    @property
    def staged_hf_shapes(self):
        return self.direct.hf_shapes if self.last_path == "direct" else {}

    @property
    def mapped_allocations(self) -> int:
        return self.direct.num_allocations if self.last_path == "direct" else 0

    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        self._failure = None
        self.verified_checksums = None  # set again only by a checked direct update
        kind, version, blob = frame = self._recv_frame()
        self.instants.mark("first_frame")
        if kind == KIND_DIRECT_COMMIT:
            return self._stage_kept()
        if kind != KIND_DIRECT:
            self.last_path = "buckets"
            return self._stage_buckets(frame)
        self.last_path = "direct"
        staged: list[NamedTensor] = []
        self.verified_checksums = None
        try:
            self.direct.parse(blob)
            staged = self.direct.map()
        except Exception as exc:  # noqa: BLE001 - reported through the ack, raised at ABORT
            self._failure = exc
        self.instants.mark("mapped")
        if self._endpoint.check_equal:
            self._verify_direct(staged)
        self._ack_direct(self._failure is not None)
        kind, version, blob = self._recv_frame()
        self.instants.mark("end_frame")
        if kind != KIND_END:
            self._unmap_quietly()
            if kind == KIND_ABORT:
                self._on_abort_frame(version, blob)
            raise TransferError(f"unexpected frame kind {kind} from the trainer after a direct manifest")
        self._held = True  # from here on, commit or abort answers the sender exactly once
        self._after_end(len(staged))
        return staged, 1, sum(m.nbytes for m in self.direct.metas)

    def _stage_kept(self) -> tuple[list[NamedTensor], int, int]:
        """The manifest held and mapped since the last update, committed at once: from here on, commit or
        abort answers the sender exactly once (a failure below aborts, which acknowledges it)."""
        self.last_path = "direct"
        self.verified_checksums = None
        self._held = True
        self.direct.parse(b"")
        staged = self.direct.map()  # kept mappings: the same views, nothing opened
        self.instants.mark("mapped")
        self._after_end(len(staged))
        return staged, 1, sum(m.nbytes for m in self.direct.metas)

    def _verify_direct(self, staged: list[NamedTensor]) -> None:
        """Hash what this receiver mapped (while the trainer hashes its tensors), then compare with the
        trainer's checksums frame; the first difference fails this receiver's ack. The hashes are kept
        (``verified_checksums``): the trainer cannot change those bytes before this update is released."""
        got = None
        if self._failure is None:
            try:
                got = {n: tensor_checksum(t) for n, t in staged}
            except Exception as exc:  # noqa: BLE001 - reported through the ack
                self._failure = exc
        kind, version, blob = self._recv_frame()  # always read: the frame is on the wire for every rank
        if kind != KIND_CHECKSUMS:
            self._unmap_quietly()
            raise TransferError(f"expected the trainer's checksums after a direct manifest, got frame kind {kind}")
        if got is None:
            return
        want = json.loads(blob)
        for name, checksum in got.items():
            if want.get(name) != checksum:
                self._failure = WeightMismatchError(name, want.get(name, "<missing>"), checksum, self._where())
                return
        self.verified_checksums = got

    def commit(self, apply) -> int:
        if not self._held:
            return super().commit(apply)
        committed = False
        try:
            version = super().commit(apply)  # copies straight out of the trainer's memory
            committed = True
        finally:
            self._release(failed=not committed)
        return version

    def abort(self) -> None:
        super().abort()
        if self._held:
            self._release(failed=True)

    def _release(self, failed: bool) -> None:
        """Unmap the trainer's memory (after every copy out of it finished), then tell the sender."""
        self._held = False
        error = None
        try:
            self.direct.finish()
        except TransferError as exc:
            failed, error = True, exc
        self.instants.mark("released")
        self._ack_direct(failed)
        self.instants.mark("release_acked")
        if error is not None:
            raise error

    def unmap(self) -> int:
        """Unmap the trainer's allocations kept between updates (``keep_mapped``), so the trainer may
        free them; returns how many were mapped. Only between updates."""
        if self._held:
            raise TransferError("unmap() while a direct update is staged: commit or abort it first")
        mapped = self.direct.num_mapped
        self.direct.close()
        return mapped

    def _unmap_quietly(self) -> None:
        try:
            self.direct.close()
        except TransferError:
            pass

    def connect(self, endpoint, rank: int) -> None:
        super().connect(endpoint, rank)  # closes the previous group and handles first
        if self.buffers.device != self.device:
            self.buffers = FlatBuffers(self.device)  # staging lives where the model does

    def _open(self, info: dict) -> OpenedBuffer:
        slot = int(info["slot"])
        cur = self._opened.get(slot)
        if cur is not None and cur.key == info["key"]:
            return cur
        if cur is not None:
            cur.close()
        self._opened[slot] = cur = OpenedBuffer(info, self.device)
        self.handles_opened += 1
        return cur

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        if self._payload_info is None:
            raise TransferError(f"bucket {manifest.index} came without a shared-buffer handle")
        self._open(self._payload_info).copy_to(buf, manifest.nbytes)

    def _ack_direct(self, failed: bool) -> None:
        import torch

        self._group.send(torch.tensor([int(failed)], dtype=torch.int32), 0, DIRECT_ACK_TAG)

    def _ack(self, failed: bool) -> None:
        import torch

        status = torch.zeros(self._endpoint.world_size, dtype=torch.int32)
        status[self._group.rank] = int(failed)
        self._group.all_reduce_sum(status)

    def _take_bucket(self, buf: "torch.Tensor", manifest: BucketManifest) -> list[NamedTensor]:
        """Copy and verify the bucket, then acknowledge it with this rank's failure flag: after a
        failure the sender sends ABORT, and this rank raises its own error there."""
        tensors = self._unpack(buf, manifest)
        if manifest.nbytes:
            if self._failure is None:
                try:
                    self._recv_payload(buf, manifest)
                    mismatch = self.first_mismatch(manifest, tensors, self._where())
                    if mismatch is not None:
                        raise mismatch
                except Exception as exc:  # noqa: BLE001 - reported through the ack, raised at ABORT
                    self._failure = exc
            self._ack(self._failure is not None)
        return tensors

    def _on_abort_frame(self, version: int, blob: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        super()._on_abort_frame(version, blob)

    def _after_end(self, num_staged: int) -> None:
        if self._failure is not None:
            raise self._failure
        super()._after_end(num_staged)

    def close(self) -> None:
        super().close()  # never waits on peers: a held direct update is unmapped, not acknowledged
        for opened in self._opened.values():
            opened.close()
        self._opened = {}
        self._held = False
        self._unmap_quietly()
        self.direct.forget()
