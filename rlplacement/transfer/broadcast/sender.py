"""Trainer side of ``broadcast``: each bucket's tensors broadcast one by one after its manifest; where workers
keep slices, each position's slices in its own group (:mod:`rlplacement.transfer.shards`)."""

from __future__ import annotations

from typing import ClassVar

from rlplacement.transfer.base import BucketManifest, NamedTensor
from rlplacement.transfer.bucket import as_bytes
from rlplacement.transfer.shards import regions
from rlplacement.transfer.wire import FramedSender


class BroadcastSender(FramedSender):
    """A sending trainer rank: tensors -> buckets -> manifest + one broadcast per tensor (per slice and position
    where workers keep slices)."""

    mode: ClassVar[str] = "broadcast"
    sends_slices: ClassVar[bool] = True
    groups_per_position: ClassVar[bool] = True

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        """``(regions, slices' checksums or None)`` where workers keep slices, else None (whole tensors)."""
        return regions(bucket, manifest, self._positions, self.check_equal) if self._sliced else None

    def _checksums_sent(self, prepared) -> dict[str, str] | None:
        return prepared[1] if prepared is not None else None

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        if prepared is None:
            for (_, tensor), meta in zip(bucket, manifest.tensors):
                if meta.nbytes:
                    self._group.broadcast(as_bytes(tensor).to(self.wire_device))
            return
        # every position's broadcasts in flight at once (each group orders its own), all done before the next bucket
        in_flight = []
        for group, region in zip(self._payload_groups(), prepared[0]):
            for (_, piece), meta in zip(region.pieces, region.manifest.tensors):
                if meta.nbytes:
                    data = as_bytes(piece).to(self.wire_device)
                    in_flight.append((data, group.broadcast(data, async_op=True)))
        for _, work in in_flight:
            work.wait()
