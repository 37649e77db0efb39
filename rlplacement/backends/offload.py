"""Moving a trainer's GPU state to host memory and back, in place.

Storages, not tensors, are moved: the bytes of each storage go to a slice of one host buffer and
the storage is resized to zero; ``reload`` resizes it back and copies the bytes in. Every tensor
object stays the one it was (parameters, their views, DTensor shards, the optimizer's state and
its references to the parameters), so nothing that holds a tensor has to be told, and the round
trip is bit-exact. Tensors that share a storage are moved once.

On the GPU the storages come back inside one allocation (:func:`_reserve_one_segment`), so a
colocated engine maps all of the trainer's weights with one CUDA IPC handle.

The host buffer is one allocation, made and pinned once (:meth:`HostOffload.reserve`, at the job's
start, sized from the optimizer's state to come) and kept for the run: pinning is a one-time cost of
seconds per 10 GB that must not land in a step. It is anonymous memory asking for transparent huge
pages, touched on several threads, then registered with CUDA (``cudaHostRegister``); torch's pinned
allocator would round each buffer up to a power of two and cache it for the life of the process (an
8B trainer's ~46 GB of state would hold 64 GiB). Copies in and out of it run at the link's pinned
rate (``benchmarks/gpu/host_link.py`` measures it). If
registering fails the buffer stays pageable: the copies are slower, not wrong. A state larger than
the reservation grows the buffer (a new one, pinned again) and says so in the report (``grew``).

Gradients are not moved: every training step starts by setting them to None, so they are dropped;
buffers a step rewrites before reading (megatron's DDP gradient buffers) are freed without a copy
(``offload``'s ``drop``) and come back as zeros. Frozen storages (``offload``'s ``frozen``: LoRA's base, a
KL reference model) are copied out once; their host bytes stay valid, so every later offload frees them
without a copy and only the reload moves them.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from typing import Iterable

import torch

log = logging.getLogger(__name__)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns this rank's bytes (a DTensor's local shard, else ``t``)."""
    return getattr(t, "_local_tensor", t)


