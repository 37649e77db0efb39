"""A commit's copies in one kernel launch on a GPU: every eligible copy of a copy plan is cut into
chunks of equal size, and one Triton program copies one chunk with 16-byte loads and stores.

Why one launch: replaying ~400 copies with one ``copy_`` each costs ~10 µs of Python and driver
work per copy (3.6 ms for a 4B model, more than the 3.4 ms the bytes take), and every memcpy ends
in a tail where the GPU is not full; ``_foreach_copy_`` moved the same bytes at ~65% of a flat
copy. Equal chunks keep every SM busy until the last chunk, whatever the tensors' sizes.

A copy is *eligible* when source and destination are contiguous, of one dtype and size, and both
addresses and the byte count are multiples of 16 (bf16 and fp32 weights of real models are). The
kernel runs chunks in any order, so it is used only when no two destinations overlap; anything
else stays with the plan's per-copy path. The chunk table holds raw addresses: it is valid while
the plan's pairs are (the plan rebuilds it with them), and the plan checks before every replay that
the destinations are still the model's parameters.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # one program's share; ~7,000 programs for a 4B model, many waves over 132 SMs
ALIGN = 16  # bytes per vector load and store
WORD = 4  # the kernel moves int32 words, four per 16-byte vector
BLOCK_WORDS = 4096  # words per loop step of one program (16 KiB)
NUM_WARPS = 8

_kernel = None


def eligible(dst: "torch.Tensor", src: "torch.Tensor") -> bool:
    """Whether the copy ``dst <- src`` is a plain, aligned byte copy the chunk kernel can do."""
    nbytes = dst.numel() * dst.element_size()
    return (dst.dtype == src.dtype and dst.numel() == src.numel() and nbytes > 0 and nbytes % ALIGN == 0
            and dst.is_contiguous() and src.is_contiguous()
            and dst.data_ptr() % ALIGN == 0 and src.data_ptr() % ALIGN == 0)


def overlapping(ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether any two ``[start, end)`` byte ranges share a byte."""
    ordered = sorted(r for r in ranges if r[1] > r[0])
    return any(b[0] < a[1] for a, b in zip(ordered, ordered[1:]))


def chunk_table(copies: Sequence[tuple[int, int, int]], chunk_bytes: int = CHUNK_BYTES):
    """Rows ``(source address, destination address, words)`` for ``copies`` of ``(source, destination,
    bytes)``: each copy cut into chunks of ``chunk_bytes`` (the last one shorter), as an int64 array."""
    import numpy as np

    if chunk_bytes % ALIGN:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not a multiple of {ALIGN}")
    if not copies:
        return np.zeros((0, 3), dtype=np.int64)
    src, dst, nbytes = (np.asarray(col, dtype=np.int64) for col in zip(*copies))
    counts = -(-nbytes // chunk_bytes)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(int(counts.sum()), dtype=np.int64) - first) * chunk_bytes
    owner = np.repeat(np.arange(len(copies)), counts)
    length = np.minimum(chunk_bytes, nbytes[owner] - offset)
    return np.stack([src[owner] + offset, dst[owner] + offset, length // WORD], axis=1)


def _build_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_chunks(table, BLOCK: tl.constexpr):
        row = table + tl.program_id(0).to(tl.int64) * 3
        # the hints are what the table guarantees (eligible copies, 16-byte chunks): 16-byte vectors
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        n = tl.multiple_of(tl.load(row + 2), 4)
        offs = tl.arange(0, BLOCK)
        for start in range(0, n, BLOCK):
            o = start + offs
            m = o < n
            tl.store(dst + o, tl.load(src + o, mask=m, eviction_policy="evict_first"), mask=m,
                     eviction_policy="evict_first")

    return copy_chunks


class FusedCopies:
    """The eligible copies of ``(dsts, srcs)`` as one chunk table on the GPU; ``rest`` indexes the others."""

    def __init__(self, dsts: Sequence["torch.Tensor"], srcs: Sequence["torch.Tensor"], chunk_bytes: int | None = None):
        import torch

        picked = [i for i, (d, s) in enumerate(zip(dsts, srcs)) if d.is_cuda and eligible(d, s)]
        spans = [(dsts[i].data_ptr(), dsts[i].data_ptr() + dsts[i].numel() * dsts[i].element_size()) for i in picked]
        if overlapping(spans):
            picked, spans = [], []
        self.fused = picked
        chosen = set(picked)
        self.rest = [i for i in range(len(dsts)) if i not in chosen]
        self.nbytes = sum(end - start for start, end in spans)
        rows = chunk_table([(srcs[i].data_ptr(), start, end - start) for i, (start, end) in zip(picked, spans)],
                           chunk_bytes or CHUNK_BYTES)
        self.num_chunks = len(rows)
        self.table = torch.from_numpy(rows).to(dsts[picked[0]].device) if picked else None

    def launch(self) -> None:
        """Queue the chunk kernel on the current stream (nothing when no copy was eligible)."""
        global _kernel
        if self.table is None:
            return
        if _kernel is None:
            _kernel = _build_kernel()
        _kernel[(self.num_chunks,)](self.table, BLOCK=BLOCK_WORDS, num_warps=NUM_WARPS)


def fuse(dsts: Sequence["torch.Tensor"], srcs: Sequence["torch.Tensor"]) -> "FusedCopies | str":
    """The fused copies, or why there are none (no GPU, no Triton, nothing eligible)."""
    if not dsts or not dsts[0].is_cuda:
        return "the copies are not on a GPU"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    fused = FusedCopies(dsts, srcs)
    if not fused.fused:
        return "no copy is a contiguous, 16-byte aligned byte copy into a destination of its own"
    return fused
