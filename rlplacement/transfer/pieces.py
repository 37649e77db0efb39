"""Pieces: a trainer rank sends the part of a tensor it holds (an FSDP rank its dim-0 rows, a Megatron rank what
its TP shard is of the HF tensor, split by rows over the data-parallel replicas) instead of a whole tensor
gathered for it, and each engine worker assembles the tensor, or its slice of it, from every sender's pieces.

A piece travels as an ordinary tensor of the bucket under a *piece name* that says what it is part of:
``{name}#piece[0:64, 0:128]of[128, 128]`` (:func:`piece_name`: the HF name, the piece's box in the whole
tensor, the whole shape). Everything between sender and receiver (buckets, manifests, checksums, regions)
handles it as a tensor of that name, so every wire mode carries pieces unchanged. A worker that keeps a
slice of the tensor receives the piece's part of its slice (:func:`kept_part`, which
``shards.region_manifest`` applies), possibly nothing.

:class:`PieceAssembler` is the receiving end: it copies each arriving piece into a buffer of the worker's box
of the tensor (its slice, else the whole) and hands the tensor on, under its HF name, once its box is
covered; a piece that is by itself all the worker keeps of a tensor is handed on as it arrived, uncopied (a
column-parallel slice when the trainer's ranks and the engine's workers cut rows alike). Coverage is
counted in elements: the senders' pieces are disjoint by construction (FSDP's shards and Megatron's TP
boxes and row parts are), and the transfer plan's coverage check (``transfer.plan.build``) is what proves a
layout's pieces tile every tensor; an update that ends with a tensor short of its box fails by name.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

from rlplacement.transfer.base import NamedTensor, TransferError
from rlplacement.transfer.plan.boxes import Box, describe, intersect, volume, whole

if TYPE_CHECKING:
    import torch

PIECE = "#piece"


def trainer_sends_pieces(backend: str, world: int, who: str, *, lora: bool) -> bool:
    """The trainer's ranks each send the parts of the HF tensors they hold (an FSDP or torchtitan rank its rows,
    in HF's layout, and its own experts whole, FSDP2 sharding a fused experts parameter by expert; a Megatron
    rank its TP shards as HF boxes, its own experts' too): such a trainer of several ranks where every rank
    sends (``who`` is ``transfer.spec.SHARES``), without LoRA (a merged weight is computed from the gathered
    factors). A torchtitan Llama q/k weight whose rows at some rank split a head (its rows are permuted per
    head) is still gathered onto one rank. ``backend`` is a registered backend's name; it sends pieces where its
    spec says so (``BackendSpec.sends_pieces``). What the backends stream, what the simulator prices as running
    and what an engine's staging is sized for all ask this."""
    from rlplacement.specs.backend import backend_spec
    from rlplacement.transfer.spec import SHARES

    return world > 1 and who == SHARES and not lora and backend_spec(backend).sends_pieces


