"""A Megatron model read back as full tensors for a weight update or an export, by who sends: everything on
global rank 0 (:func:`iter_full_megatron`), each rank its own stage's share (:func:`iter_own_stage_megatron`)
or the parts of the HF tensors its own shards are (:func:`iter_own_pieces_megatron`, no collective), or
everything on every rank (:func:`iter_everywhere_megatron`, colocated engines); :func:`iter_hf_tensors`
turns megatron names into HF ones.

Invariants: every function that talks to other ranks is collective: all ranks of the model-parallel world
call it in the same order and consume it to the end; the tensors are bit-equal to what the ranks hold
(gathers and sends move bytes, never values through arithmetic); at most two buckets' full tensors are held
at once by a gathering rank (:mod:`.bucket_gather`).
"""

from __future__ import annotations

import itertools
from typing import Iterator

import torch
import torch.distributed as dist

from rlplacement.backends.megatron.bucket_gather import (CollectiveCount, ExpertRanks, byte_size, cut_into_buckets,
                                                         flat_bytes, full_shape, gathered_in_turn, is_expert,
                                                         split_bytes, stage_source_rank)
from rlplacement.backends.megatron.model_build import global_named_parameters
from rlplacement.families import DenseFamily
from rlplacement.families import megatron_mapping as mapping
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

GATHER_BUCKET_BYTES = 256 << 20
"""Bytes of one rank's shards gathered over TP in one collective (TP rank 0 holds TP x this at once)."""


def iter_full_megatron(model, bucket_bytes: int | None = None,
                       counter: CollectiveCount | None = None,
                       skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: yields ``(global megatron name, full tensor)`` on global rank 0, bucket by bucket.

    Per pipeline stage in order (under expert parallelism each expert-parallel rank's experts after the
    stage's other parameters, from that rank's first expert-data-parallel replica: :class:`ExpertRanks`):
    the stage's parameters are cut into buckets of ``bucket_bytes`` local
    bytes (default :data:`GATHER_BUCKET_BYTES`); the stage's TP ranks gather each bucket to their TP rank 0 in one collective, the next
    bucket's gather started before the current one is handed on; a stage whose first rank is not
    global rank 0 sends each whole bucket there in one message, received on rank 0's own device (a
    CPU buffer would fail under NCCL). ``counter`` counts this rank's collectives: on global rank 0,
    one per bucket and one per stage beyond the first (its table of names). Memory on global rank 0:
    two buckets' full tensors. ``skip``: megatron names left out (a tied output layer: nothing to send).
    """
    from megatron.core import parallel_state as ps

    counter = counter if counter is not None else CollectiveCount()
    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    stage_params = [(n, p) for n, p in global_named_parameters(model) if n not in skip]
    params = dict(stage_params)
    device = next(model.parameters()).device
    experts = ExpertRanks.of(model, counter)
    for stage in range(pp):
        src = stage_source_rank(stage)
        meta = [[(n, tuple(p.shape), p.dtype, mapping.tp_partition_dim(n)) for n, p in stage_params]] \
            if stage == my_stage else [None]
        if pp > 1:
            dist.broadcast_object_list(meta, src=src, device=device if device.type == "cuda" else None)
            counter.add()
        rows = meta[0] if experts is None else [row for row in meta[0] if not is_expert(row[0])]
        yield from _to_rank0(src, rows, stage == my_stage and dp_rank == 0, params, device, counter, bucket_bytes)
        if experts is not None:  # each expert-parallel rank's experts of the stage, from that rank
            expert_rows = [row for row in meta[0] if is_expert(row[0])]
            for q in range(experts.size):
                yield from _to_rank0(experts.source(stage, q), experts.rows_of(q, expert_rows),
                                     stage == my_stage and experts.sends(q), params, device, counter, bucket_bytes)


def _to_rank0(src: int, rows: list[tuple], gathering: bool, params: dict[str, torch.Tensor], device,
              counter: CollectiveCount, bucket_bytes: int | None) -> Iterator[tuple[str, torch.Tensor]]:
    """``rows`` (name, local shape, dtype, TP dim) in buckets to global rank 0: the TP ranks that hold them
    (``gathering``) gather each bucket to their TP rank 0, ``src``, which yields it if it is rank 0 or else
    sends it there in one message, received on rank 0's own device (a CPU buffer would fail under NCCL)."""
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    buckets = cut_into_buckets(rows, bucket_bytes or GATHER_BUCKET_BYTES)
    fulls = gathered_in_turn([(b, 0) for b in buckets], params, counter) if gathering else itertools.repeat(None)
    for bucket, full in zip(buckets, fulls):
        if src == 0:
            if rank == 0:
                yield from full
            continue
        if rank == src:
            dist.send(flat_bytes([t for _, t in full]), dst=0)
            counter.add()
        elif rank == 0:
            specs = [(full_shape(row, ps.get_tensor_model_parallel_world_size()), row[2]) for row in bucket]
            flat = torch.empty(sum(byte_size(*spec) for spec in specs), dtype=torch.uint8, device=device)
            dist.recv(flat, src=src)
            counter.add()
            yield from zip([row[0] for row in bucket], split_bytes(flat, specs))


