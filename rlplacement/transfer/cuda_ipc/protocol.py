"""The parts of the ``cuda_ipc`` wire both sides use beyond the framed wire: its frame kinds and the
receivers' acknowledgements (the package docstring has the whole table)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlplacement.transfer.wire import AbortUpdate

if TYPE_CHECKING:
    import torch

KIND_DIRECT = 4  # a manifest of the trainer's own allocations instead of buckets
KIND_CHECKSUMS = 5  # after a direct manifest, with check_equal: the trainer's per-tensor checksums
KIND_DIRECT_COMMIT = 6  # the manifest every receiver holds mapped: commit at once, acknowledge once
DIRECT_ACK_TAG = 6  # a direct update's acknowledgements: one int32 from each receiver to the sender


class ReceiversFailed(AbortUpdate):
    what = "a receiver could not stage it"


def failed_ranks(status: "torch.Tensor") -> list[int]:
    return [rank for rank, flag in enumerate(status.tolist()) if flag]


@dataclasses.dataclass
class Ack:
    work: object
    status: "torch.Tensor"
    index: int
