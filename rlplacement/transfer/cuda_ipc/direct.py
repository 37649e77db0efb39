"""Mode ``cuda_ipc``'s direct path: the engine reads the trainer's own parameter memory, so every
byte is copied once (trainer parameter -> served parameter) instead of three times (pack into a
shared slot, copy to staging, commit from staging).

It applies when the trainer says its tensors are *resident* (views of its own device parameters,
unchanged and allocated until the update returns: an FSDP trainer of one rank streaming in the
parameters' dtype) and every tensor sits in an allocation that a legacy CUDA IPC handle can export
(not expandable segments). Otherwise the sender uses the bucket path.

* Sender (:class:`AllocationExports`): the tensors are grouped by allocation (a caching-allocator
  segment; the trainer's hand-off reloads its state into one, see ``backends/offload.py``), one
  handle per allocation, and a JSON manifest: allocations (key, handle, size) and per tensor its
  allocation, byte offset, dtype, shape and strides, and its HF shape where the tensor is held in
  another (``base.HFShapes``: q, k, v as row groups of a Megatron trainer's fused QKV). Exports are kept while each allocation's
  driver buffer id is unchanged, and the manifest bytes while no tensor moved. Asking the driver
  about every allocation costs ~2 ms per update (~200 of them), so it is asked only when torch's
  caching allocator has allocated or freed a segment on the device since it last was: the trainer's
  tensors live in that allocator's segments (the backends that claim resident tensors use it), and a
  segment that was neither freed nor replaced is the allocation that was exported.
* Receiver (:class:`MappedAllocations`): maps each allocation, makes typed views of the tensors (in
  their HF shapes where that is a view; grouped ones stay grouped and are named in ``hf_shapes``, for
  the engine's copy plan to copy group by group), and by default unmaps everything when the update is committed or dropped, before acknowledging:
  the trainer may free that memory as soon as its ``update`` returns (the driver leaves freeing a
  still-mapped allocation undefined). Views are rebuilt only when a mapping lands elsewhere.
* ``keep_mapped`` (the sender's, carried in the manifest): receivers keep the mappings between
  updates, so a steady-state update opens nothing (mapping each of an unsharded trainer's
  hundreds of allocations again would cost every update). The trainer then owes the receivers a call to
  unmap (``unmap``) before it frees an exported allocation; ``AllocationExports.mapped_elsewhere``
  says whether it still does, and the trainer actor refuses to offload until told they did.
"""

from __future__ import annotations

import base64
import bisect
import json
import math
import os
import socket
import weakref
from typing import TYPE_CHECKING

from rlplacement.transfer.cuda_ipc import driver as cuda_driver
from rlplacement.transfer.base import HFShapes, NamedTensor, TensorMeta, TransferError

if TYPE_CHECKING:
    import torch


def _span_bytes(shape, stride, itemsize: int) -> int:
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * itemsize


