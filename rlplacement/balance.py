"""Dealing weighted items out to bins: largest first, each onto the bin with the least weight so far.

One rule serves every place that balances work this way (rollout groups over engines, a weight update's
tensors over the trainer ranks that send them). Pure and deterministic: ties go to the lower item index,
then the lower bin, so every process computes the same answer from the same weights without talking to
the others. The heaviest bin ends at most one item above the mean (greedy LPT).
"""

from __future__ import annotations

from typing import Sequence


def largest_first(weights: Sequence[int], num_bins: int) -> list[int]:
    """The bin (0 .. ``num_bins`` - 1) of each item of ``weights``."""
    loads = [0] * num_bins
    bins = [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[i] = b
        loads[b] += weights[i]
    return bins
