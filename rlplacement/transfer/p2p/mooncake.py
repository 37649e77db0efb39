"""One Mooncake TransferEngine per process side of a p2p group, and the pieces both sides share:
the slice size, the route to a peer, the rendezvous key of a receiver's session id, staging slots
registered only while they live.

What a TransferEngine exposes (mooncake-transfer-engine 0.3.13, measured with ``ss -ltnp``): its
P2P handshake RPC port on ``0.0.0.0`` and its TCP data port on ``*`` (every IPv4 and IPv6
interface), whatever address ``initialize`` is given and whatever ``MC_TCP_BIND_ADDRESS``,
``MC_RDMA_BIND_ADDRESS`` or ``MC_LEGACY_RPC_PORT_BINDING`` say (the log line "listening on
127.0.0.1:<port>" names the advertised address, not the bound one). Neither port authenticates a
peer. Anyone who reaches them can read or write the memory this engine has registered, and only
that: the server refuses a write whose range is not inside a registered buffer ("not within any
registered buffer"). So the bound this module keeps is on registrations: a buffer is registered
from its first use until it is freed, replaced or the engine closed, and the engine holds a
reference to every registered buffer, so registered memory can never be freed and reused under a
registration. The session address given to peers is loopback on one machine (``address_toward``).
``MC_TCP_BIND_ADDRESS`` is still set to that address (unless you set it): a Mooncake that honours it
binds to the job's interface, and ``tests/test_open_doors.py``'s strict xfail then says so.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from rlplacement.transfer.base import TransferError
from rlplacement.transfer.bucket import FlatBuffers
from rlplacement.transfer.p2p import PROTOCOLS

if TYPE_CHECKING:
    import torch

SLICE_BYTES = 8 << 20  # one bucket goes as slices of this size in one batch (Mooncake runs them concurrently)


def address_toward(host: str) -> str:
    """This host's address on the interface that reaches ``host`` (loopback for a loopback peer)."""
    if host.startswith("127.") or host == "localhost":
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


BIND_ATTEMPTS = 3


class MooncakeEngine:
    """One Mooncake TransferEngine and the memory it registered (unregistered on close)."""

    def __init__(self, host: str, protocol: str):
        # Mooncake logs every connection at INFO (~40 lines a run, one an "E" line on success): WARNING unless
        # the user chose a level
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)  # ignored for binding by 0.3.13 (module docstring)
        from mooncake.engine import TransferEngine

        if protocol not in PROTOCOLS:
            raise TransferError(f"--p2p-protocol {protocol!r} is unknown: use one of {', '.join(PROTOCOLS)}")
        for attempt in range(BIND_ATTEMPTS):  # its ports are drawn at random: one may be taken on a busy host
            self.te = TransferEngine()
            try:
                rc = self.te.initialize(host, "P2PHANDSHAKE", protocol, "")
                break
            except RuntimeError as exc:
                if "Address already in use" not in str(exc) or attempt == BIND_ATTEMPTS - 1:
                    raise
        if rc != 0:
            raise TransferError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, {protocol!r}) returned "
                                f"{rc}" + ("; without an RDMA device use --p2p-protocol tcp" if protocol == "rdma" else ""))
        self.session = f"{host}:{self.te.get_rpc_port()}"
        # address -> the tensor registered there, held so that its memory outlives its registration
        self.registered: dict[int, "torch.Tensor"] = {}

    def register(self, tensor: "torch.Tensor") -> int:
        """Register ``tensor``'s memory (once; again if another size now sits at its address); its address."""
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        held = self.registered.get(ptr)
        if held is None or held.numel() * held.element_size() != nbytes:
            if held is not None:
                self.unregister(held)
            rc = self.te.register_memory(ptr, nbytes)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory of {nbytes} bytes returned {rc}")
            self.registered[ptr] = tensor
        return ptr

    def unregister(self, tensor: "torch.Tensor") -> None:
        """Take ``tensor``'s memory out of the engine before it is freed (a no-op if not registered here).
        A failure keeps the tensor held (its memory stays allocated while peers may still write it) and raises."""
        ptr = tensor.data_ptr()
        if ptr not in self.registered:
            return
        rc = self.te.unregister_memory(ptr)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory of the staging buffer at {ptr:#x} returned {rc}")
        del self.registered[ptr]

    def close(self) -> None:
        for ptr in list(self.registered):
            try:
                self.te.unregister_memory(ptr)
            except Exception:  # noqa: BLE001 - closing must not hide the error that led here
                pass
        self.registered = {}


class RegisteredBuffers(FlatBuffers):
    """Staging slots whose memory leaves ``engine`` before it is freed: a slot that grows or is trimmed
    is unregistered first. Slots are registered where they are used (``engine.register``, once per
    buffer); ``engine`` is swapped when the group is rebuilt (the old engine's close unregistered all)."""

    def __init__(self, device: "torch.device | str", engine: MooncakeEngine | None):
        super().__init__(device)
        self.engine = engine

    def get(self, slot: int, nbytes: int) -> "torch.Tensor":
        old = self._slots.get(slot)
        buf = super().get(slot, nbytes)
        if old is not None and buf is not old:
            self._forget(old)
        return buf

    def trim(self, keep_slots: int) -> None:
        for slot, buf in self._slots.items():
            if slot >= keep_slots:
                self._forget(buf)
        super().trim(keep_slots)

    def _forget(self, buf: "torch.Tensor") -> None:
        if self.engine is not None:
            self.engine.unregister(buf)


def session_key(group_name: str, rank: int) -> str:
    return f"rlplacement/{group_name}/p2p-session/{rank}"