def row_part(box: Box, parts: int, index: int) -> tuple[int, int] | None:
    """Rows ``[start, stop)``, relative to ``box``'s first row, of holder ``index`` of ``parts`` that hold ``box``
    alike (data-parallel replicas) and split its sending: ``torch.chunk``'s split of its rows, as FSDP2 shards;
    None for a holder past the last row."""
    rows = box[0][1] - box[0][0]
    step = -(-rows // parts)
    start = index * step
    return (start, min(rows, start + step)) if start < rows else None


def row_pieces(name: str, tensor: "torch.Tensor", parts: int) -> list[tuple[int, str, "torch.Tensor"]]:
    """``(holder index, piece name, rows)`` of each of ``parts`` holders' rows of the whole ``tensor``
    (:func:`row_part`: an FSDP2 ``Shard(0)`` layout); holders past the last row get none."""
    shape, out = tuple(tensor.shape), []
    for index in range(parts):
        rows = row_part(whole(shape), parts, index)
        if rows is not None:
            box = ((rows[0], rows[1]),) + whole(shape)[1:]
            out.append((index, piece_name(name, box, shape), tensor[rows[0]:rows[1]]))
    return out


def piece_name(name: str, box: Box, shape: tuple[int, ...]) -> str:
    """The name piece ``box`` of tensor ``name`` (whole ``shape``) travels under."""
    return f"{name}{PIECE}{describe(box)}of[{', '.join(str(n) for n in shape)}]"


@functools.lru_cache(maxsize=1 << 16)
def parse_piece(key: str) -> tuple[str, Box, tuple[int, ...]] | None:
    """``(name, box, whole shape)`` of a :func:`piece_name`; None for any other name (cached: an update's
    names are the last update's)."""
    name, sep, rest = key.partition(PIECE)
    if not sep:
        return None
    ranges, _, shape = rest.partition("of")
    box = tuple(tuple(int(x) for x in r.split(":")) for r in ranges.strip("[]").split(", "))
    return name, box, tuple(int(n) for n in shape.strip("[]").split(", "))


def split_piece_key(key: str) -> tuple[str | None, str]:
    """A key that starts with a piece name, split after it: ``(piece name, the rest)``; ``(None, key)`` for
    any other key."""
    at = key.find(PIECE)
    if at < 0:
        return None, key
    end = key.index("]", key.index("of[", at)) + 1
    return key[:end], key[end:]


def is_piece(key: str) -> bool:
    return PIECE in key


def kept_part(piece_box: Box, kept: Box) -> Box:
    """The part of piece ``piece_box`` inside the worker's ``kept`` box, in the piece's own coordinates; a box
    of no elements where they do not meet."""
    common = intersect(piece_box, kept)
    if common is None:
        return tuple((0, 0) for _ in piece_box)
    return tuple((a - p, b - p) for (a, b), (p, _) in zip(common, piece_box))


def piece_boxes(key: str, part: Box | None) -> tuple[str, Box, tuple[int, ...]]:
    """``(name, box in the whole tensor, whole shape)`` of what arrived under piece name ``key``: the piece,
    or its ``part`` (a box in the piece's coordinates, :func:`kept_part`)."""
    name, box, shape = parse_piece(key)
    if part is not None:
        box = tuple((p + a, p + b) for (a, b), (p, _) in zip(part, box))
    return name, box, shape


def _host_copy(dst: "torch.Tensor", src: "torch.Tensor") -> bool:
    """In host memory, one numpy copy of the raw bytes (torch's ``copy_`` starts an OpenMP team per call, which
    dominates a few hundred small pieces on a few cores: ``bucket.pack_into`` does the same); False elsewhere."""
    from rlplacement.transfer.bucket import raw_kinds

    kind = raw_kinds(src.element_size()) if dst.device.type == src.device.type == "cpu" else None
    if kind is None or dst.dtype != src.dtype:
        return False
    import numpy as np

    np.copyto(dst.view(kind[0]).numpy(), src.view(kind[0]).numpy())
    return True


class _Placement(NamedTuple):
    name: str
    box: Box
    shape: tuple[int, ...]
    elements: int
    kept: Box
    kept_elements: int
    is_all_kept: bool
    narrows: tuple[tuple[int, int, int], ...]  # (dim, start, length) of the piece's region in the kept buffer


class PieceAssembler:
    """One engine worker's assembly of an update's pieces, fed bucket by bucket from every sender's channel.

    ``keeps``: the worker's slices (``transfer.shards.Keeps``); a tensor it keeps is assembled into a buffer
    of its box and handed on as a tensor of the whole shape over those bytes (``slice_tensor.as_whole``), any
    other into a whole buffer. ``keep_buffers``: buffers stay for the next update (full staging: the staged
    update is these buffers until it is committed); else each is let go once handed on (bucket staging: a
    worker holds only the tensors whose pieces are still arriving, which the senders' common order bounds
    by about one bucket per sender). ``checksums``: a dict that gets the checksum of every tensor and piece that
    arrived whole (a worker keeping slices has its channels check what arrives). ``batch_copies``: a feed's
    device copies go in one ``_foreach_copy_`` at its end, else one ``copy_`` each as its piece is placed (the
    benchmark's baseline, ``benchmarks/gpu/assemble_pieces.py``)."""

    def __init__(self, keeps: dict | None, *, keep_buffers: bool, checksums: dict | None = None,
                 batch_copies: bool = True):
        self.keeps = keeps or {}
        self.batch_copies = batch_copies
        self.keep_buffers = keep_buffers
        self.checksums = checksums
        self._buffers: dict[str, "torch.Tensor"] = {}
        self._pending: dict[str, list] = {}  # name -> [elements still missing, box, whole shape]
        self._copies: tuple[list, list] = ([], [])  # device copies of this feed, made at its end in one call
        self._placements: dict = {}  # (key, part) -> _Placement, for the keeps they were worked out for
        self._placements_for: dict | None = None
        self._views: dict = {}  # id of a _Placement -> (buffer, the piece's region of it), where buffers are kept
        self.seen = False
        self.peak_bytes = 0  # the most the buffers held at once in this update

    def waiting_on(self, pairs: list[NamedTensor]) -> set[str]:
        """The tensors of which ``pairs`` (a bucket fed already) brought pieces and which still miss others'."""
        return {name for name in {parse_piece(key)[0] for key, _ in pairs if is_piece(key)} if name in self._pending}

    def is_pending(self, name: str) -> bool:
        return name in self._pending

    def begin(self, checksums: dict | None) -> None:
        """A new update: nothing pending (a failed update's partial tensors are dropped)."""
        self._pending = {}
        self.peak_bytes = self.nbytes
        self._copies = ([], [])
        self.checksums = checksums
        self.seen = False

    def feed(self, pairs: list[NamedTensor]) -> list[NamedTensor]:
        """``pairs`` as they arrived (pieces and whole tensors); returns the whole tensors, and the tensors
        this bucket completed, in arrival order."""
        from rlplacement.transfer.slice_tensor import box_of, slice_of

        out = []
        for key, t in pairs:
            where = box_of(t)
            if where is None and self.checksums is not None:  # as it arrived: the senders' report sums the same
                from rlplacement.transfer.base import tensor_checksum

                self.checksums[key] = tensor_checksum(t)
            if not is_piece(key):
                out.append((key, t))
                continue
            self.seen = True
            done = self._place(self._placement(key, where[0] if where is not None else None), slice_of(t))
            if done is not None:
                out.append(done)
        dsts, srcs = self._copies
        if dsts:  # a GPU's copies of the bucket in a few multi-tensor kernels, not a launch per piece
            import torch

            torch._foreach_copy_(dsts, srcs)
            self._copies = ([], [])
        return out

    def _placement(self, key: str, part: Box | None) -> "_Placement":
        """Where the piece (or ``part`` of it) arriving under ``key`` goes, worked out once per key and keeps:
        an update's pieces are the last update's, and this arithmetic is most of a piece's cost on a GPU."""
        if self._placements_for is not self.keeps:
            self._placements, self._placements_for, self._views = {}, self.keeps, {}
        found = self._placements.get((key, part))
        if found is None:
            name, box, shape = piece_boxes(key, part)
            kept = self.keeps.get(name, whole(shape))
            if volume(box) and intersect(box, kept) != box:
                raise TransferError(f"a piece {describe(box)} of {name!r} arrived where this worker keeps "
                                    f"{describe(kept)} of it")
            narrows = tuple((d, a - k, b - a) for d, ((a, b), (k, c)) in enumerate(zip(box, kept)) if (a, b) != (k, c))
            found = self._placements[(key, part)] = _Placement(name, box, shape, volume(box), kept, volume(kept),
                                                               box == kept, narrows)
        return found

    def _place(self, at: "_Placement", data: "torch.Tensor") -> NamedTensor | None:
        if not at.elements:  # a piece outside this worker's slice: its part of it is empty
            return None
        name, kept = at.name, at.kept
        pending = self._pending.get(name)
        if pending is None and at.is_all_kept:  # one piece is all this worker keeps of it: handed on, not copied
            return self._handed_on(name, data.reshape(tuple(b - a for a, b in kept)), kept, at.shape)
        if pending is None:
            pending = self._pending[name] = [at.kept_elements, kept, at.shape]
        buffer = self._buffer(name, kept, data)
        view = self._views.get(id(at)) if self.keep_buffers else None
        if view is None or view[0] is not buffer:
            region = buffer
            for d, start, length in at.narrows:
                region = region.narrow(d, start, length)
            view = (buffer, region)
            if self.keep_buffers:
                self._views[id(at)] = view
        view = view[1]
        src = data.reshape(view.shape)
        if not self.batch_copies:
            view.copy_(src)
        elif not _host_copy(view, src):
            self._copies[0].append(view)
            self._copies[1].append(src)
        pending[0] -= at.elements
        if pending[0] > 0:
            return None
        if pending[0] < 0:
            raise TransferError(f"{name!r}: pieces of this update overlap (more elements arrived than "
                                f"{describe(kept)} holds)")
        del self._pending[name]
        return self._handed_on(name, self._buffers[name] if self.keep_buffers else self._buffers.pop(name), kept,
                               at.shape)

    @staticmethod
    def _handed_on(name: str, data: "torch.Tensor", kept: Box, shape: tuple[int, ...]) -> NamedTensor:
        if kept == whole(shape):
            return name, data
        from rlplacement.transfer.slice_tensor import as_whole

        return name, as_whole(data, kept, shape, name)

    def _buffer(self, name: str, kept: Box, like: "torch.Tensor") -> "torch.Tensor":
        shape = tuple(b - a for a, b in kept)
        buf = self._buffers.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != like.dtype or buf.device != like.device:
            import torch

            buf = self._buffers[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
            self.peak_bytes = max(self.peak_bytes, self.nbytes)
        return buf

    def finish(self) -> None:
        """The update is off the wire: raise naming a tensor whose pieces did not all arrive."""
        if self._pending:
            name, (missing, kept, _) = next(iter(self._pending.items()))
            raise TransferError(f"{name!r}: {missing} of the {volume(kept)} elements of {describe(kept)} this "
                                f"worker keeps arrived from no sender")

    @property
    def nbytes(self) -> int:
        return sum(math.prod(b.shape) * b.element_size() for b in self._buffers.values())

    def release(self) -> int:
        n = self.nbytes
        self._buffers, self._views = {}, {}
        return n
