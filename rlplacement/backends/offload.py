"""Moving a trainer's GPU state to host memory and back, in place.

Storages, not tensors, are moved: the bytes of each storage go to a host buffer (pinned when the
storage is on a GPU) and the storage is resized to zero; ``reload`` resizes it back and copies the
bytes in. Every tensor object stays the one it was (parameters, their views, DTensor shards, the
optimizer's state and its references to the parameters), so nothing that holds a tensor has to be
told, and the round trip is bit-exact. Tensors that share a storage are moved once.

Gradients are not moved: every training step starts by setting them to None, so they are dropped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns this rank's bytes (a DTensor's local shard, else ``t``)."""
    return getattr(t, "_local_tensor", t)


@dataclasses.dataclass
class _Saved:
    storage: torch.UntypedStorage
    host: torch.Tensor  # uint8, the storage's bytes


class HostOffload:
    """Holds what was offloaded until :meth:`reload`; offloading twice in a row is refused."""

    def __init__(self) -> None:
        self._saved: list[_Saved] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> dict[str, float]:
        if self._saved:
            raise RuntimeError("the trainer's state is already in host memory: reload before offloading again")
        start = time.perf_counter()
        seen: set[int] = set()
        for t in tensors:
            storage = local_tensor(t).untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            on_gpu = storage.device.type == "cuda"
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=on_gpu)
            host.untyped_storage().copy_(storage, non_blocking=on_gpu)
            self._saved.append(_Saved(storage, host))
        if any(s.storage.device.type == "cuda" for s in self._saved):
            torch.cuda.synchronize()
        for s in self._saved:
            s.storage.resize_(0)
        if any(s.storage.device.type == "cuda" for s in self._saved):
            torch.cuda.empty_cache()  # give the freed blocks back to the driver, where the engines allocate
        return {"seconds": time.perf_counter() - start, "bytes": float(sum(s.host.numel() for s in self._saved))}

    def reload(self) -> dict[str, float]:
        start = time.perf_counter()
        moved = 0
        for s in self._saved:
            s.storage.resize_(s.host.numel())
            s.storage.copy_(s.host.untyped_storage(), non_blocking=s.storage.device.type == "cuda")
            moved += s.host.numel()
        if any(s.storage.device.type == "cuda" for s in self._saved):
            torch.cuda.synchronize()
        self._saved = []
        return {"seconds": time.perf_counter() - start, "bytes": float(moved)}
