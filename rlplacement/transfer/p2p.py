"""Mode ``p2p``: the trainer writes each bucket straight into every engine worker's staging memory
with the Mooncake Transfer Engine (RDMA in production, TCP where RDMA is missing: the same protocol).

Control runs over the private gloo group of ``group.py`` (as ``cuda_ipc``); bytes go by Mooncake.
Per bucket, in the same order on every rank:

1. the sender broadcasts the bucket's header and manifest (the ``broadcast`` wire);
2. every receiver takes its staging buffer for the bucket (kept across updates, registered with
   its TransferEngine once) and all ranks sum an int64 vector holding each receiver's address:
   the sender learns where to write (an engine restarted since registers fresh memory, and its
   new address is what gets written to: never a stale registration);
3. the sender issues one batched asynchronous write per receiver (the bucket in slices), packs the
   next bucket into its other registered slot while they fly, then waits for every write;
4. all ranks sum a status vector: the sender's entry is non-zero when a write failed or did not
   finish within ``--p2p-transfer-timeout``; it then sends ABORT, so every engine keeps its
   previous version and the trainer raises naming the engine worker and the bucket.

Receivers verify checksums (``--check-weight-update-equal``) and commit through the same
stage-then-commit path as the other modes. Session ids (``ip:port``, metadata ``P2PHANDSHAKE``:
no metadata server) are exchanged once per group through the group's rendezvous store.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, ClassVar

from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, BucketManifest, NamedTensor, TransferEndpoint,
                                       TransferError)
from rlplacement.transfer.broadcast import BroadcastReceiver, BroadcastSender, _AbortUpdate
from rlplacement.transfer.bucket import FlatBuffers, GroupFn, fused_group_of, pack_into
from rlplacement.transfer.options import DEFAULT_P2P_TRANSFER_TIMEOUT_S, P2P_PROTOCOLS, P2POptions

if TYPE_CHECKING:
    import torch

PROTOCOLS = P2P_PROTOCOLS
SLICE_BYTES = 8 << 20  # one bucket goes as slices of this size in one batch (Mooncake runs them concurrently)
POLL_S = 0.0002


class _WriteFailed(_AbortUpdate):
    what = "a p2p write failed"


def rdma_device_present() -> bool:
    """True when this host has an RDMA device (what ``--p2p-protocol`` defaults to ``rdma`` on)."""
    root = "/sys/class/infiniband"
    return os.path.isdir(root) and bool(os.listdir(root))


def address_toward(host: str) -> str:
    """This host's address on the interface that reaches ``host`` (loopback for a loopback peer)."""
    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


class _Engine:
    """One Mooncake TransferEngine and the memory it registered (unregistered on close)."""

    def __init__(self, host: str, protocol: str):
        from mooncake.engine import TransferEngine

        if protocol not in PROTOCOLS:
            raise TransferError(f"--p2p-protocol {protocol!r} is unknown: use one of {', '.join(PROTOCOLS)}")
        self.te = TransferEngine()
        rc = self.te.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise TransferError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned "
                                f"{rc}" + ("; without an RDMA device use --p2p-protocol tcp" if protocol == "rdma" else ""))
        self.session = f"{host}:{self.te.get_rpc_port()}"
        self.registered: dict[int, int] = {}  # address -> bytes

    def register(self, tensor: "torch.Tensor") -> int:
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if self.registered.get(ptr) != nbytes:
            if ptr in self.registered:
                self.te.unregister_memory(ptr)
            rc = self.te.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory of {nbytes} bytes returned {rc}")
            self.registered[ptr] = nbytes
        return ptr

    def close(self) -> None:
        for ptr in list(self.registered):
            try:
                self.te.unregister_memory(ptr)
            except Exception:  # noqa: BLE001 - closing must not hide the error that led here
                pass
        self.registered = {}


def _session_key(group_name: str, rank: int) -> str:
    return f"rlplacement/{group_name}/p2p-session/{rank}"


class P2PSender(BroadcastSender):
    """Trainer rank 0: two registered host (or GPU) slots; writes bucket i while packing bucket i+1."""

    mode: ClassVar[str] = "p2p"
    NUM_SLOTS = 2

    def __init__(self, buffer_size: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: "torch.device | str | None" = None, group_of: GroupFn = fused_group_of,
                 protocol: str = "tcp", transfer_timeout_s: float = DEFAULT_P2P_TRANSFER_TIMEOUT_S):
        import torch

        super().__init__(buffer_size, check_equal=check_equal, timeout_s=timeout_s, device=device, group_of=group_of)
        self.options = P2POptions(protocol, transfer_timeout_s)  # validates
        self.protocol, self.transfer_timeout_s = protocol, transfer_timeout_s
        self.backend, self.wire_device = "gloo", torch.device("cpu")  # control only; bytes go by Mooncake
        self.buffers = FlatBuffers(self.device)
        self._engine: _Engine | None = None
        self._sessions: list[str] = []
        self._pending: tuple[int, list[tuple[int, int]]] | None = None  # (bucket index, [(rank, batch id)])

    def listen(self, world_size: int, *, host: str | None = None) -> TransferEndpoint:
        endpoint = super().listen(world_size, host=host)
        self._endpoint = endpoint = TransferEndpoint.from_dict({**endpoint.to_dict(), "p2p_protocol": self.protocol})
        return endpoint

    def connect(self) -> None:
        super().connect()  # the gloo group: every receiver has published its session id by now
        e = self._endpoint
        if self._engine is not None:
            self._engine.close()
        self._engine = _Engine(address_toward(e.host), self.protocol)
        self._sessions = [""] + [self._store.get(_session_key(e.group_name, r)).decode() for r in range(1, e.world_size)]
        self._pending = None

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        """Pack into the slot bucket i-1 used (its writes are done), then finish bucket i's writes:
        packing overlaps the writes in flight."""
        if not manifest.nbytes:
            return None
        slot = manifest.index % self.NUM_SLOTS
        flat = pack_into(self.buffers.get(slot, manifest.nbytes), bucket, manifest)
        if flat.device.type == "cuda":
            import torch

            torch.cuda.current_stream(flat.device).synchronize()  # Mooncake reads it from its own threads
        self._complete_pending()
        return flat

    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        import torch

        if prepared is None:
            return
        src = self._engine.register(self.buffers.get(manifest.index % self.NUM_SLOTS, manifest.nbytes))
        addresses = torch.zeros(self._endpoint.world_size, dtype=torch.int64)
        self._group.all_reduce_sum(addresses)
        batches = []
        n = manifest.nbytes
        offsets = list(range(0, n, SLICE_BYTES))
        lens = [min(SLICE_BYTES, n - o) for o in offsets]
        for rank in range(1, self._endpoint.world_size):
            dst = int(addresses[rank])
            batch = self._engine.te.batch_transfer_async_write(
                self._sessions[rank], [src + o for o in offsets], [dst + o for o in offsets], lens)
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


class P2PReceiver(BroadcastReceiver):
    """One engine worker: a TransferEngine, staging buffers registered once and written by the trainer."""

    mode: ClassVar[str] = "p2p"

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        super().__init__(device, version=version)
        self._engine: _Engine | None = None

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        super().connect(endpoint, rank)  # closes the old group, engine and registrations first
        # a fresh engine and fresh registrations: the trainer never writes to an old one
        self._engine = _Engine(address_toward(endpoint.host), endpoint.p2p_protocol)
        self._group._store.set(_session_key(endpoint.group_name, rank), self._engine.session)
        self.buffers = FlatBuffers(self.device)  # staging lives where the model does, registered as it grows

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