class AllocationExports:
    """Trainer side: the handles of the allocations holding the tensors, and the manifest naming them."""

    def __init__(self, device: "torch.device"):
        self.device = device
        self._allocs: list[tuple[int, int, str, dict]] = []  # sorted (base, end, key, segment entry)
        self._segments_checked_at: tuple | None = None  # the allocator's segment counts at the last driver check
        self._signature: tuple | None = None  # (keep_mapped, HF shapes, per-tensor layout) the manifest bytes were made from
        self._blob: bytes | None = None
        # (name, weak reference to the tensor) the blob was made from, and their addresses; weak, so a
        # trainer that drops its parameters does not keep their memory through us
        self._same_as_blob: tuple[list, list[int]] = ([], [])
        self.handles_exported = 0
        self.keep_mapped = False
        self.mapped_elsewhere = False  # receivers may hold mappings of our allocations (keep_mapped)

    def _segment_counts(self) -> tuple | None:
        """(segments allocated, segments freed) by torch's caching allocator on this device so far."""
        import torch

        counts = torch.cuda.memory.memory_stats_as_nested_dict(self.device).get("segment", {}).get("all", {})
        return (counts["allocated"], counts["freed"]) if "freed" in counts else None

    def _refresh(self) -> None:
        """Forget exports whose allocation was freed (its buffer id at that address changed)."""
        counts = self._segment_counts()
        if counts is not None and counts == self._segments_checked_at:
            return
        self._segments_checked_at = counts
        keep = []
        for base, end, key, entry in self._allocs:
            try:
                alloc = cuda_driver.allocation_of(base)
            except TransferError:
                continue
            if alloc.base == base and alloc.base + alloc.size == end and alloc.buffer_id == entry["buffer_id"]:
                keep.append((base, end, key, entry))
        if len(keep) != len(self._allocs):
            self._allocs, self._blob = keep, None

    def _entry_of(self, ptr: int) -> tuple[int, dict] | None:
        """(allocation base, segment entry) holding ``ptr``; exports a new allocation on first sight;
        None when it cannot be exported (expandable segments, a custom pool)."""
        i = bisect.bisect_right(self._allocs, (ptr, float("inf"))) - 1
        if i >= 0 and self._allocs[i][0] <= ptr < self._allocs[i][1]:
            return self._allocs[i][0], self._allocs[i][3]
        alloc = cuda_driver.allocation_of(ptr)
        if not alloc.ipc_capable:
            return None
        entry = {"key": f"{os.getpid()}-{alloc.buffer_id}", "size": alloc.size, "buffer_id": alloc.buffer_id,
                 "handle": base64.b64encode(cuda_driver.export_handle(alloc.base)).decode()}
        self.handles_exported += 1
        bisect.insort(self._allocs, (alloc.base, alloc.base + alloc.size, entry["key"], entry))
        return alloc.base, entry

    def _unchanged(self, tensors: list[NamedTensor]) -> bool:
        """The very tensors (by name) the manifest was made from, each at the same address.

        A tensor object keeps its dtype, shape and strides unless it is itself resized or re-strided in
        place, which resident tensors are not (they are the backend's own views of its parameters); an
        offload and reload moves their storage, which the addresses show. Comparing identities and
        addresses costs ~0.1 ms for ~400 tensors, the full layout ~0.5-2 ms."""
        refs, ptrs = self._same_as_blob
        return (len(refs) == len(tensors) and all(n == name and ref() is t for (n, t), (name, ref) in zip(tensors, refs))
                and [t.data_ptr() for _, t in tensors] == ptrs)

    def manifest(self, tensors: list[NamedTensor], hf_shapes: HFShapes | None = None) -> tuple[bytes | None, str]:
        """``(manifest JSON, "")``, or ``(None, why)`` when some tensor cannot be read in place. The
        JSON is the same bytes object as last time when nothing moved (the caller then sends none)."""
        cuda_driver.bind_context(self.device.index or 0)
        self._refresh()
        hf_shapes = hf_shapes or {}
        if self._blob is not None and self._signature is not None and self._signature[:2] == (
                self.keep_mapped, hf_shapes) and self._unchanged(tensors):
            return self._blob, ""
        signature = [(n, t.data_ptr(), t.dtype, t.shape, t.stride()) for n, t in tensors]
        if self._blob is not None and (self.keep_mapped, hf_shapes, signature) == self._signature:
            self._remember(tensors, signature)
            return self._blob, ""
        used: dict[str, int] = {}
        segments, rows = [], []
        for (name, t), (_, ptr, dtype, shape, stride) in zip(tensors, signature):
            if t.device != self.device:
                return None, f"tensor {name!r} is on {t.device}, not the trainer's {self.device}"
            found = self._entry_of(ptr)
            if found is None:
                return None, (f"tensor {name!r} is in memory a legacy CUDA IPC handle cannot export (expandable "
                              f"segments or a custom allocator pool)")
            base, entry = found
            index = used.get(entry["key"])
            if index is None:
                index = used[entry["key"]] = len(segments)
                segments.append({k: entry[k] for k in ("key", "size", "handle")})
            hf_shape = hf_shapes.get(name)
            rows.append([name, str(dtype).removeprefix("torch."), list(shape), list(stride), index, ptr - base,
                         None if hf_shape is None else list(hf_shape)])
        blob = json.dumps({"host": socket.gethostname(), "keep_mapped": self.keep_mapped, "segments": segments,
                           "tensors": rows}).encode()
        if blob == self._blob:
            blob = self._blob
        self._signature, self._blob = (self.keep_mapped, dict(hf_shapes), signature), blob
        self._remember(tensors, signature)
        return blob, ""

    def _remember(self, tensors: list[NamedTensor], signature: list[tuple]) -> None:
        self._same_as_blob = ([(n, weakref.ref(t)) for n, t in tensors], [ptr for _, ptr, *_ in signature])

    def close(self) -> None:
        self._allocs, self._signature, self._blob = [], None, None
        self._same_as_blob = ([], [])
        self._segments_checked_at = None


