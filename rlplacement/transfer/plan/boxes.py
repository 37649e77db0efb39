"""Rectangular slices of a tensor: a :data:`Box` is ``[start, stop)`` per dimension.

Every range the plan moves is a box of one HF-named tensor: trainer shards (Megatron's TP and PP,
FSDP's dim-0 chunks) and the slices vLLM's loaders take are all boxes, and so is the intersection of
two boxes, which is what makes coverage checkable by volume and pairwise overlap.
"""

from __future__ import annotations

Box = tuple[tuple[int, int], ...]


def whole(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def along(shape: tuple[int, ...], dim: int, start: int, stop: int) -> Box:
    """Indices ``[start, stop)`` of dimension ``dim`` (clipped to the shape), every index of the others."""
    return tuple((max(0, min(start, n)), max(0, min(stop, n))) if d == dim else (0, n)
                 for d, n in enumerate(shape))


def volume(box: Box) -> int:
    v = 1
    for start, stop in box:
        v *= max(0, stop - start)
    return v


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of one tensor; None when they share no element."""
    out = tuple((max(s1, s2), min(e1, e2)) for (s1, e1), (s2, e2) in zip(a, b))
    return out if volume(out) else None


def describe(box: Box) -> str:
    """``[0:128, 0:64]``: the box as a Python slice, for messages."""
    return "[" + ", ".join(f"{s}:{e}" for s, e in box) + "]"
