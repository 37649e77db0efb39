"""Trainer side of ``broadcast``: each bucket's tensors broadcast one by one after its manifest."""

from __future__ import annotations

from typing import ClassVar

from rlplacement.transfer.base import BucketManifest, NamedTensor
from rlplacement.transfer.bucket import as_bytes
from rlplacement.transfer.wire import FramedSender


class BroadcastSender(FramedSender):
    """A sending trainer rank: tensors -> buckets -> manifest + one broadcast per tensor."""

    mode: ClassVar[str] = "broadcast"

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        for (_, tensor), meta in zip(bucket, manifest.tensors):
            if meta.nbytes:
                self._group.broadcast(as_bytes(tensor).to(self.wire_device))
