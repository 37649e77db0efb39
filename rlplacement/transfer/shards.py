"""Engine workers that receive only their slice of each tensor: which slice (a worker's *keeps*), how a
bucket is laid out for one (a *region*), and how a slice reaches vLLM's loader, which expects the whole
HF tensor.

* A worker's keeps are the boxes its engine kind's spec gives (``EngineSpec.worker_needs``; vLLM's:
  ``transfer.plan.engine_shards.vllm_worker_needs``): the slice its loader takes for it. A tensor kept whole (norms, KV heads a wider engine replicates, every tensor at
  TP=1) is not in the map; neither is one whose slice is empty (a vocabulary shard of padding only: the
  tensor is sent whole, so the loader's zero fill sees the shape it expects).
* A region is a bucket's manifest for one set of keeps: each tensor's slice in C order, aligned as in a
  bucket, named as the tensor. Sender and receiver derive it from the same bucket manifest and keeps, so
  only the whole bucket's manifest travels. Checksums of slices are keyed ``name[box]``
  (:func:`region_key`); a tensor sent whole keeps its name as key.
* A slice reaches the loader as a tensor of the whole shape that holds only the slice's bytes
  (``transfer.slice_tensor.as_whole``): every copy the loader makes out of it must be exactly the box,
  else the load fails by name.

Who uses it: ``p2p`` writes each worker its region of every bucket; ``broadcast`` and ``broadcast_packed``
broadcast each region in a group of its own (the sender and the workers keeping it: one worker position of
every engine, :func:`position_key`); ``disk-delta``'s workers decode, check and hold only their slices
(``delta_codec.decode_slice``). The same on every device: nothing outside a worker's slices is allocated.

Receivers publish their keeps in their group's store at join (:func:`keeps_key`); the sender reads them
once per group (:func:`slice_positions`), so the cut of every bucket is known before any bytes move.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import TYPE_CHECKING

from rlplacement.transfer.base import BucketManifest, TensorMeta
from rlplacement.transfer.bucket import aligned, pack_into
from rlplacement.transfer.plan.boxes import Box, describe, volume, whole

if TYPE_CHECKING:
    import torch

    from rlplacement.transfer.plan.tensors import ModelTensors

Keeps = dict[str, Box]
"""HF name -> the box of it a worker keeps (tensors kept whole are absent)."""


def keeps_for_worker(hf_config: dict, rank: int, tp: int) -> Keeps:
    """What worker ``rank`` of a ``tp``-wide engine keeps of each tensor of the model of ``hf_config``
    (its ``config.json`` as a dict); raises ``ValueError`` for a model the plan does not know."""
    from rlplacement.transfer.plan.tensors import ModelTensors

    return keeps_of(ModelTensors.from_hf_config(hf_config, dtype="float32"), rank, tp)  # boxes count elements


def keeps_of(model: "ModelTensors", rank: int, tp: int, engine_kind: str = "vllm") -> Keeps:
    """:func:`keeps_for_worker` of a model already read (``transfer.plan.tensors.ModelTensors``), for a worker
    of an ``engine_kind`` engine (its spec's ``EngineSpec.worker_needs``)."""
    from rlplacement.specs.engine import engine_spec

    needs = engine_spec(engine_kind).call("worker_needs", model, tp)[rank]
    shapes = {t.name: t.shape for t in model.tensors}
    return {name: box for name, box in needs.items() if box != whole(shapes[name]) and volume(box)}


def busiest_share(tensor_bytes: dict[str, int], keeps_by_worker: list[Keeps], itemsize: int) -> dict[str, int]:
    """HF name -> bytes the busiest worker receives of each tensor of ``tensor_bytes`` (whole sizes), the workers
    keeping ``keeps_by_worker``: a kept box's bytes, else the whole tensor (kept whole, or sent whole)."""
    def share(keeps: Keeps) -> dict[str, int]:
        return {n: volume(keeps[n]) * itemsize if n in keeps else b for n, b in tensor_bytes.items()}

    return max((share(keeps) for keeps in keeps_by_worker), key=lambda s: sum(s.values()), default=dict(tensor_bytes))


def keeps_to_json(keeps: Keeps | None) -> str:
    return json.dumps(None if keeps is None else {n: [list(r) for r in box] for n, box in sorted(keeps.items())})


def keeps_from_json(text: str) -> Keeps | None:
    obj = json.loads(text)
    return None if obj is None else {n: tuple((int(a), int(b)) for a, b in box) for n, box in obj.items()}


def keeps_key(group_name: str, rank: int) -> str:
    """Where receiver ``rank`` of a transfer group publishes the slices it keeps (:func:`keeps_to_json`) for its
    sender."""
    return f"rlplacement/{group_name}/keeps/{rank}"


def position_key(group_name: str) -> str:
    """Where a broadcast mode's sender publishes the group ranks of every position (a JSON list of lists, in
    :func:`slice_positions` order): the members of each position's group."""
    return f"rlplacement/{group_name}/positions"


def region_key(name: str, box: Box | None) -> str:
    """The checksum key of ``name``'s slice ``box`` (None: the whole tensor, keyed by its name)."""
    return name if box is None else f"{name}{describe(box)}"


def parse_region_key(key: str) -> tuple[str, Box | None]:
    """``(name, box)`` of a :func:`region_key` (box None: the whole tensor); ``name`` may be a piece name
    (``transfer.pieces``), and ``box`` then a part of the piece."""
    from rlplacement.transfer.pieces import split_piece_key

    piece, rest = split_piece_key(key)
    if piece is not None:
        return piece, parse_region_key(rest)[1] if rest else None
    if not key.endswith("]") or "[" not in key:
        return key, None
    name, _, ranges = key[:-1].rpartition("[")
    return name, tuple(tuple(int(x) for x in r.split(":")) for r in ranges.split(", "))


def kept_box(keeps: Keeps | None, name: str) -> Box | None:
    """The box of tensor ``name`` a worker with ``keeps`` receives (None: all of it). For a piece
    (``transfer.pieces``) of a tensor kept sliced: the piece's part of the slice, in the piece's coordinates,
    possibly of no elements."""
    if not keeps:
        return None
    from rlplacement.transfer.pieces import is_piece, kept_part, parse_piece

    if is_piece(name):
        base, box, _ = parse_piece(name)
        return kept_part(box, keeps[base]) if base in keeps else None
    return keeps.get(name)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def region_manifest(manifest: BucketManifest, keeps: Keeps | None,
                    checksums: dict[str, str] | None = None) -> tuple[BucketManifest, tuple[Box | None, ...]]:
    """The bucket of ``manifest`` as a worker with ``keeps`` receives it, and each tensor's box (None:
    whole). ``checksums``: by :func:`region_key`, replacing the manifest's (None: ``manifest`` itself where
    nothing is sliced, else unchecked)."""
    from rlplacement.transfer.bucket import dtype_from_name

    if not keeps and checksums is None:
        return manifest, (None,) * len(manifest.tensors)
    metas, boxes, end = [], [], 0
    for t in manifest.tensors:
        box = kept_box(keeps, t.name)
        if box is not None and len(box) != len(t.shape):
            raise ValueError(f"tensor {t.name!r} of shape {t.shape} arrived where a slice {describe(box)} is kept")
        shape = box_shape(box) if box is not None else t.shape
        n = math.prod(shape) * dtype_from_name(t.dtype).itemsize
        offset = aligned(end)
        key = region_key(t.name, box)
        metas.append(TensorMeta(t.name, t.dtype, shape, offset, n, checksums.get(key) if checksums else None))
        boxes.append(box)
        end = offset + n
    return BucketManifest(manifest.index, end, tuple(metas)), tuple(boxes)


def cut(tensor: "torch.Tensor", box: Box | None) -> "torch.Tensor":
    """The view of ``tensor`` a box selects (the tensor itself for None)."""
    if box is None:
        return tensor
    for d, (a, b) in enumerate(box):
        if (a, b) != (0, tensor.shape[d]):
            tensor = tensor.narrow(d, a, b - a)
    return tensor


def slice_positions(keeps_by_worker: list[Keeps | None]) -> list[tuple[Keeps | None, list[int]]]:
    """Workers (group ranks from 1, in ``keeps_by_worker`` order) grouped by what they keep: each distinct
    keeps once, with the ranks keeping it (the same worker index of every engine of one width)."""
    positions: dict[str, tuple[Keeps | None, list[int]]] = {}
    for rank, keeps in enumerate(keeps_by_worker, start=1):
        positions.setdefault(keeps_to_json(keeps), (keeps, []))[1].append(rank)
    return list(positions.values())


@dataclasses.dataclass(frozen=True)
class Region:
    """One position's part of a bucket: its :func:`region_manifest`, each tensor's slice (a view of the bucket's
    tensor, in manifest order) and the group ranks that receive it."""

    manifest: BucketManifest
    pieces: list
    ranks: list[int]


def regions(bucket: list, manifest: BucketManifest, positions: list[tuple[Keeps | None, list[int]]],
            check_equal: bool) -> tuple[list[Region], dict[str, str] | None]:
    """``bucket`` (``(name, tensor)`` in ``manifest`` order) cut for every position, and with ``check_equal``
    each slice's checksum by :func:`region_key` (what receivers check instead of the manifest's)."""
    from rlplacement.transfer.base import tensor_checksum

    out, sums = [], {} if check_equal else None
    for keeps, ranks in positions:
        region, boxes = region_manifest(manifest, keeps)
        pieces = [(name, cut(t, box)) for (name, t), box in zip(bucket, boxes)]
        out.append(Region(region, pieces, ranks))
        if sums is not None:
            for (name, piece), box in zip(pieces, boxes):
                key = region_key(name, box)
                if key not in sums:
                    sums[key] = tensor_checksum(piece)
    return out, sums


def pack_regions(get_buffer, cut_regions: list[Region]) -> tuple["torch.Tensor", list[tuple[int, int]]]:
    """Every region packed one after another (each at an aligned offset) into ``get_buffer(total bytes)``: the
    packed bytes and each region's ``(offset, bytes)`` in them."""
    spans, total = [], 0
    for region in cut_regions:
        spans.append((total, region.manifest.nbytes))
        total = aligned(total + region.manifest.nbytes)
    flat = get_buffer(total)
    for region, (base, n) in zip(cut_regions, spans):
        pack_into(flat[base:base + n], region.pieces, region.manifest)
    return flat[:total], spans


