"""Mode ``broadcast_packed``: the ``broadcast`` wire with one broadcast of the whole flat bucket
instead of one per tensor (mixed dtypes share the uint8 buffer; offsets are in the manifest).

The sender packs into two buffers it keeps across updates and alternates between them: bucket
i+1 is packed (before its header is sent) while bucket i is on the wire; a slot is reused only
after its broadcast has completed. The receiver receives straight into its staging buffer, so each bucket costs one
collective and no copy on that side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import BucketManifest, NamedTensor
from rlplacement.transfer.broadcast import BroadcastReceiver, BroadcastSender
from rlplacement.transfer.bucket import pack_into

if TYPE_CHECKING:
    import torch


class PackedBroadcastSender(BroadcastSender):
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


class PackedBroadcastReceiver(BroadcastReceiver):
    mode: ClassVar[str] = "broadcast_packed"

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        if manifest.nbytes:
            self._group.broadcast(buf[:manifest.nbytes])
