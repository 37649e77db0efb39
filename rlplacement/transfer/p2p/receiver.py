"""Engine side of ``p2p``: staging buffers registered once with this worker's TransferEngine (and
unregistered before they are freed); their addresses go to the trainer per bucket, which writes into them."""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import ApplyFn, BucketManifest, NamedTensor, TransferEndpoint, TransferError
from rlplacement.transfer.p2p import KIND_REPLAY, KIND_REPLAYED, P2PInit
from rlplacement.transfer.p2p.mooncake import MooncakeEngine, RegisteredBuffers, address_toward, session_key
from rlplacement.transfer.wire import KIND_ABORT, KIND_END, FramedReceiver

if TYPE_CHECKING:
    import torch


class P2PReceiver(FramedReceiver):
    """One engine worker: a TransferEngine, staging buffers registered once and written by the trainer."""

    mode: ClassVar[str] = "p2p"
    accepts_slices: ClassVar[bool] = True  # the sender writes each worker its own region of a bucket

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        super().__init__(device, version=version)
        self._engine: MooncakeEngine | None = None
        self._given: dict[int, weakref.ref] = {}  # bucket index -> the staging buffer whose address the sender has

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        super().connect(endpoint, rank)  # closes the old group, engine and registrations first; publishes keeps
        # a fresh engine and fresh registrations: the trainer never writes to an old one
        self._engine = MooncakeEngine(address_toward(endpoint.host), P2PInit(**endpoint.mode_info).protocol)
        self._group._store.set(session_key(endpoint.group_name, rank), self._engine.session)
        # staging lives where the model does, registered at first use, unregistered when it grows or goes
        self.buffers = RegisteredBuffers(self.device, self._engine)
        self._given = {}

    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        self._start_update()
        frame = self._recv_frame()
        if frame[0] != KIND_REPLAY:
            return self._stage_buckets(frame)
        if self._answer_replay(self._can_replay(self._end_count)):
            return self._stage_replayed()
        return self._stage_buckets(self._recv_frame())

    def _stream(self, apply_bucket: ApplyFn) -> tuple[int, int, int]:
        """Bucket staging refuses a replay: its two buffers are reused as the model takes each bucket, which
        only the per-bucket exchange paces."""
        self._start_update()
        frame = self._recv_frame()
        if frame[0] == KIND_REPLAY:
            self._answer_replay(False)
            frame = self._recv_frame()
        _, num_tensors, num_buckets, nbytes = self._receive_buckets(frame, apply_bucket)
        return num_tensors, num_buckets, nbytes

    def _answer_replay(self, accept: bool) -> bool:
        """This receiver's answer to a REPLAY offer; True when every receiver accepted."""
        import torch

        refused = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        refused[self._group.rank] = int(not accept)
        self._group.all_reduce_sum(refused)
        return not int(refused.sum())

    def _can_replay(self, count: int) -> bool:
        """Every one of the last update's ``count`` buckets still has its manifest here and, in its staging
        slot, the very buffer whose address the sender learned (still registered, large enough)."""
        for index in range(count):
            entry, given = self._manifests.get(index), self._given.get(index)
            buf = self.buffers.peek(index)
            if (entry is None or given is None or buf is None or given() is not buf
                    or buf.numel() < self._region(entry[0], entry[2])[0].nbytes):
                return False
        return True

    def _stage_replayed(self) -> tuple[list[NamedTensor], int, int]:
        """The replayed buckets, read where they landed once END (or REPLAYED, then bucket by bucket) came."""
        kind, version, blob = self._recv_frame()
        if kind == KIND_ABORT:
            self._on_abort_frame(version, blob)
        if kind not in (KIND_END, KIND_REPLAYED):
            raise TransferError(f"unexpected frame kind {kind} from the trainer during a replay")
        info = json.loads(blob)
        checksums, replayed = info["checksums"], int(info["buckets"])
        staged: list[NamedTensor] = []
        nbytes = 0
        for index in range(replayed):
            manifest = self._manifests[index][0]
            region, boxes = self._region(manifest, checksums)
            tensors = self._unpack(self.buffers.peek(index), region)
            if self._failure is None:
                self._failure = self.first_mismatch(region, tensors, self._where())
            staged.extend(self._as_loaded(tensors, manifest, boxes))
            nbytes += sum(t.nbytes for t in region.tensors)
        if kind == KIND_END:
            self._after_end(len(staged))
            self._slices_landed()
            self.buffers.trim(replayed)
            return staged, replayed, nbytes
        staged, _, num_buckets, nbytes = self._receive_buckets(self._recv_frame(), None,
                                                               (staged, len(staged), replayed, nbytes))
        return staged, num_buckets, nbytes

    def release_staging(self) -> int:
        """Kept: the staging is registered with Mooncake and its addresses were given to the trainer
        (p2p runs only in split layouts, where nothing sleeps)."""
        return 0

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        import torch

        if not self._manifests[manifest.index][0].nbytes:  # the sender's whole bucket, not this worker's region:
            return  # a worker whose region is empty (pieces outside its slices) still joins the exchange
        addresses = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        addresses[self._group.rank] = self._engine.register(buf)
        self._group.all_reduce_sum(addresses)
        if self.buffers.peek(manifest.index) is buf:  # a buffer of its own per bucket: a replay may write here again
            self._given[manifest.index] = weakref.ref(buf)
        landed = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        # the sender's entry says whether the bytes landed; if not, its ABORT frame follows and this
        # staging buffer is dropped with the update
        self._group.all_reduce_sum(landed)

    def close(self) -> None:
        super().close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
