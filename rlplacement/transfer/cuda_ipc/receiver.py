"""Engine side of ``cuda_ipc``: map the trainer's allocations (direct) or open its slot buffers and
copy each bucket into staging (buckets); acknowledge each step so the trainer knows it may go on."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import BucketManifest, NamedTensor, TransferError, WeightMismatchError, tensor_checksum
from rlplacement.transfer.bucket import FlatBuffers
from rlplacement.transfer.cuda_ipc.buckets import OpenedBuffer
from rlplacement.transfer.cuda_ipc.direct import MappedAllocations
from rlplacement.transfer.cuda_ipc.protocol import (DIRECT_ACK_TAG, KIND_CHECKSUMS, KIND_DIRECT,
                                                    KIND_DIRECT_COMMIT)
from rlplacement.transfer.wire import KIND_ABORT, KIND_END, FramedReceiver

if TYPE_CHECKING:
    import torch


class IpcReceiver(FramedReceiver):
    """One engine worker: open the sender's slot buffers, copy each bucket into staging, acknowledge."""

    mode: ClassVar[str] = "cuda_ipc"
    bucketwise = False  # its own frame loop (direct updates read the trainer's memory and stage nothing)

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        super().__init__(device, version=version)
        self._opened: dict[int, OpenedBuffer] = {}
        self.handles_opened = 0
        self.direct = MappedAllocations(self.device)
        self._held = False  # a direct update is staged: the sender waits for our commit-or-drop ack
        self._read_from: dict[str, int] = {}

    @property
    def read_from(self) -> dict[str, int]:
        """Bytes of the last bucketed update copied out of the sender's slot buffers, by the GPU they are on
        (a direct update reads the trainer rank that sent its manifest: not counted here)."""
        return dict(self._read_from)

    @property
    def staged_hf_shapes(self):
        return self.direct.hf_shapes if self.last_path == "direct" else {}

    @property
    def mapped_allocations(self) -> int:
        return self.direct.num_allocations if self.last_path == "direct" else 0

    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        self._failure = None
        self._read_from = {}
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
        gpu = self._payload_info.get("gpu", "")
        self._read_from[gpu] = self._read_from.get(gpu, 0) + manifest.nbytes

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
