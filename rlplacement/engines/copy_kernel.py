"""A commit's copies in one kernel launch on a GPU: every eligible copy of a copy plan is cut into
chunks of equal size, which Triton programs copy with 16-byte loads and stores.

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

import dataclasses
import logging
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ALIGN = 16  # bytes per vector load and store
WORD = 4  # the kernels move int32 words, four per 16-byte vector
BLOCK_WORDS = 4096  # words per loop step of one program (16 KiB)
NUM_WARPS = 8
PROGRAMS_PER_SM = 8  # the strided variant's grid: as many programs as the SMs hold at once
TIMED_LAUNCHES = 2  # per variant, on the first launch, after one untimed (compiling) launch


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to launch the copies: ``chunks`` runs one program per chunk of ``chunk_bytes``;
    ``strided`` runs a fixed grid whose programs step through the chunks (neighbouring programs copy
    neighbouring chunks at any moment). ``evict_first``: load and store with an evict-first L2 hint
    (the bytes are not read again)."""

    name: str
    chunk_bytes: int
    strided: bool
    evict_first: bool


# measured on the first launch and the fastest kept: which does best depends on the GPU and the tensors
# (benchmarks/README.md has the variants' rates)
VARIANTS = (Variant("chunks-1M-evict-first", 1 << 20, False, True),
            Variant("chunks-1M", 1 << 20, False, False),
            Variant("strided-64K", 64 << 10, True, False),
            Variant("strided-256K-evict-first", 256 << 10, True, True))

_kernels: dict = {}


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


def chunk_table(copies: Sequence[tuple[int, int, int]], chunk_bytes: int):
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


