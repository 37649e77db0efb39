"""A worker's slice of a tensor, handed to vLLM's loader as the whole HF tensor it expects, in no more memory
than the slice, on any device.

:func:`as_whole` wraps the slice's bytes (a tensor of the box's shape, on the worker's device) in a
:class:`SliceTensor` of the whole HF shape whose own storage is on the ``meta`` device: it has a shape,
strides and offsets but no bytes, so a 70B engine's worker never allocates the rows outside its slice.
vLLM's loaders cut each worker's part out of the whole tensor with views (``narrow``, ``chunk``, ...) and end
in ``param.copy_(view)``. Views of a SliceTensor are SliceTensors (computed on the meta storage, so their
offsets and strides are exact), and a ``copy_`` out of one is carried out from the slice's bytes, after a
check that the view is exactly the box: same first element, shape and strides as the box cut out of the
whole tensor. Any other read (a view outside or across the box, a computation on the tensor, a move to
another device or dtype) raises :class:`SliceReadError` naming the tensor and what the loader did; the
engine then refuses to serve and the message says to use ``--update-weight-slices off``.

Device queries (``device``, ``is_cuda``, ``data_ptr``, ...) answer for the slice's bytes, so a loader that
checks where its input lives sees the worker's device, and ``to``/``contiguous`` to where it already is
return the tensor itself, as torch does.

Invariant: every byte a loader takes out of a SliceTensor comes from the slice, or the load fails. Because
the check runs on every copy, a rule in ``transfer.shards`` that disagrees with a loader is caught on the
load it first disagrees, whatever the device.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rlplacement.transfer.base import TransferError

if TYPE_CHECKING:
    import torch

VIEW_OPS = frozenset({
    "narrow", "view", "reshape", "t", "transpose", "permute", "chunk", "split", "unflatten", "flatten", "squeeze",
    "unsqueeze", "expand", "__getitem__", "detach", "as_strided", "select", "unbind", "size", "dim", "numel", "stride",
    "element_size", "data_ptr", "storage_offset", "is_contiguous", "nelement", "__len__", "__format__", "__repr__",
    "dtype", "shape", "device", "is_cuda", "is_cpu", "ndim", "contiguous", "to", "type", "float", "untyped_storage",
    "is_floating_point", "requires_grad", "layout", "is_meta", "T", "data", "__get__", "_is_view", "_base",
    "is_sparse", "names", "grad", "is_quantized", "__hash__", "__bool__", "dim_order", "get_device", "nbytes",
    "itemsize", "item"})
"""Operations that only look at a tensor or make a view of it: what a loader may apply to a staged tensor
(``engines.copy_plan`` records loads made of these and ``copy_``)."""

_ON_THE_SLICE = {"device", "is_cuda", "is_cpu", "is_meta", "get_device", "data_ptr"}
_CONVERSIONS = {"to", "type", "float", "contiguous"}  # a copy unless the tensor already is what is asked
_NOT_ON_A_SLICE = {"item", "untyped_storage", "_base"}  # would read or expose the meta storage


class SliceReadError(TransferError):
    """A loader read a worker's slice other than exactly as its box."""


_CLASS = None


