"""Trainer side of ``broadcast_packed``: pack bucket i+1 into the other kept slot while bucket i is
on the wire; a slot is refilled only after its broadcasts completed. Where workers keep slices, the slot
holds one region per position, each broadcast in that position's group (:mod:`rlplacement.transfer.shards`)."""

from __future__ import annotations

from typing import ClassVar

from rlplacement.transfer.base import BucketManifest, NamedTensor
from rlplacement.transfer.bucket import pack_into
from rlplacement.transfer.shards import pack_regions, regions
from rlplacement.transfer.wire import FramedSender


class PackedBroadcastSender(FramedSender):
    mode: ClassVar[str] = "broadcast_packed"
    sends_slices: ClassVar[bool] = True
    groups_per_position: ClassVar[bool] = True
    NUM_SLOTS = 2

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        """Pack into the slot the bucket before last used, once its broadcasts are done. Runs before
        this bucket's header, i.e. while the previous bucket is still on the wire. Returns ``(slot, [(group,
        bytes)], slices' checksums or None)``."""
        if not manifest.nbytes:
            return None
        slot = manifest.index % self.NUM_SLOTS
        for work in self._in_flight.pop(slot, ()):
            work.wait()
        if not self._sliced:
            return slot, [(self._group, pack_into(self.buffers.get(slot, manifest.nbytes), bucket, manifest))], None
        cut_regions, sums = regions(bucket, manifest, self._positions, self.check_equal)
        flat, spans = pack_regions(lambda n: self.buffers.get(slot, n), cut_regions)
        return slot, [(group, flat[base:base + n]) for group, (base, n) in zip(self._payload_groups(), spans)], sums

    def _checksums_sent(self, prepared) -> dict[str, str] | None:
        return prepared[2] if prepared is not None else None

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        if prepared is not None:
            slot, parts, _ = prepared
            self._in_flight[slot] = [group.broadcast(flat, async_op=True) for group, flat in parts if flat.numel()]

    def _drain(self) -> None:
        in_flight = self._in_flight
        while in_flight:
            for work in in_flight.pop(min(in_flight)):
                work.wait()
