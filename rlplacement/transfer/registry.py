"""Mode name -> (sender class, receiver class), imported lazily. Unknown names raise, listing
the known ones: there is no default mode here (the flag's default lives in args.py)."""

from __future__ import annotations

import importlib

# mode -> (module, sender class, receiver class); the modes a user picks with
# --update-weight-transfer-mode first, in the order the flag offers them
MODES: dict[str, tuple[str, str, str]] = {
    "broadcast": ("rlplacement.transfer.broadcast", "BroadcastSender", "BroadcastReceiver"),
    "broadcast_packed": ("rlplacement.transfer.broadcast_packed", "PackedBroadcastSender",
                         "PackedBroadcastReceiver"),
    # Mooncake Transfer Engine writes (RDMA, or TCP where RDMA is missing)
    "p2p": ("rlplacement.transfer.p2p", "P2PSender", "P2PReceiver"),
    "disk-delta": ("rlplacement.transfer.disk_delta", "DiskDeltaSender", "DiskDeltaReceiver"),
    # --colocate: CUDA IPC handles on GPU, /dev/shm mappings on CPU (same protocol)
    "cuda_ipc": ("rlplacement.transfer.ipc", "IpcSender", "IpcReceiver"),
}
COLOCATE_MODE = "cuda_ipc"  # chosen by --colocate, never by name


def selectable_modes() -> tuple[str, ...]:
    """The registered modes a user may name with --update-weight-transfer-mode (all but the colocated one)."""
    return tuple(m for m in MODES if m != COLOCATE_MODE)


def register_mode(mode: str, module: str, sender: str, receiver: str) -> None:
    if mode in MODES:
        raise ValueError(f"transfer mode {mode!r} is already registered (known: {', '.join(sorted(MODES))})")
    MODES[mode] = (module, sender, receiver)


def _lookup(mode: str, which: int):
    if mode not in MODES:
        raise ValueError(f"transfer mode {mode!r} is unknown: use one of {', '.join(sorted(MODES))} "
                         f"(--update-weight-transfer-mode)")
    entry = MODES[mode]
    return getattr(importlib.import_module(entry[0]), entry[which])


def sender_class(mode: str):
    return _lookup(mode, 1)


def receiver_class(mode: str):
    return _lookup(mode, 2)
