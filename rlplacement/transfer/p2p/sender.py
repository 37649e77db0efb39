"""Trainer side of ``p2p``: pack bucket i+1 into the other registered slot while bucket i's batched
writes fly to every engine worker; a failed or late write aborts the update everywhere. A slot that
grows is unregistered before its memory is let go. Each worker is written only the slices it keeps
(:mod:`rlplacement.transfer.shards`; whole tensors for a worker that keeps none).

Once an update went bucket by bucket, the next one offers to replay it (the package docstring's replay):
the same buckets written to the destinations learned then, with no collective per bucket."""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import DEFAULT_TIMEOUT_S, BucketManifest, HFShapes, NamedTensor
from rlplacement.transfer.bucket import GroupFn, fused_group_of, pack_into, plan_manifest
from rlplacement.transfer.p2p import (DEFAULT_TRANSFER_TIMEOUT_S, KIND_REPLAY, KIND_REPLAYED, P2PInit, P2POptions,
                                     layout_key)
from rlplacement.transfer.p2p.mooncake import SLICE_BYTES, MooncakeEngine, RegisteredBuffers, address_toward, session_key
from rlplacement.transfer.shards import pack_regions, regions
from rlplacement.transfer.wire import KIND_END, AbortUpdate, FramedSender, SentSoFar

if TYPE_CHECKING:
    import torch

POLL_S = 0.0002


class _WriteFailed(AbortUpdate):
    what = "a p2p write failed"


