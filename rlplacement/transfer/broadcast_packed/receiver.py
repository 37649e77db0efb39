"""Engine side of ``broadcast_packed``: the flat bucket (or this worker's region of it) received straight into
its staging buffer."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import BucketManifest
from rlplacement.transfer.wire import FramedReceiver

if TYPE_CHECKING:
    import torch


class PackedBroadcastReceiver(FramedReceiver):
    mode: ClassVar[str] = "broadcast_packed"
    accepts_slices: ClassVar[bool] = True  # its region arrives in its position's group
    groups_per_position: ClassVar[bool] = True

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        if manifest.nbytes:
            self._payload_group.broadcast(buf[:manifest.nbytes])
