"""How one rank's share of a train call becomes optimizer steps and micro-batches (pure functions).

A share of ``N`` samples makes ``N / per_step`` optimizer steps of consecutive samples (``per_step`` is a
rank's part of ``--global-batch-size``); each step's samples are cut into micro-batches, either
``--micro-batch-size`` samples each or, with ``--use-dynamic-batch-size``, packed by token count under
``--max-tokens-per-gpu``. A micro-batch is trimmed to its longest sample, so its cost is
``samples x that length``: packing sorts by length so long samples share micro-batches. Every
data-parallel rank must run the same number of micro-batches (the collectives of a forward/backward pair
up across ranks, and megatron's schedules need one count): the caller agrees on the count across ranks
and :func:`pack_by_tokens` splits further until it reaches it.
"""

from __future__ import annotations

from typing import Sequence

from rlplacement.errors import ConfigError


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
