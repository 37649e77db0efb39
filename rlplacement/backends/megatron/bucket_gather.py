"""The collective machinery under Megatron's update streams (:mod:`.update_streams`): a stage's parameters
described as rows ``(global name, local shape, dtype, TP partition dim)``, cut into buckets of local bytes,
each bucket's TP shards gathered in one collective of flat bytes, and where the experts live under expert
parallelism.

Invariants: every rank of a TP group cuts the same rows into the same buckets (the rows come from the same
stage, in the same order), so their collectives pair up; a bucket's gather is started at once and finished
when its tensors are asked for, so a caller can overlap one bucket's gather with handing on the previous.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from rlplacement.families import megatron_mapping as mapping


class CollectiveCount:
    """Collectives this rank issued in its TP and PP groups during one weight stream."""

    def __init__(self) -> None:
        self.count = 0

    def add(self, n: int = 1) -> None:
        self.count += n


def flat_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding ``tensors`` back to back (any dtypes)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def byte_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def split_bytes(flat: torch.Tensor, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The tensors :func:`flat_bytes` packed, as views of ``flat`` (shapes and dtypes in order)."""
    out, offset = [], 0
    for shape, dtype in specs:
        n = byte_size(shape, dtype)
        out.append(flat[offset:offset + n].view(dtype).view(shape))
        offset += n
    return out


def cut_into_buckets(meta: list[tuple], limit: int) -> list[list[tuple]]:
    """``meta`` rows cut into runs of at most ``limit`` local bytes (a larger tensor goes alone)."""
    buckets, current, size = [], [], 0
    for row in meta:
        n = byte_size(row[1], row[2])
        if current and size + n > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(row)
        size += n
    return buckets + ([current] if current else [])


class BucketGather:
    """One bucket's TP gather, started at once (``async_op``) and finished by :meth:`result`: the full
    tensors on TP rank ``dst`` of the stage's replica (None elsewhere), or on every TP rank where ``dst`` is
    None (an all-gather). Replicated tensors are taken from that rank's own parameters."""

    def __init__(self, bucket: list[tuple], params: dict[str, torch.Tensor], counter: CollectiveCount,
                 dst: int | None = 0):
        from megatron.core import parallel_state as ps

        self.bucket, self.params = bucket, params
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.first = dst is None or ps.get_tensor_model_parallel_rank() == dst
        self.split = [row for row in bucket if row[3] is not None and self.tp > 1]
        self.work, self.shards = None, None
        if self.split:
            group = ps.get_tensor_model_parallel_group()
            local = flat_bytes([params[row[0]] for row in self.split])
            self.shards = [torch.empty_like(local) for _ in range(self.tp)] if self.first else None
            if dst is None:
                self.work = dist.all_gather(self.shards, local, group=group, async_op=True)
            else:
                self.work = dist.gather(local, self.shards, dst=dist.get_global_rank(group, dst), group=group,
                                        async_op=True)
            counter.add()

    def result(self) -> list[tuple[str, torch.Tensor]] | None:
        if self.work is not None:
            self.work.wait()
        if not self.first:
            return None
        gathered = {}
        if self.split:
            specs = [(row[1], row[2]) for row in self.split]
            per_rank = [split_bytes(flat, specs) for flat in self.shards]
            for i, row in enumerate(self.split):
                gathered[row[0]] = mapping.tp_unshard(row[0], [r[i] for r in per_rank], row[3])
        return [(row[0], gathered.get(row[0], self.params[row[0]].detach())) for row in self.bucket]


def gathered_in_turn(work: list[tuple[list[tuple], int | None]], params: dict[str, torch.Tensor],
              counter: CollectiveCount) -> Iterator[list[tuple[str, torch.Tensor]] | None]:
    """Each ``(bucket, TP rank)`` of ``work`` gathered to that TP rank (every TP rank where None:
    :class:`BucketGather`), in order: its full tensors there, None on the others. The next bucket's gather is started before the current
    one is handed on, so at most two buckets' full tensors are held."""
    pending = BucketGather(work[0][0], params, counter, work[0][1]) if work else None
    for i in range(len(work)):
        current, pending = pending, (BucketGather(work[i + 1][0], params, counter, work[i + 1][1])
                                     if i + 1 < len(work) else None)
        yield current.result()


def is_expert(name: str) -> bool:
    """Whether a (global) megatron parameter name is an expert's."""
    return mapping.expert_index(name) is not None


class ExpertRanks:
    """Where the experts live under expert parallelism (EP > 1): each expert-parallel rank q holds experts
    ``[q E/EP, (q+1) E/EP)`` of every sparse layer, replicated over the expert-data-parallel ranks; global
    names (:func:`global_named_parameters`) carry the global expert index. Learned once per model (its
    parallel groups do not change while it lives): every rank's (stage, TP rank, EP rank, expert-DP rank),
    one all-gather of small objects, counted in the first stream's collectives."""

    _of_model: "weakref.WeakKeyDictionary" = None  # model -> its ExpertRanks (see of)

    def __init__(self, model, counter: CollectiveCount):
        from megatron.core import parallel_state as ps

        self.size = ps.get_expert_model_parallel_world_size()
        self.local = model.config.num_moe_experts // self.size
        self.rank, self.data_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
        self.data_size = ps.get_expert_data_parallel_world_size()
        mine = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), self.rank, self.data_rank)
        coords: list = [None] * dist.get_world_size()
        dist.all_gather_object(coords, mine)
        counter.add()
        self._sources = {(c[0], c[2]): r for r, c in enumerate(coords) if c[1] == 0 and c[3] == 0}

    @classmethod
    def of(cls, model, counter: CollectiveCount) -> "ExpertRanks | None":
        """None without expert parallelism; else the model's, made at its first stream (collective then)."""
        import weakref

        from megatron.core import parallel_state as ps

        if not getattr(model.config, "num_moe_experts", None) or ps.get_expert_model_parallel_world_size() == 1:
            return None
        if cls._of_model is None:
            cls._of_model = weakref.WeakKeyDictionary()
        if model not in cls._of_model:
            cls._of_model[model] = cls(model, counter)
        return cls._of_model[model]

    def source(self, stage: int, q: int) -> int:
        """The global rank that sends stage ``stage``'s experts of expert-parallel rank ``q`` to rank 0."""
        return self._sources[(stage, q)]

    def sends(self, q: int) -> bool:
        """Whether this rank takes part in sending expert-parallel rank ``q``'s experts to rank 0."""
        return self.rank == q and self.data_rank == 0

    def rows_of(self, q: int, rows: list[tuple]) -> list[tuple]:
        """The rows of expert-parallel rank ``q``'s experts, from any rank's rows of its own (same shapes)."""
        return [(mapping.with_expert_index(row[0], mapping.expert_index(row[0]) % self.local + q * self.local), *row[1:])
                for row in rows]


def stage_source_rank(stage: int) -> int:
    """Global rank of (pipeline stage, TP rank 0, DP rank 0).

    megatron's default rank order "tp-cp-ep-dp-pp" makes the pipeline the outermost dimension, so a
    stage owns a contiguous block of ranks and the block's first rank is its TP/DP rank 0.
    """
    from megatron.core import parallel_state as ps

    return stage * (dist.get_world_size() // ps.get_pipeline_model_parallel_world_size())


def full_shape(row: tuple, tp: int) -> tuple[int, ...]:
    """The whole tensor's shape from a stage's (name, local shape, dtype, partition dim) row."""
    name, shape, _, pdim = row
    if pdim is None:
        return shape
    full = list(shape)
    full[pdim] *= tp
    return tuple(full)
