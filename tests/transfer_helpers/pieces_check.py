"""What several trainer ranks sent of an update, put back together: each rank's tensors (piece names from
``transfer.pieces``, or HF names of whole tensors) placed into the whole tensors, with how often each element
arrived, so a test asserts every element came exactly once and bit for bit."""

from __future__ import annotations

import torch

from rlplacement.transfer.pieces import parse_piece


def tiled(sent_by_rank: list[dict[str, torch.Tensor]], whole: dict[str, torch.Tensor]):
    """``(rebuilt, covered, boxes)``: every tensor of ``whole`` rebuilt from what the ranks sent (zeros where
    nothing arrived), per element the number of times it arrived, and each rank's set of ``(name, box)``."""
    rebuilt = {n: torch.zeros_like(t) for n, t in whole.items()}
    covered = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in whole.items()}
    boxes = [set() for _ in sent_by_rank]
    for rank, sent in enumerate(sent_by_rank):
        for key, t in sent.items():
            name, box, _ = parse_piece(key) or (key, tuple((0, n) for n in whole[key].shape), None)
            where = tuple(slice(a, b) for a, b in box)
            rebuilt[name][where] = t
            covered[name][where] += 1
            boxes[rank].add((name, box))
    return rebuilt, covered, boxes


def each_element_once(covered: dict[str, torch.Tensor]) -> list[str]:
    """The tensors some element of which did not arrive exactly once."""
    return [n for n, c in covered.items() if not bool((c == 1).all())]
