"""Engine side of ``p2p``: staging buffers registered once with this worker's TransferEngine (and
unregistered before they are freed); their addresses go to the trainer per bucket, which writes into them."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import BucketManifest, TransferEndpoint
from rlplacement.transfer.p2p import P2PInit
from rlplacement.transfer.p2p.mooncake import MooncakeEngine, RegisteredBuffers, address_toward, session_key
from rlplacement.transfer.wire import FramedReceiver

if TYPE_CHECKING:
    import torch


class P2PReceiver(FramedReceiver):
    """One engine worker: a TransferEngine, staging buffers registered once and written by the trainer."""

    mode: ClassVar[str] = "p2p"

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        super().__init__(device, version=version)
        self._engine: MooncakeEngine | None = None

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        super().connect(endpoint, rank)  # closes the old group, engine and registrations first
        # a fresh engine and fresh registrations: the trainer never writes to an old one
        self._engine = MooncakeEngine(address_toward(endpoint.host), P2PInit(**endpoint.mode_info).protocol)
        self._group._store.set(session_key(endpoint.group_name, rank), self._engine.session)
        # staging lives where the model does, registered at first use, unregistered when it grows or goes
        self.buffers = RegisteredBuffers(self.device, self._engine)

    def release_staging(self) -> int:
        """Kept: the staging is registered with Mooncake and its addresses were given to the trainer
        (p2p runs only in split layouts, where nothing sleeps)."""
        return 0

    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        import torch

        if not manifest.nbytes:
            return
        addresses = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        addresses[self._group.rank] = self._engine.register(buf)
        self._group.all_reduce_sum(addresses)
        landed = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        # the sender's entry says whether the bytes landed; if not, its ABORT frame follows and this
        # staging buffer is dropped with the update
        self._group.all_reduce_sum(landed)

    def close(self) -> None:
        super().close()
        if self._engine is not None:
            self._engine.close()
            self._engine = None