def _slice_tensor_class():
    import torch

    class SliceTensor(torch.Tensor):
        """A view of a whole HF tensor of which only the box ``_box`` exists (``_slice``): see the module."""

        _slice: "torch.Tensor"
        _box: tuple
        _whole: tuple
        _name: str

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", str(func))
            if name == "__get__":  # a property: its own name
                name = getattr(getattr(func, "__self__", None), "__name__", name)
            if name == "copy_" and len(args) >= 2 and isinstance(args[1], cls) and not isinstance(args[0], cls):
                return args[0].copy_(args[1]._box_bytes(), *args[2:], **kwargs)
            this = next((a for a in args if isinstance(a, cls)), None)
            if this is None or name in _NOT_ON_A_SLICE or name not in VIEW_OPS | {"__get__"}:
                raise SliceReadError(_refusal(this if this is not None else args[0], name))
            if name in _ON_THE_SLICE:
                return func(this._slice, *args[1:], **kwargs)
            if name == "type" and len(args) == 1 and not kwargs:  # the type's name: a query
                return func(this._slice)
            if name in _CONVERSIONS:
                with torch._C.DisableTorchFunctionSubclass():
                    probe = func(torch.empty(0, dtype=this.dtype, device=this._slice.device), *args[1:], **kwargs)
                if probe.dtype != this.dtype or probe.device != this._slice.device:
                    raise SliceReadError(_refusal(this, f"{name} (to {probe.dtype} on {probe.device})"))
                if name != "contiguous" or this._meta_view().is_contiguous():
                    return this
                if not this._is_box():  # a copy of more or less than the slice
                    raise SliceReadError(_refusal(this, name))
                box = tuple(b - a for a, b in this._box)  # the box itself, laid out as the slice is
                return as_whole(this._slice.view(box), tuple((0, n) for n in box), box, this._name)
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return _rewrap(out, this, name)

        def _meta_view(self) -> "torch.Tensor":
            import torch

            with torch._C.DisableTorchFunctionSubclass():
                return self.as_subclass(torch.Tensor)

        def _is_box(self) -> bool:
            meta = self._meta_view()
            strides = [math.prod(self._whole[k + 1:]) for k in range(len(self._whole))]
            first = sum(a * s for (a, _), s in zip(self._box, strides))
            return (tuple(meta.shape) == tuple(b - a for a, b in self._box) and tuple(meta.stride()) == tuple(strides)
                    and meta.storage_offset() == first)

        def _box_bytes(self) -> "torch.Tensor":
            """The slice's bytes in the box's shape, for a copy out of this view; raises unless the view is
            exactly the box."""
            if not self._is_box():
                meta = self._meta_view()
                raise SliceReadError(
                    f"the loader read {self._name!r} other than as its slice {_describe(self._box)} (a view of size "
                    f"{tuple(meta.shape)} at offset {meta.storage_offset()}, strides {tuple(meta.stride())}); "
                    f"{_WAY_OUT}")
            return self._slice.view(tuple(b - a for a, b in self._box))

    return SliceTensor


_WAY_OUT = "start the engines with --update-weight-slices off (whole tensors) for this model"


def _refusal(tensor, what: str) -> str:
    name = getattr(tensor, "_name", "?")
    box = getattr(tensor, "_box", None)
    return (f"the loader applied {what} to {name!r}, of which this worker was sent only the slice "
            f"{_describe(box) if box else '?'}; {_WAY_OUT}")


def _describe(box: tuple) -> str:
    from rlplacement.transfer.plan.boxes import describe

    return describe(box)


def _rewrap(out, like, op: str):
    """``out`` of ``op`` on ``like``: a view of its meta storage as a SliceTensor of the same slice; a
    query's answer as it is; a new tensor (a computation, as advanced indexing is) refused."""
    import torch

    if isinstance(out, torch.Tensor):
        if out.device.type != "meta":  # a query's answer
            return out
        if not torch._C._is_alias_of(out, like._meta_view()):
            raise SliceReadError(_refusal(like, op))
        wrapped = torch._tensor._convert(out, type(like))
        wrapped._slice, wrapped._box, wrapped._whole, wrapped._name = like._slice, like._box, like._whole, like._name
        return wrapped
    if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out):
        return type(out)(_rewrap(o, like, op) for o in out)
    return out


def as_whole(data: "torch.Tensor", box: tuple, shape: tuple[int, ...], name: str) -> "torch.Tensor":
    """``data`` (the box's elements, any layout of the box's shape) as the whole tensor ``name`` of ``shape``,
    for a loader that takes exactly the box (module docstring)."""
    import torch

    global _CLASS
    if _CLASS is None:
        _CLASS = _slice_tensor_class()
    if tuple(data.shape) != tuple(b - a for a, b in box) and data.numel() != math.prod(b - a for a, b in box):
        raise ValueError(f"tensor {name!r}: {tuple(data.shape)} elements for the slice {_describe(box)}")
    whole = torch.empty(shape, dtype=data.dtype, device="meta").as_subclass(_CLASS)
    whole._slice, whole._box, whole._whole, whole._name = data, tuple(box), tuple(shape), name
    return whole


def is_slice(t) -> bool:
    return _CLASS is not None and isinstance(t, _CLASS)


def slice_of(t: "torch.Tensor") -> "torch.Tensor":
    """The bytes behind ``t``: a SliceTensor's slice, else ``t`` itself."""
    return t._slice if is_slice(t) else t


def box_of(t: "torch.Tensor") -> tuple[tuple, tuple[int, ...]] | None:
    """A SliceTensor's box and whole shape; None for any other tensor."""
    return (t._box, t._whole) if is_slice(t) else None


def with_slice(t: "torch.Tensor", data: "torch.Tensor") -> "torch.Tensor":
    """The SliceTensor ``t`` over other bytes of the same box (a copy, or a recording probe of the slice)."""
    return as_whole(data, t._box, t._whole, t._name)
