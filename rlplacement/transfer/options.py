"""Each transfer mode's own options as a typed, frozen dataclass, validated once when built (by
the mode's sender); and :func:`mode_options`, the one place a flag becomes a mode option.

Torch-free, so ``rlplacement.args`` takes the flags' choices from here.
"""

from __future__ import annotations

import dataclasses
import os

from rlplacement.config import DEFAULT_P2P_TRANSFER_TIMEOUT_S
from rlplacement.transfer.delta_codec import ENCODINGS as DELTA_ENCODINGS

P2P_PROTOCOLS = ("tcp", "rdma")


@dataclasses.dataclass(frozen=True)
class DiskDeltaOptions:
    """``disk_dir`` None: a fresh folder under the system temp dir (one host only). ``base_dir``: the HF
    checkpoint the engines started from (version 0); None makes the first version a keyframe."""

    disk_dir: str | os.PathLike | None = None
    delta_encoding: str = "xor"
    base_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if self.delta_encoding not in DELTA_ENCODINGS:
            raise ValueError(f"--update-weight-delta-encoding {self.delta_encoding!r} is unknown: use one of "
                             f"{', '.join(DELTA_ENCODINGS)}")


@dataclasses.dataclass(frozen=True)
class P2POptions:
    """``protocol``: the Mooncake transport; ``transfer_timeout_s``: how long one bucket's writes may take."""

    protocol: str = "tcp"
    transfer_timeout_s: float = DEFAULT_P2P_TRANSFER_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.protocol not in P2P_PROTOCOLS:
            raise ValueError(f"--p2p-protocol {self.protocol!r} is unknown: use one of {', '.join(P2P_PROTOCOLS)}")
        if self.transfer_timeout_s <= 0:
            raise ValueError(f"--p2p-transfer-timeout must be positive, got {self.transfer_timeout_s}")


def mode_options(transfer_config, mode: str, base_dir: str | None = None) -> dict:
    """The sender options ``mode`` takes from the flags (a ``rlplacement.config.TransferConfig``), as the
    keyword arguments of its sender, which validates them once by building its options dataclass.
    ``base_dir``: the checkpoint the engines started from (disk-delta's version 0)."""
    if mode == "disk-delta":
        return {"disk_dir": transfer_config.disk_dir, "delta_encoding": transfer_config.delta_encoding,
                "base_dir": base_dir}
    if mode == "p2p":
        return {"protocol": transfer_config.p2p_protocol, "transfer_timeout_s": transfer_config.p2p_timeout_s}
    return {}