class P2PSender(FramedSender):
    """A sending trainer rank: two registered host (or GPU) slots; writes bucket i while packing bucket i+1."""

    mode: ClassVar[str] = "p2p"
    sends_slices: ClassVar[bool] = True
    NUM_SLOTS = 2

    def __init__(self, bucket_bytes: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: "torch.device | str | None" = None, group_of: GroupFn = fused_group_of,
                 protocol: str = "tcp", transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S):
        import torch

        super().__init__(bucket_bytes, check_equal=check_equal, timeout_s=timeout_s, device=device, group_of=group_of)
        self.options = P2POptions(protocol, transfer_timeout_s)  # validates
        self.protocol, self.transfer_timeout_s = protocol, transfer_timeout_s
        self.backend, self.wire_device = "gloo", torch.device("cpu")  # control only; bytes go by Mooncake
        self.buffers = RegisteredBuffers(self.device, None)  # registered with the engine of each connect
        self._engine: MooncakeEngine | None = None
        self._sessions: list[str] = []
        self._pending: tuple[int, list[tuple[int, int]]] | None = None  # (bucket index, [(rank, batch id)])
        self._plan: list[str] = []  # the last update's buckets (layout_key), each with known destinations
        self._addresses: dict[int, list[int]] = {}  # bucket index -> destination address per group rank
        self._replaying = False  # this update writes to the destinations learned before: no collective

    @property
    def transport(self) -> str:
        """Bytes go by Mooncake writes over its protocol, not over the gloo control group."""
        return f"mooncake {self.protocol}"

    def _mode_info(self) -> dict:
        return dataclasses.asdict(P2PInit(self.protocol))

    def connect(self) -> None:
        super().connect()  # the gloo group and the receivers' keeps: every receiver has published its session id
        e = self._endpoint
        if self._engine is not None:
            self._engine.close()
        self._engine = MooncakeEngine(address_toward(e.host), self.protocol)
        self.buffers.engine = self._engine
        self._sessions = [""] + [self._store.get(session_key(e.group_name, r)).decode() for r in range(1, e.world_size)]
        self._pending = None
        self._plan, self._addresses = [], {}

    def _forget_sent(self) -> None:
        """After an abort a receiver may have dropped its buffers: learn every destination again."""
        super()._forget_sent()
        self._plan, self._addresses = [], {}

    def _send_update(self, version: int, named_tensors, resident: bool, hf_shapes: HFShapes | None = None):
        """Offer to replay the last update's buckets; every receiver accepts, or it goes bucket by bucket."""
        self._replaying = False
        buckets = self._buckets(named_tensors, hf_shapes)
        if self._plan and self._replay_accepted(version):
            return self._replay(version, buckets)
        self._plan = []
        return self._send_buckets(version, buckets, SentSoFar.none(self.check_equal))

    def _replay_accepted(self, version: int) -> bool:
        """One REPLAY frame naming the last update's bucket count, one all-reduce of each receiver's refusal."""
        import torch

        self._send_frame(KIND_REPLAY, version, b"", len(self._plan))
        refused = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        self._group.all_reduce_sum(refused)
        return not int(refused.sum())

    def _replay(self, version: int, buckets):
        """Each bucket whose layout is the last update's straight to the destinations learned then, several
        writes in flight and no collective; then END with the checksums, if on. At the first bucket whose
        layout differs (or one past the last update's), a REPLAYED frame closes the replayed part and the
        rest goes bucket by bucket from there."""
        self._replaying = True  # until the next update: an abort drains without a collective
        sent = SentSoFar.none(self.check_equal)
        for index, bucket in buckets:
            manifest = plan_manifest(index, bucket, self.check_equal)
            if index >= len(self._plan) or layout_key(manifest) != self._plan[index]:
                self._drain()
                self._replaying = False
                self._send_frame(KIND_REPLAYED, version, self._replay_blob(sent), sent.num_tensors)
                del self._plan[index:]
                rest = self._send_buckets(version, itertools.chain([(index, bucket)], buckets), sent)
                return (*rest[:4], "replay")
            prepared = self._prepare_payload(bucket, manifest)
            self._send_payload(bucket, manifest, prepared)
            sent.add(bucket, manifest, self._checksums_sent(prepared))
        self._drain()
        del self._plan[sent.num_buckets:]
        self._send_frame(KIND_END, version, self._replay_blob(sent), sent.num_tensors)
        return sent.num_tensors, sent.num_buckets, sent.nbytes, sent.checksums, "replay"

    @staticmethod
    def _replay_blob(sent: SentSoFar) -> bytes:
        return json.dumps({"buckets": sent.num_buckets, "checksums": sent.checksums}).encode()

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        """Pack into the slot bucket i-1 used (its writes are done), then finish bucket i's writes:
        packing overlaps the writes in flight. Where workers keep slices, the slot holds one region per
        distinct keeps (``shards.region_manifest``), each written to the workers keeping those slices.
        Returns ``(slot bytes, {group rank: (offset in the slot, bytes)}, slices' checksums or None)``."""
        if not manifest.nbytes:
            return None
        slot = manifest.index % self.NUM_SLOTS
        if not self._sliced:
            flat = pack_into(self.buffers.get(slot, manifest.nbytes), bucket, manifest)
            where = {rank: (0, manifest.nbytes) for rank in range(1, self._endpoint.world_size)}
            sums = None
        else:
            cut_regions, sums = regions(bucket, manifest, self._positions, self.check_equal)
            flat, spans = pack_regions(lambda n: self.buffers.get(slot, n), cut_regions)
            where = {rank: span for region, span in zip(cut_regions, spans) for rank in region.ranks}
        if flat.device.type == "cuda":
            import torch

            torch.cuda.current_stream(flat.device).synchronize()  # Mooncake reads it from its own threads
        self._complete_pending()
        return flat, where, sums

    def _checksums_sent(self, prepared) -> dict[str, str] | None:
        return prepared[2] if prepared is not None else None

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        import torch

        if prepared is None:
            return
        flat, where, _ = prepared
        src = self._engine.register(self.buffers.get(manifest.index % self.NUM_SLOTS, flat.numel()))
        if self._replaying:
            addresses = self._addresses[manifest.index]
        else:
            exchanged = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
            self._group.all_reduce_sum(exchanged)
            addresses = self._addresses[manifest.index] = [int(a) for a in exchanged]
            if manifest.index == len(self._plan):
                self._plan.append(layout_key(manifest))
        batches = []
        for rank in range(1, self._endpoint.world_size):
            base, n = where[rank]
            if not n:  # this worker keeps nothing of the bucket (pieces outside its slices)
                continue
            offsets = list(range(0, n, SLICE_BYTES))
            lens = [min(SLICE_BYTES, n - o) for o in offsets]
            dst = int(addresses[rank])
            batch = self._engine.te.batch_transfer_async_write(
                self._sessions[rank], [src + base + o for o in offsets], [dst + o for o in offsets], lens)
            batches.append((rank, batch))
        self._pending = (manifest.index, batches)

    def _complete_pending(self, *, failed: str | None = None) -> None:
        """Wait for the pending bucket's writes, then tell every receiver whether they landed."""
        import torch

        if self._pending is None:
            return
        index, batches = self._pending
        self._pending = None
        deadline = time.monotonic() + self.transfer_timeout_s
        for rank, batch in batches:  # wait for every write even when failing: the slot is reused next
            why = self._wait(batch, deadline)
            if why is not None and failed is None:
                failed = f"engine worker rank {rank}: bucket {index} {why}"
        if not self._replaying:  # replayed: END (or ABORT) says whether every write landed
            landed = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
            landed[0] = int(failed is not None)
            self._group.all_reduce_sum(landed)
        if failed is not None:
            raise _WriteFailed(failed)

    def _wait(self, batch, deadline: float) -> str | None:
        """None once ``batch`` completed, else why not."""
        if batch is None or int(batch) <= 0:
            return f"could not be submitted (batch id {batch})"
        while True:
            status = self._engine.te.get_batch_transfer_status([batch])
            if status == 0:
                return None
            if status < 0:
                return f"failed to write (Mooncake status {status})"
            if time.monotonic() > deadline:
                return f"was not written within --p2p-transfer-timeout {self.transfer_timeout_s:g}s"
            time.sleep(POLL_S)

    def _drain(self) -> None:
        self._complete_pending()

    def _drain_quietly(self) -> None:
        self._complete_pending(failed="the update was aborted")

    def close(self) -> None:
        super().close()
        self._pending = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self.buffers.engine = None
