"""Per-tensor byte deltas for the ``disk-delta`` mode: encode version N's bytes against the bytes
the engines hold, decode them back, bit for bit. Pure numpy + zstd, no torch.

Encodings of one tensor (``new`` and ``old`` are 1-D uint8 arrays of the same length):

* ``xor``: zstd(new ^ old). Applies exactly once, on exactly ``old``: applied to anything else
  (``new`` included) it yields garbage, which the version's per-tensor checksum refuses.
* ``overwrite``: the positions of the changed bytes (as gaps between them, uint32, or uint64 for
  tensors of 4 GiB and more) followed by the new bytes at those positions, zstd'd together.
  Idempotent: applying it to ``old`` or to ``new`` gives ``new``.
* ``full``: zstd(new); used where there is no comparable old tensor (first version without a
  base checkpoint, a new name, a dtype or shape change).
* ``unchanged``: nothing is stored; the receiver keeps its bytes.

A receiver that keeps only a slice of a tensor (a box of its elements) decodes that slice alone
(:func:`decode_slice`) from its slice of the base: xor and overwrite are bytewise, so the slice of the
result needs only the slice of the base. A ``full`` or ``xor`` payload is decompressed as a stream, a few
rows at a time (:data:`SLICE_STREAM_BYTES`), keeping only the slice's bytes and stopping after its last
row, so decoding a slice never holds the whole tensor; an ``overwrite`` payload (its size is the changed
bytes, not the tensor) is decompressed whole.

zstd level 1: on sparse changes (1-3% of bytes) the xor stream is mostly zeros and compresses
at memory speed; the level barely changes the ratio there.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlplacement.errors import DeltaDecodeError

if TYPE_CHECKING:
    import numpy as np

ENCODINGS = ("xor", "overwrite")
CHECKSUM_KIND = "xxh3-64"
COMPRESSION = "zstd-1"
ZSTD_LEVEL = 1

FULL, UNCHANGED = "full", "unchanged"
SLICE_STREAM_BYTES = 16 << 20
"""Decompressed bytes a slice decode holds at a time (whole rows of the tensor, at least one)."""


@dataclasses.dataclass(frozen=True)
class EncodedTensor:
    """One tensor's stored form. ``changed_bytes`` counts bytes that differ from ``old`` (all of
    them for ``full``); ``extra`` goes into the index entry (what decoding needs besides bytes)."""

    encoding: str
    payload: bytes
    changed_bytes: int
    extra: dict


def checksum(data: "np.ndarray") -> str:
    """xxh3-64 hex of a contiguous array's bytes: the same digest as ``base.tensor_checksum``
    of a tensor with these bytes, so the two sides compare directly."""
    import xxhash

    return xxhash.xxh3_64_hexdigest(memoryview(data).cast("B"))


def _compress(data) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def _decompress(payload, size: int) -> bytes:
    import zstandard

    try:
        out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=max(size, 1))
    except zstandard.ZstdError as exc:
        raise DeltaDecodeError(f"zstd: {exc}") from exc
    if len(out) != size:
        raise DeltaDecodeError(f"decoded {len(out)} bytes, expected {size}")
    return out


def _index_dtype(nbytes: int) -> str:
    return "uint32" if nbytes < 2**32 else "uint64"


def encode(new: "np.ndarray", old: "np.ndarray | None", encoding: str,
           scratch: "np.ndarray | None" = None) -> EncodedTensor:
    """``new`` against ``old`` (None: no comparable base -> ``full``). ``scratch``: a uint8 array of
    at least ``new.size`` bytes to hold the xor (saves allocating and faulting in fresh pages)."""
    import numpy as np

    if encoding not in ENCODINGS:
        raise ValueError(f"delta encoding {encoding!r} is unknown: use one of {', '.join(ENCODINGS)} "
                         f"(--update-weight-delta-encoding)")
    if old is None:
        return EncodedTensor(FULL, _compress(new), int(new.size), {})
    if old.shape != new.shape:
        raise ValueError(f"cannot diff {new.size} bytes against {old.size}")
    diff = np.bitwise_xor(new, old, out=scratch[:new.size] if scratch is not None and scratch.size >= new.size else None)
    if encoding == "xor":
        changed = int(np.count_nonzero(diff))
        if not changed:
            return EncodedTensor(UNCHANGED, b"", 0, {})
        return EncodedTensor("xor", _compress(diff), changed, {})
    positions = np.flatnonzero(diff)
    if not positions.size:
        return EncodedTensor(UNCHANGED, b"", 0, {})
    index_dtype = _index_dtype(new.size)
    gaps = np.diff(positions, prepend=0).astype(index_dtype)
    raw = gaps.tobytes() + new[positions].tobytes()
    return EncodedTensor("overwrite", _compress(raw), int(positions.size),
                         {"count": int(positions.size), "index_dtype": index_dtype})


def _overwrites(payload, nbytes: int, extra: dict) -> tuple["np.ndarray", "np.ndarray"]:
    """An ``overwrite`` payload's changed byte positions (int64, in the tensor's ``nbytes``) and new bytes."""
    import numpy as np

    count, index_dtype = int(extra["count"]), np.dtype(extra["index_dtype"])
    raw = _decompress(payload, count * (index_dtype.itemsize + 1))
    positions = np.cumsum(np.frombuffer(raw, dtype=index_dtype, count=count), dtype=np.int64)
    if count and (positions[-1] >= nbytes or positions[0] < 0):
        raise DeltaDecodeError(f"overwrite position {int(positions[-1])} outside {nbytes} bytes")
    return positions, np.frombuffer(raw, dtype=np.uint8, offset=count * index_dtype.itemsize)


def decode(encoding: str, payload, base: "np.ndarray | None", nbytes: int, extra: dict) -> "np.ndarray":
    """The new bytes (a fresh writable uint8 array; ``base`` is never modified)."""
    import numpy as np

    if encoding == FULL:
        return np.frombuffer(bytearray(_decompress(payload, nbytes)), dtype=np.uint8)
    if base is None or base.size != nbytes:
        raise DeltaDecodeError(f"a {encoding} delta needs the {nbytes} base bytes, "
                               f"got {'none' if base is None else base.size}")
    if encoding == "xor":
        diff = np.frombuffer(_decompress(payload, nbytes), dtype=np.uint8)
        return np.bitwise_xor(base, diff)
    if encoding == "overwrite":
        positions, values = _overwrites(payload, nbytes, extra)
        out = base.copy()
        out[positions] = values
        return out
    raise DeltaDecodeError(f"unknown tensor encoding {encoding!r}")


def cut_bytes(data: "np.ndarray", shape: tuple[int, ...], itemsize: int, box) -> "np.ndarray":
    """The bytes of the elements of ``box`` (``[start, stop)`` per dimension) of a C-order tensor of
    ``shape`` whose raw bytes are ``data``, as a fresh, writable contiguous uint8 array (never a view of
    ``data``, which may be a read-only map of a file)."""
    import numpy as np

    shaped = data.reshape(tuple(shape) + (itemsize,))
    return np.array(shaped[tuple(slice(a, b) for a, b in box)], order="C", copy=True).reshape(-1)


def _decompressed_slice(payload, nbytes: int, shape: tuple[int, ...], itemsize: int, box) -> "np.ndarray":
    """The bytes of ``box`` of the tensor whose raw bytes ``payload`` compresses, read from a decompressing
    stream in chunks of whole rows (:data:`SLICE_STREAM_BYTES`) up to the box's last row: the rows before the
    box are decompressed and dropped, the rows after it never decompressed. The bytes read are checked to be
    the tensor's up to there; the slice's checksum checks the rest."""
    import numpy as np
    import zstandard

    if not shape:
        return cut_bytes(np.frombuffer(_decompress(payload, nbytes), dtype=np.uint8), shape, itemsize, box)
    rows = shape[0]
    row_bytes = nbytes // rows if rows else 0
    (first, last), rest = box[0], tuple(box[1:])
    per_chunk = max(1, SLICE_STREAM_BYTES // max(row_bytes, 1))
    pieces = []
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(payload)
        row = 0
        while row < last:
            n = min(per_chunk, last - row)
            chunk = _read_exactly(reader, n * row_bytes)
            if row + n > first:
                lo = max(first, row)
                pieces.append(cut_bytes(np.frombuffer(chunk, dtype=np.uint8), (n, *shape[1:]), itemsize,
                                        ((lo - row, n), *rest)))
            row += n
    except zstandard.ZstdError as exc:
        raise DeltaDecodeError(f"zstd: {exc}") from exc
    return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]


def _read_exactly(reader, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        got = reader.read(size - len(out))
        if not got:
            raise DeltaDecodeError(f"the payload ends after {len(out)} of {size} bytes of a row chunk")
        out += got
    return bytes(out)


def decode_slice(encoding: str, payload, base: "np.ndarray | None", nbytes: int, extra: dict,
                 shape: tuple[int, ...], itemsize: int, box) -> "np.ndarray":
    """The new bytes of ``box`` of the tensor (``shape``, ``itemsize``, ``nbytes`` in all), from the payload
    of the whole tensor and ``base``, the slice's old bytes (a fresh array; ``base`` is never modified)."""
    import numpy as np

    if any(b <= a for a, b in box):  # a piece outside the worker's slice (transfer.pieces): nothing to read
        return np.zeros(0, dtype=np.uint8)
    if encoding == FULL:
        return _decompressed_slice(payload, nbytes, shape, itemsize, box)
    size = itemsize
    for a, b in box:
        size *= b - a
    if base is None or base.size != size:
        raise DeltaDecodeError(f"a {encoding} delta of a slice needs its {size} base bytes, "
                               f"got {'none' if base is None else base.size}")
    if encoding == "xor":
        return np.bitwise_xor(base, _decompressed_slice(payload, nbytes, shape, itemsize, box))
    if encoding == "overwrite":
        positions, values = _overwrites(payload, nbytes, extra)
        count = positions.size
        index = np.unravel_index(positions // itemsize, tuple(shape))
        inside = np.ones(count, dtype=bool)
        for k, (a, b) in enumerate(box):
            inside &= (index[k] >= a) & (index[k] < b)
        element = np.ravel_multi_index(tuple(index[k][inside] - a for k, (a, _) in enumerate(box)),
                                       tuple(b - a for a, b in box)) if count else np.zeros(0, dtype=np.int64)
        out = base.copy()
        out[element * itemsize + positions[inside] % itemsize] = values[inside]
        return out
    raise DeltaDecodeError(f"unknown tensor encoding {encoding!r}")
