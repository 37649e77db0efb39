"""Which trainer rank sends which whole tensor when every rank sends a share of whole tensors (``broadcast``,
``broadcast_packed`` and ``p2p`` from a Megatron or torchtitan trainer of several ranks; an FSDP rank sends its
own rows instead, ``transfer.pieces``): the assignment the senders run.

A route here is (tensor, sender), the sender one of the ranks that hold the tensor whole after the backend's
own gather (the TP rank a megatron stage gathers a parameter to; every torchtitan rank after
``full_tensor()``); workers keeping slices are sent theirs of it (``transfer.shards``). The balance rule is
the sharded plan's (:mod:`~rlplacement.transfer.plan.build`): largest first, each to the least-loaded
sender, ties to the lower rank.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from rlplacement.balance import largest_first


def spread_owners(sizes: Sequence[int], num_senders: int) -> list[int]:
    """The sender (0 .. ``num_senders`` - 1) of each item of ``sizes`` bytes
    (:func:`rlplacement.balance.largest_first`): every rank computes the same answer from the same sizes
    without talking to the others."""
    if num_senders < 1:
        raise ValueError(f"num_senders {num_senders}: need at least one sender")
    return largest_first(sizes, num_senders)


def spread_owners_by_group(items: Sequence[tuple[str, int]], num_senders: int,
                           group_of=lambda name: name) -> dict[str, int]:
    """Name -> sender for ``(name, bytes)`` items, the items of one group (``group_of(name)``: a fused
    parameter's pieces, q/k/v or gate/up) kept on one sender so a receiver gets them in one bucket."""
    groups: dict[Hashable, list[str]] = {}
    sizes: dict[Hashable, int] = {}
    for name, nbytes in items:
        key = group_of(name)
        groups.setdefault(key, []).append(name)
        sizes[key] = sizes.get(key, 0) + nbytes
    keys = list(groups)
    owners = spread_owners([sizes[k] for k in keys], num_senders)
    return {name: owner for key, owner in zip(keys, owners) for name in groups[key]}