def unique_storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The non-empty storages under ``tensors`` (their local shards), each once, by address."""
    storages: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        if storage.nbytes():
            storages.setdefault(storage.data_ptr(), storage)
    return storages


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_SMALL_POOL_MAX_BYTES = 1 << 20  # the caching allocator serves requests up to this from 2 MiB small segments
_ROUND_BYTES = 512  # and rounds every request up to a multiple of this


def _reserve_one_segment(storages: list[tuple[torch.device, int]]) -> None:
    """Allocate and free at once one block the size of the large storages about to be re-made: the
    caching allocator keeps it cached as one segment and carves each of them from it (it splits a
    cached block on request). A colocated engine then maps the trainer's weights with one IPC handle
    (``transfer/cuda_ipc/direct.py``) instead of one per segment. Without room for one block, nothing
    changes: the storages get segments of their own, as before."""
    total: dict[torch.device, int] = {}
    for device, n in storages:
        if device.type == "cuda" and n > _SMALL_POOL_MAX_BYTES:
            total[device] = total.get(device, 0) + -(-n // _ROUND_BYTES) * _ROUND_BYTES
    for device, nbytes in total.items():
        try:
            torch.empty(nbytes, dtype=torch.uint8, device=device)
        except torch.OutOfMemoryError:
            pass


class HostOffload:
    """Holds what was offloaded until :meth:`reload`; offloading twice in a row is refused."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, int, int]] = []  # (storage, offset in host, bytes)
        self._frozen_at: dict[int, tuple[int, int]] = {}  # frozen storage (its StorageImpl) -> (offset, bytes) kept
        self._host: torch.Tensor | None = None
        self._mapping: mmap.mmap | None = None  # what the host buffer's bytes live in, when mapped here
        self._registered = False

    @property
    def offloaded(self) -> bool:
        return bool(self._saved)

    @property
    def capacity(self) -> int:
        return 0 if self._host is None else self._host.numel()

    def reserve(self, nbytes: int, pin: bool) -> dict[str, float]:
        """Make and (``pin``) pin the host buffer for ``nbytes`` now, so no step pays for it; returns the
        seconds it took and the bytes reserved."""
        start = time.perf_counter()
        if nbytes > self.capacity:
            self._new_host_buffer(nbytes, pin)
        return {"seconds": time.perf_counter() - start, "bytes": float(self.capacity),
                "host_pinned": float(self._registered)}

    def offload(self, tensors: Iterable[torch.Tensor], drop: Iterable[torch.Tensor] = (),
                frozen: Iterable[torch.Tensor] = ()) -> dict[str, float]:
        """Every storage of ``tensors`` to the host buffer, then freed; the storages of ``drop`` (buffers whose
        contents the next step overwrites, such as megatron's gradient buffers) freed without a copy and zeros
        when reloaded. ``frozen``: tensors nothing writes between offloads; those of their storages among
        ``tensors``' are copied only the first time (their region of the host buffer is kept). Returns seconds (``copy_seconds`` of them moving
        bytes, the rest freeing), bytes moved, frozen bytes kept from an earlier offload (``kept_bytes``),
        bytes dropped, and whether the buffer had to grow."""
        if self._saved:
            raise RuntimeError("the trainer's state is already in host memory: reload before offloading again")
        start = time.perf_counter()
        resident = unique_storages(tensors)
        fixed = {k: v for k, v in unique_storages(frozen).items() if k in resident}
        storages = {**fixed, **{k: v for k, v in resident.items() if k not in fixed}}  # frozen first
        dropped = {k: v for k, v in unique_storages(drop).items() if k not in storages}
        collected = time.perf_counter()
        on_gpu = any(s.device.type == "cuda" for s in storages.values())
        total = sum(s.nbytes() for s in storages.values())
        grew = total > self.capacity
        if grew:
            if self._host is not None:
                log.warning("rlplacement: the trainer's state (%.2f GB) outgrew its host buffer (%.2f GB) reserved at "
                            "start: a new one is pinned now, in this step", total / 1e9, self.capacity / 1e9)
            self._new_host_buffer(total, on_gpu)
        host = self._host
        # frozen storages first, at the same offsets every time: one laid out as before keeps its host bytes
        kept_at, self._frozen_at = self._frozen_at, {}  # until every copy is done, no host copy is trusted
        frozen_at: dict[int, tuple[int, int]] = {}
        saved, offset, moved, kept = [], 0, 0, 0
        for key, storage in storages.items():  # nothing is freed until every byte is copied: a failure loses nothing
            n = storage.nbytes()
            if key in fixed:
                frozen_at[storage._cdata] = (offset, n)
            if key in fixed and kept_at.get(storage._cdata) == (offset, n):
                kept += n
            else:
                host[offset:offset + n].copy_(_bytes_of(storage), non_blocking=on_gpu)
                moved += n
            saved.append((storage, offset, n))
            offset += n
        if on_gpu:
            torch.cuda.synchronize()
        copied = time.perf_counter()
        self._frozen_at = frozen_at  # every frozen storage's bytes are in host memory now
        for storage, _, _ in saved:
            storage.resize_(0)
        for storage in dropped.values():
            saved.append((storage, -1, storage.nbytes()))  # offset -1: nothing in host memory, zeros back
            storage.resize_(0)
        self._saved = saved
        freed = time.perf_counter()
        if on_gpu:
            torch.cuda.empty_cache()  # give the freed blocks back to the driver, where the engines allocate
        end = time.perf_counter()
        return {"seconds": end - start, "collect_seconds": collected - start, "copy_seconds": copied - collected,
                "free_seconds": freed - copied,
                "release_seconds": end - freed, "bytes": float(moved), "kept_bytes": float(kept),
                "dropped_bytes": float(sum(n for _, o, n in saved if o < 0)), "host_pinned": float(self._registered),
                "grew": float(grew)}

    def reload(self) -> dict[str, float]:
        start = time.perf_counter()
        moved = 0
        on_gpu = any(s.device.type == "cuda" for s, _, _ in self._saved)
        if on_gpu:
            _reserve_one_segment([(s.device, n) for s, _, n in self._saved])
        for storage, offset, n in self._saved:
            storage.resize_(n)
            if offset < 0:  # dropped: its contents are rewritten before they are read
                _bytes_of(storage).zero_()
                continue
            _bytes_of(storage).copy_(self._host[offset:offset + n], non_blocking=on_gpu)
            moved += n
        if on_gpu:
            torch.cuda.synchronize()
        self._saved = []
        return {"seconds": time.perf_counter() - start, "bytes": float(moved)}

    def _new_host_buffer(self, nbytes: int, pin: bool) -> None:
        self._frozen_at = {}  # a new buffer holds none of the frozen bytes
        self._release_host()
        self._host, self._mapping = _host_bytes(nbytes)
        if pin and nbytes:
            rc = torch.cuda.cudart().cudaHostRegister(self._host.data_ptr(), nbytes, 0)
            self._registered = int(getattr(rc, "value", rc)) == 0

    def _release_host(self) -> None:
        if self._host is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._host.data_ptr())
        self._host, self._registered = None, False
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def __del__(self) -> None:
        try:
            self._release_host()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone already
            pass


def _host_bytes(nbytes: int) -> tuple[torch.Tensor, mmap.mmap | None]:
    """``nbytes`` of host memory, every page present: anonymous memory asking for transparent huge pages
    (fewer pages to pin and for the GPU to translate), touched once on several threads, so registering
    it only pins. Plain torch memory where the system has no such mapping."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8), None
    mapping = None
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE)
        host = torch.frombuffer(mapping, dtype=torch.uint8)
    except (AttributeError, OSError, ValueError):
        if mapping is not None:
            mapping.close()
        mapping, host = None, torch.empty(nbytes, dtype=torch.uint8)
    _touch(host)
    return host, mapping


def _touch(host: torch.Tensor) -> None:
    """Fault every page of ``host`` in now, on several threads (torch releases the GIL while it fills;
    a Ray actor's torch runs one intra-op thread)."""
    from concurrent.futures import ThreadPoolExecutor

    threads = max(1, min(16, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))
    step = -(-host.numel() // threads)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: host[i:i + step].zero_(), range(0, host.numel(), step)))
