"""Trainer side of ``broadcast_packed``: pack bucket i+1 into the other kept slot while bucket i is
on the wire; a slot is refilled only after its broadcast completed."""

from __future__ import annotations

from typing import ClassVar

from rlplacement.transfer.base import BucketManifest, NamedTensor
from rlplacement.transfer.bucket import pack_into
from rlplacement.transfer.wire import FramedSender

class PackedBroadcastSender(FramedSender):
    mode: ClassVar[str] = "broadcast_packed"
    NUM_SLOTS = 2

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        """Pack into the slot the bucket before last used, once its broadcast is done. Runs before
        this bucket's header, i.e. while the previous bucket is still on the wire."""
        if not manifest.nbytes:
            return None
        slot = manifest.index % self.NUM_SLOTS
        if slot in self._in_flight:
            self._in_flight.pop(slot).wait()
        return slot, pack_into(self.buffers.get(slot, manifest.nbytes), bucket, manifest)

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        if prepared is not None:
            slot, flat = prepared
            self._in_flight[slot] = self._group.broadcast(flat, async_op=True)

    def _drain(self) -> None:
        in_flight = self._in_flight
        while in_flight:
            in_flight.pop(min(in_flight)).wait()
