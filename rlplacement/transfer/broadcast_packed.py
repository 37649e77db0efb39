"""Mode ``broadcast_packed``: the ``broadcast`` wire with one broadcast of the whole flat bucket
instead of one per tensor (mixed dtypes share the uint8 buffer; offsets are in the manifest).

The sender packs into a buffer it keeps across updates; the receiver receives straight into its
staging buffer, so each bucket costs one collective instead of one per tensor.
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

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest) -> None:
        if manifest.nbytes:
            self._group.broadcast(pack_into(self.buffers.get(0, manifest.nbytes), bucket, manifest))


class PackedBroadcastReceiver(BroadcastReceiver):
    mode: ClassVar[str] = "broadcast_packed"

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        if manifest.nbytes:
            self._group.broadcast(buf[:manifest.nbytes])
