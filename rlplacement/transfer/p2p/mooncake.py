"""One Mooncake TransferEngine per process side of a p2p group, and the pieces both sides share:
the slice size, the route to a peer, the rendezvous key of a receiver's session id."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from rlplacement.transfer.base import TransferError
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


class MooncakeEngine:
    """One Mooncake TransferEngine and the memory it registered (unregistered on close)."""

    def __init__(self, host: str, protocol: str):
        # Mooncake logs every connection at INFO (~40 lines a run, one an "E" line on success): WARNING unless
        # the user chose a level
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
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


def session_key(group_name: str, rank: int) -> str:
    return f"rlplacement/{group_name}/p2p-session/{rank}"