class MappedAllocations:
    """Engine side: the trainer's allocations mapped for one update, and typed views of its tensors."""

    def __init__(self, device: "torch.device"):
        self.device = device
        self._manifest: dict | None = None
        self._mapped: dict[str, int] = {}  # key -> address here, while an update holds them
        self._last_addresses: dict[str, int] = {}
        self._views: list[NamedTensor] | None = None
        self.metas: list[TensorMeta] = []
        self.hf_shapes: HFShapes = {}  # the views :meth:`map` returns grouped, not in their HF shapes
        self.handles_opened = 0

    def parse(self, blob: bytes) -> None:
        """A new manifest (``b""``: the one parsed last, unchanged)."""
        if not blob:
            if self._manifest is None:
                raise TransferError("the trainer referred to a direct manifest this receiver never received; "
                                    "rebuild the transfer group")
            return
        import torch

        self._manifest = self._views = None
        manifest = json.loads(blob)
        here = socket.gethostname()
        if manifest["host"] != here:
            raise TransferError(f"mode cuda_ipc shares memory within one host: the trainer's weights are on host "
                                f"{manifest['host']!r}, this engine worker runs on {here!r}; place every "
                                f"engine on trainer rank 0's node, or drop --colocate and use broadcast_packed")
        self.metas = [TensorMeta(n, d, tuple(s), off, _span_bytes(s, st, getattr(torch, d).itemsize))
                      for n, d, s, st, _, off, _ in manifest["tensors"]]
        self._manifest = manifest

    def map(self) -> list[NamedTensor]:
        """Open every allocation of the manifest; the tensors as typed views of them (the same view
        objects as last update when every allocation landed at the same address)."""
        import torch

        cuda_driver.bind_context(self.device.index if self.device.index is not None else torch.cuda.current_device())
        wanted = {seg["key"] for seg in self._manifest["segments"]}
        self._unmap([k for k in self._mapped if k not in wanted])  # kept from an earlier manifest
        for seg in self._manifest["segments"]:
            if seg["key"] not in self._mapped:
                self._mapped[seg["key"]] = cuda_driver.open_handle(base64.b64decode(seg["handle"]))
                self.handles_opened += 1
        if self._views is None or self._mapped != self._last_addresses:
            self._views = self._make_views()
            self._last_addresses = dict(self._mapped)
        return list(self._views)

    def _make_views(self) -> list[NamedTensor]:
        import torch

        typed: dict[tuple[int, str], torch.Tensor] = {}
        segments = self._manifest["segments"]
        views, self.hf_shapes = [], {}
        for name, dtype_name, shape, stride, index, offset, hf_shape in self._manifest["tensors"]:
            dtype = getattr(torch, dtype_name)
            key = (index, dtype_name)
            base = typed.get(key)
            if base is None:
                seg = segments[index]
                # on the trainer's GPU as this process numbers it (no device argument: that would copy)
                raw = torch.as_tensor(cuda_driver.DeviceBytes(self._mapped[seg["key"]], seg["size"]))
                base = typed[key] = raw[:seg["size"] - seg["size"] % dtype.itemsize].view(dtype)
            itemsize = base.element_size()
            if offset % itemsize or offset + _span_bytes(shape, stride, itemsize) > segments[index]["size"]:
                raise TransferError(f"tensor {name!r} does not lie inside its allocation in the trainer's manifest")
            view = base.as_strided(shape, stride, offset // itemsize)
            if hf_shape is not None:
                grouped = len(shape) >= 2 and [shape[0] * shape[1], *shape[2:]] == list(hf_shape)
                if view.is_contiguous() and view.numel() == math.prod(hf_shape):
                    view = view.view(hf_shape)
                elif grouped:  # [groups, rows, ...]: the copy plan copies them group by group
                    self.hf_shapes[name] = tuple(hf_shape)
                else:
                    raise TransferError(f"tensor {name!r} of shape {tuple(shape)} is not its HF shape "
                                        f"{tuple(hf_shape)} in rows grouped along its first dimension, in the "
                                        f"trainer's manifest")
            views.append((name, view))
        return views

    @property
    def num_allocations(self) -> int:
        """Allocations the last direct manifest named (each mapped once per update)."""
        return len(self._manifest["segments"]) if self._manifest else 0

    @property
    def keep_mapped(self) -> bool:
        return bool(self._manifest and self._manifest.get("keep_mapped"))

    @property
    def num_mapped(self) -> int:
        return len(self._mapped)

    def finish(self) -> None:
        """The update is committed or dropped: wait for every copy out of the mappings, then unmap
        them unless the sender asked to keep them."""
        self.close(keep=self.keep_mapped)

    def close(self, keep: bool = False) -> None:
        """Wait for every copy out of the mappings, then unmap them (``keep``: leave them mapped); views
        stay, unusable until mapped again."""
        if self._mapped:
            import torch

            torch.cuda.synchronize(self.device)
            if not keep:
                self._unmap(list(self._mapped))

    def _unmap(self, keys: list[str]) -> None:
        failures = []
        for key in keys:
            try:
                cuda_driver.close_handle(self._mapped.pop(key))
            except TransferError as exc:
                failures.append(f"{key}: {exc}")
        if failures:
            raise TransferError(f"closing the trainer's mapped allocations failed: {'; '.join(failures)}")

    def forget(self) -> None:
        self._manifest, self._views, self._last_addresses, self.hf_shapes = None, None, {}, {}
