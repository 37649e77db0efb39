"""Engine side of ``broadcast``: each tensor (or slice) of a bucket received straight into its place in staging."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import BucketManifest
from rlplacement.transfer.wire import FramedReceiver

if TYPE_CHECKING:
    import torch


class BroadcastReceiver(FramedReceiver):
    """One engine worker: stage every bucket into kept buffers, verify, hand over on commit."""

    mode: ClassVar[str] = "broadcast"
    accepts_slices: ClassVar[bool] = True  # its slices arrive in its position's group
    groups_per_position: ClassVar[bool] = True

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        for meta in manifest.tensors:
            if meta.nbytes:
                self._payload_group.broadcast(buf[meta.offset:meta.offset + meta.nbytes])