def iter_own_stage_megatron(model, bucket_bytes: int | None = None,
                            counter: CollectiveCount | None = None,
                            skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective within each stage: every rank yields ``(global megatron name, full tensor)`` for the
    parameters of its own stage that it sends; nothing crosses a pipeline stage.

    Under expert parallelism each expert goes from a rank that holds it: the experts are shared out over
    their expert-data-parallel replicas' ``TP`` ranks, the other parameters as below.
    The stage's parameters are shared out over its ``DP x TP`` ranks whole, by full bytes
    (:func:`~rlplacement.transfer.plan.senders.spread_owners`: every rank computes the same answer from the
    same shapes). A DP replica's TP ranks then gather each of their replica's parameters to the TP rank
    that sends it, in buckets of at most ``bucket_bytes`` local bytes per owner, the next bucket's gather
    started before the current one is handed on. Replicas work on disjoint parameters at once, and so do
    stages. Memory on a sending rank: two buckets' full tensors, as on rank 0 in :func:`iter_full_megatron`.
    ``skip`` as there.
    """
    from megatron.core import parallel_state as ps

    from rlplacement.transfer.plan.senders import spread_owners

    counter = counter if counter is not None else CollectiveCount()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    stage_params = [(n, p) for n, p in global_named_parameters(model) if n not in skip]
    params = dict(stage_params)
    rows = [(n, tuple(p.shape), p.dtype, mapping.tp_partition_dim(n)) for n, p in stage_params]
    experts = ExpertRanks.of(model, counter)
    # (rows, the slots they are shared over, this replica's slot offset): experts under expert parallelism
    # go from the ranks that hold them, shared over their expert-data-parallel replicas
    groups = [(rows, dp * tp, dp_rank * tp)]
    if experts is not None:
        groups = [([r for r in rows if not is_expert(r[0])], dp * tp, dp_rank * tp),
                  ([r for r in rows if is_expert(r[0])], experts.data_size * tp, experts.data_rank * tp)]
    work = []  # (bucket, TP rank it is gathered to) of this replica, in order
    for group_rows, slots, first in groups:
        owners = spread_owners([byte_size(full_shape(row, tp), row[2]) for row in group_rows], slots)
        for dst in range(tp):
            mine = [row for row, owner in zip(group_rows, owners) if owner == first + dst]
            work.extend((bucket, dst) for bucket in cut_into_buckets(mine, bucket_bytes or GATHER_BUCKET_BYTES))
    for full in gathered_in_turn(work, params, counter):
        if full is not None:
            yield from full


def iter_own_pieces_megatron(model, shape: mapping.ModelShape, family: DenseFamily,
                             skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Every rank yields the parts of the HF tensors its own shards are (``mapping.hf_pieces``) that it sends,
    each under its piece name (``transfer.pieces``; a whole tensor under its HF name): no collective at all,
    nothing gathered, nothing crossing a stage. A TP-split piece is held alike by every data-parallel
    replica of its TP rank and goes from one of them; a replicated tensor (norms) is held by every rank of
    the stage and goes from all of its ``DP x TP`` ranks. The holders of a piece split it by rows
    (``transfer.pieces.row_part``: ``torch.chunk``'s split, as FSDP2 shards), so every rank sends its share of
    every tensor it holds and a tensor's writes spread over all its holders, as the sharded plan's do. An
    expert's weights (under expert parallelism the rank's own experts, by their global index) are held alike
    by the expert-data-parallel replicas of its TP rank and split among them the same way.
    ``trainer_shards.megatron_piece_holdings`` is this rule for the simulator. ``skip`` as in
    :func:`iter_full_megatron`."""
    from megatron.core import parallel_state as ps

    from rlplacement.transfer.pieces import piece_name, row_part

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if getattr(model.config, "num_moe_experts", None):
        edp, edp_rank = ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_rank()
    for mname, param in global_named_parameters(model):
        if mname in skip:
            continue
        if is_expert(mname):
            parts, mine = edp, edp_rank
        elif mapping.tp_partition_dim(mname) is None:
            parts, mine = dp * tp, dp_rank * tp + tp_rank
        else:
            parts, mine = dp, dp_rank
        for name, t, box, whole in mapping.hf_pieces(mname, param.detach(), shape, family, tp, tp_rank):
            rows = row_part(box, parts, mine)
            if rows is None:
                continue
            sub = ((box[0][0] + rows[0], box[0][0] + rows[1]),) + box[1:]
            part = t[rows[0]:rows[1]]
            yield (name if sub == tuple((0, n) for n in whole) else piece_name(name, sub, whole)), part


def iter_everywhere_megatron(model, bucket_bytes: int | None = None,
                             counter: CollectiveCount | None = None,
                             skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every rank yields every ``(global megatron name, full tensor)``, bucket by bucket: what a
    colocated engine worker reads from the trainer rank on its own GPU.

    Per pipeline stage in order, in buckets of ``bucket_bytes`` local bytes (default
    :data:`GATHER_BUCKET_BYTES`): the stage's TP ranks all-gather each bucket, every DP replica at once, the
    next bucket's gather started before the current one is handed on; with PP > 1 each of the stage's ranks
    then broadcasts the bucket's bytes in one message through its pipeline group, to the ranks of the same
    DP and TP position in the other stages. Under expert parallelism a stage's experts follow its other
    parameters: each bucket of a rank's own experts, gathered over TP, is all-gathered over the
    expert-parallel group (every rank then holds every expert of the bucket, named by its global index:
    :class:`ExpertRanks`), and with PP > 1 broadcast as above. ``counter`` counts this rank's collectives.
    Memory on every rank: two buckets' full tensors (an expert bucket ``EP`` times over), plus one received
    bucket with PP > 1. ``skip`` as in :func:`iter_full_megatron`.
    """
    from megatron.core import parallel_state as ps

    counter = counter if counter is not None else CollectiveCount()
    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    stage_params = [(n, p) for n, p in global_named_parameters(model) if n not in skip]
    params = dict(stage_params)
    device = next(model.parameters()).device
    experts = ExpertRanks.of(model, counter)
    own = [(n, tuple(p.shape), p.dtype, mapping.tp_partition_dim(n)) for n, p in stage_params]
    for stage in range(pp):
        meta = [own if stage == my_stage else None]
        if pp > 1:
            dist.broadcast_object_list(meta, src=stage_source_rank(stage),
                                       device=device if device.type == "cuda" else None)
            counter.add()
        # this stage's rows: its own (the source's name another expert-parallel rank's experts), else received
        rows = own if stage == my_stage else meta[0]
        yield from _everywhere(stage, rows if experts is None else [r for r in rows if not is_expert(r[0])], params,
                               device, counter, bucket_bytes)
        if experts is not None:
            yield from _everywhere(stage, [r for r in rows if is_expert(r[0])], params, device, counter,
                                   bucket_bytes, experts)


def _everywhere(stage: int, rows: list[tuple], params: dict[str, torch.Tensor], device, counter: CollectiveCount,
                bucket_bytes: int | None, experts: "ExpertRanks | None" = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Stage ``stage``'s ``rows`` (name, local shape, dtype, TP dim) on every rank, bucket by bucket (see
    :func:`iter_everywhere_megatron`); ``experts``: the rows are this rank's own experts, all-gathered over the
    expert-parallel group into every expert-parallel rank's."""
    from megatron.core import parallel_state as ps

    pp, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    pp_group = ps.get_pipeline_model_parallel_group() if pp > 1 else None
    copies = 1 if experts is None else experts.size
    buckets = cut_into_buckets(rows, bucket_bytes or GATHER_BUCKET_BYTES)
    fulls = gathered_in_turn([(b, None) for b in buckets], params, counter) if stage == my_stage else itertools.repeat(None)
    for bucket, full in zip(buckets, fulls):
        specs = [(full_shape(row, tp), row[2]) for row in bucket]
        if experts is None and pp == 1:
            yield from full
            continue
        size = sum(byte_size(*spec) for spec in specs)
        own = flat_bytes([t for _, t in full]) if stage == my_stage else None
        flat = own if experts is None and own is not None else torch.empty(copies * size, dtype=torch.uint8,
                                                                            device=device)
        if own is not None and experts is not None:
            dist.all_gather(list(flat.chunk(copies)), own, group=ps.get_expert_model_parallel_group())
            counter.add()
        if pp > 1:
            dist.broadcast(flat, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            counter.add()
        for q in range(copies):
            names = [row[0] for row in (bucket if experts is None else experts.rows_of(q, bucket))]
            yield from zip(names, split_bytes(flat[q * size:(q + 1) * size], specs))


def iter_hf_tensors(model, shape: mapping.ModelShape, family: DenseFamily,
                    counter: CollectiveCount | None = None, *, share: str = RANK0) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: HF-named full tensors by ``share`` (who sends): on global rank 0 alone (nothing elsewhere,
    :func:`iter_full_megatron`), each on the rank of its stage that sends it (:data:`SHARES`,
    :func:`iter_own_stage_megatron`) or all on every rank (:data:`OWN_GPU`, :func:`iter_everywhere_megatron`);
    bucket by bucket. ``counter`` counts this rank's collectives. A tied output layer (the last stage's copy
    of the embedding at PP > 1) is neither gathered nor counted: it streams to no HF tensor."""
    streams = {RANK0: iter_full_megatron, SHARES: iter_own_stage_megatron, OWN_GPU: iter_everywhere_megatron}
    skip = frozenset({"output_layer.weight"}) if shape.tied else frozenset()
    for mname, full in streams[share](model, counter=counter, skip=skip):
        yield from mapping.megatron_to_hf(mname, full, shape, family)
