"""How one rank's share of a train call becomes optimizer steps and micro-batches.

A share of ``N`` samples makes ``N / per_step`` optimizer steps of consecutive samples (``per_step`` is a
rank's part of ``--global-batch-size``); each step's samples are cut into micro-batches, either
``--micro-batch-size`` samples each or, with ``--use-dynamic-batch-size``, packed by token count under
``--max-tokens-per-gpu``. A micro-batch is trimmed to its longest sample, so its cost is
``samples x that length``: packing sorts by length so long samples share micro-batches. Every
data-parallel rank must run the same number of micro-batches (the collectives of a forward/backward pair
up across ranks, and megatron's schedules need one count): the caller agrees on the count across ranks
and :func:`pack_by_tokens` splits further until it reaches it. Where ranks' micro-batches must also hold
the same number of tokens (megatron's all-gather token dispatcher under expert parallelism), each is
padded to the shape the group agreed on (:func:`lined_up`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlplacement.errors import ConfigError
from rlplacement.train_io import Batch


def pack_by_tokens(lengths: Sequence[int], max_tokens: int, min_count: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` in micro-batches whose ``len x max length`` is at most ``max_tokens``, at least
    ``min_count`` of them (never more micro-batches than samples), longest samples first.

    Greedy over samples sorted by length: a micro-batch takes the next sample while the padded cost fits.
    Then, while fewer than ``min_count``, the micro-batch of most samples is split in two (splitting never
    raises a cost)."""
    if any(n > max_tokens for n in lengths):
        longest = max(lengths)
        raise ConfigError(f"--max-tokens-per-gpu {max_tokens} is below one sample's length ({longest} tokens): "
                          f"raise --max-tokens-per-gpu to {longest} or more.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= max_tokens:
            bins[-1].append(i)
        else:
            bins.append([i])
    if min_count > len(lengths):
        raise ValueError(f"{min_count} micro-batches from {len(lengths)} samples")
    while len(bins) < min_count:
        widest = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        half = len(bins[widest]) // 2
        bins[widest:widest + 1] = [bins[widest][:half], bins[widest][half:]]
    return bins


def fixed_micro_batches(count: int, micro_batch_size: int | None) -> list[list[int]]:
    """Indices ``0..count-1`` in consecutive micro-batches of ``micro_batch_size`` (None: one of all)."""
    size = micro_batch_size or count
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def split_steps(count: int, per_step: int | None) -> list[range]:
    """Consecutive sample ranges of each optimizer step in a share of ``count`` samples."""
    per_step = per_step or count
    if count % per_step:
        raise ConfigError(f"a rank's share of {count} samples is not a whole number of optimizer steps of "
                          f"{per_step} samples per rank (--global-batch-size over the data-parallel ranks): send "
                          f"a multiple of --global-batch-size samples per train call.")
    return [range(start, start + per_step) for start in range(0, count, per_step)]


@dataclasses.dataclass
class LinedUpBatch(Batch):
    """A micro-batch widened to the shape other ranks' micro-batches of the same index have (megatron's
    all-gather token dispatcher gathers every rank's tokens as equal blocks), or a stand-in for one this rank
    lacks (every rank of an expert-parallel group runs the same number: each forward is a collective).
    The added rows and columns are padding: token 0, outside the loss mask, advantage 0, routed to experts
    ``0..K-1`` where routes are replayed."""

    padding: torch.Tensor | None = None
    """``[B, T]`` bool, True on the tokens added to line the ranks up (megatron's ``padding_mask``: its routers
    leave them out of the load-balancing loss); None: nothing added. The padding past a sample's length inside
    the micro-batch's own width is not marked: it stays what it is without lining up."""
    own_rows: int = 0
    """Samples of the micro-batch before lining up (0: a stand-in, every token added)."""
    own_width: int = 0
    """Its width before lining up."""


def lined_up(batch: Batch, rows: int, width: int) -> LinedUpBatch:
    """``batch`` (``rows`` or fewer samples, ``width`` or fewer columns) padded to ``rows x width``; with 0 rows
    (``batch.rows([])``), a stand-in micro-batch with the fields ``batch`` has."""
    have_rows, have_width = batch.input_ids.shape
    have_width *= have_rows > 0  # a stand-in keeps no column of its template
    if have_rows > rows or have_width > width:
        raise ValueError(f"a micro-batch of {have_rows} x {have_width} cannot line up to {rows} x {width}")

    def pad(t: torch.Tensor | None, value: float = 0) -> torch.Tensor | None:
        if t is None:
            return None
        if t.dim() == 1:
            return torch.nn.functional.pad(t, (0, rows - have_rows), value=value)
        return torch.nn.functional.pad(t[:, :have_width], (0, width - have_width, 0, rows - have_rows), value=value)

    routes = batch.routed_experts
    if routes is not None:
        k = routes.shape[-1]
        filler = torch.arange(k, dtype=routes.dtype, device=routes.device).expand(rows, width, routes.shape[2], k)
        routes = filler.clone()
        routes[:have_rows, :have_width] = batch.routed_experts[:, :have_width]
    padding = torch.ones(rows, width, dtype=torch.bool, device=batch.input_ids.device)
    padding[:have_rows, :have_width] = False
    lengths = None if batch.lengths is None else pad(batch.lengths, value=1)
    return LinedUpBatch(pad(batch.input_ids), pad(batch.loss_mask), pad(batch.advantages), pad(batch.old_logprobs),
                        lengths, routes, pad(batch.rollout_logprobs), padding=padding if padding.any() else None,
                        own_rows=have_rows, own_width=have_width)