def _build_kernels() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_row(row, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
        # the hints are what the table guarantees (eligible copies, 16-byte chunks): 16-byte vectors
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 16)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 16)
        n = tl.multiple_of(tl.load(row + 2), 4)
        offs = tl.arange(0, BLOCK)
        for start in range(0, n, BLOCK):
            o = start + offs
            m = o < n
            if EVICT_FIRST:
                tl.store(dst + o, tl.load(src + o, mask=m, eviction_policy="evict_first"), mask=m,
                         eviction_policy="evict_first")
            else:
                tl.store(dst + o, tl.load(src + o, mask=m), mask=m)

    @triton.jit
    def copy_chunks(table, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
        copy_row(table + tl.program_id(0).to(tl.int64) * 3, BLOCK, EVICT_FIRST)

    @triton.jit
    def copy_chunks_strided(table, num_rows, BLOCK: tl.constexpr, EVICT_FIRST: tl.constexpr):
        for r in range(tl.program_id(0), num_rows, tl.num_programs(0)):
            copy_row(table + r.to(tl.int64) * 3, BLOCK, EVICT_FIRST)

    return {"chunks": copy_chunks, "strided": copy_chunks_strided}


class FusedCopies:
    """The eligible copies of ``(dsts, srcs)`` as chunk tables on the GPU; ``rest`` indexes the others.

    The first :meth:`launch` runs every variant of ``variants`` (copying the same bytes again is
    harmless: sources are unchanged during an update), keeps the fastest, and captures its launch in
    a CUDA graph; later launches replay that graph (a Triton launch from Python costs ~0.1-0.3 ms)."""

    def __init__(self, dsts: Sequence["torch.Tensor"], srcs: Sequence["torch.Tensor"],
                 variants: Sequence[Variant] = VARIANTS):
        import torch

        picked = [i for i, (d, s) in enumerate(zip(dsts, srcs)) if d.is_cuda and eligible(d, s)]
        spans = [(dsts[i].data_ptr(), dsts[i].data_ptr() + dsts[i].numel() * dsts[i].element_size()) for i in picked]
        if overlapping(spans):
            picked, spans = [], []
        self.fused = picked
        chosen = set(picked)
        self.rest = [i for i in range(len(dsts)) if i not in chosen]
        self.nbytes = sum(end - start for start, end in spans)
        self.device = dsts[0].device if len(dsts) else None
        copies = [(srcs[i].data_ptr(), start, end - start) for i, (start, end) in zip(picked, spans)]
        self._dst_and_bytes = [(start, end - start) for start, end in spans]
        self._tables = {v: torch.from_numpy(chunk_table(copies, v.chunk_bytes)).to(self.device)
                        for v in variants} if picked else {}
        self.variant: Variant | None = None if len(self._tables) != 1 else next(iter(self._tables))
        self.timings_ms: dict[str, float] = {}
        self.graph = None
        self.graph_failure: str | None = None

    def retarget(self, srcs: Sequence["torch.Tensor"]) -> bool:
        """The same copies out of sources that moved (the trainer's memory after a hand-off, mapped anew
        every step under --colocate): each table's source column is rewritten in place, so the chosen
        variant and the captured graph, which reads the table where it is, stay; rebuilding them cost
        ~2-5 us of Python per copy (a Megatron model's grouped q/k/v make ~3x the copies) plus a capture.
        ``srcs`` are views of the same shapes and strides as before (the plan's recorded layout), so only
        their alignment can change. False (nothing changed) when a source is no longer 16-byte aligned."""
        import numpy as np
        import torch

        if not self._tables:
            return False
        ptrs = np.fromiter((srcs[i].data_ptr() for i in self.fused), dtype=np.int64, count=len(self.fused))
        if (ptrs % ALIGN).any():
            return False
        dst, nbytes = (np.asarray(col, dtype=np.int64) for col in zip(*self._dst_and_bytes))
        for variant, table in self._tables.items():
            table.copy_(torch.from_numpy(chunk_table(list(zip(ptrs, dst, nbytes)), variant.chunk_bytes)))
        return True

    @property
    def num_chunks(self) -> int:
        return len(self._tables[self.variant]) if self.variant is not None else 0

    def launch(self) -> None:
        """Queue the copies on the current stream (nothing when no copy was eligible)."""
        if not self._tables:
            return
        if self.graph is not None:
            self.graph.replay()
            return
        if self.variant is None:
            self.variant = self._fastest()
        if self.graph_failure is None:
            self.graph = self._captured()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._launch(self.variant)

    def _launch(self, variant: Variant) -> None:
        global _kernels
        if not _kernels:
            _kernels = _build_kernels()
        table = self._tables[variant]
        if variant.strided:
            sms = self._sm_count()
            _kernels["strided"][(min(len(table), sms * PROGRAMS_PER_SM),)](
                table, len(table), BLOCK=BLOCK_WORDS, EVICT_FIRST=variant.evict_first, num_warps=NUM_WARPS)
        else:
            _kernels["chunks"][(len(table),)](table, BLOCK=BLOCK_WORDS, EVICT_FIRST=variant.evict_first,
                                              num_warps=NUM_WARPS)

    def _sm_count(self) -> int:
        import torch

        return torch.cuda.get_device_properties(self.device).multi_processor_count

    def _fastest(self) -> Variant:
        """Each variant once untimed (it compiles), then ``TIMED_LAUNCHES`` times between CUDA events."""
        import torch

        for variant in self._tables:
            self._launch(variant)
            times = []
            for _ in range(TIMED_LAUNCHES):
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                self._launch(variant)
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            self.timings_ms[variant.name] = round(min(times), 3)
        best = min(self._tables, key=lambda v: self.timings_ms[v.name])
        self._tables = {best: self._tables[best]}  # the others' tables are let go
        return best

    def _captured(self):
        """The chosen launch as a CUDA graph on a side stream, or None (and why) where capture fails."""
        import torch

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._launch(self.variant)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - launches stay plain, ~0.1-0.3 ms each
            self.graph_failure = f"{type(exc).__name__}: {exc}"
            logger.warning("rlplacement: the commit's chunk kernel is launched without a CUDA graph (%s)",
                           self.graph_failure)
            graph = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph

    def summary(self) -> str:
        if self.variant is None:
            return "not launched yet"
        how = "graph replay" if self.graph is not None else f"plain launches ({self.graph_failure})"
        times = ", ".join(f"{k} {v} ms" for k, v in self.timings_ms.items())
        return f"{self.variant.name} by {how}" + (f"; first launch timed {times}" if times else "")


def fuse(dsts: Sequence["torch.Tensor"], srcs: Sequence["torch.Tensor"],
         variants: Sequence[Variant] = VARIANTS) -> "FusedCopies | str":
    """The fused copies, or why there are none (no GPU, no Triton, nothing eligible)."""
    if not dsts or not dsts[0].is_cuda:
        return "the copies are not on a GPU"
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    fused = FusedCopies(dsts, srcs, variants)
    if not fused.fused:
        return "no copy is a contiguous, 16-byte aligned byte copy into a destination of its own"
    return fused
