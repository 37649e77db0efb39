"""Build a :class:`TransferPlan` from what the trainer ranks hold and what every engine worker keeps,
and refuse one that does not cover every served byte exactly once.

Invariants of a built plan (:func:`check_coverage`, run by :func:`build_plan` and by anyone holding a
plan from elsewhere):

* every box a route sends lies inside what its sender holds: no rank sends bytes it does not have;
* for every engine worker and every tensor it keeps, the boxes routed to it tile that tensor's box:
  nothing missing, nothing written twice, nothing it does not keep.

Choosing senders: under ``broadcast``, workers that keep the same box of a tensor (the same worker
index of every engine, KV heads replicated inside an engine, norms) form one group and are served by
one route per piece, so the collective sends it once; under ``write`` every worker is its own group,
so the writes to different workers spread over different senders. A piece is the group's box cut by the trainer's shards; when several ranks
hold the piece (data-parallel replicas, TP ranks of a norm), the one with the fewest bytes assigned so
far sends it, largest pieces first, so replicas split the sending between them. The choice is made
once per layout; an update replays it.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq

from rlplacement.transfer.plan.boxes import Box, describe, intersect, volume
from rlplacement.transfer.plan.tensors import ModelTensors

Receiver = tuple[int, int]  # (engine index, worker index inside the engine)
BROADCAST, WRITE = "broadcast", "write"


class PlanCoverageError(ValueError):
    """A plan that misses, doubles or invents a byte range; the message names the tensor, the range, the
    engine worker and the ranks."""


@dataclasses.dataclass(frozen=True)
class Route:
    tensor: str
    box: Box
    sender: int
    receivers: tuple[Receiver, ...]
    nbytes: int


def sent_bytes(nbytes: int, num_receivers: int, fanout: str) -> int:
    """What a route of ``nbytes`` costs its sender: once under ``broadcast``, once per receiver under ``write``."""
    return nbytes * (1 if fanout == BROADCAST else num_receivers)


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """Every route of one update. ``fanout``: ``broadcast`` (a route's bytes leave its sender once, the
    collective reaches every receiver) or ``write`` (p2p: once per receiver). ``engine_copies``: the routes
    are engine 0's, and each of that many engines gets the same routes from the same senders
    (:func:`build_write_plan`: writes of boxes with one holder each, where every engine's routes are engine
    0's, so they are built once)."""

    routes: tuple[Route, ...]
    num_senders: int
    receivers: tuple[Receiver, ...]
    fanout: str
    engine_copies: int = 1

    @property
    def num_routes(self) -> int:
        return len(self.routes) * self.engine_copies

    def bytes_per_sender(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.num_senders)}
        for route in self.routes:
            out[route.sender] += sent_bytes(route.nbytes, len(route.receivers), self.fanout) * self.engine_copies
        return out

    def bytes_per_receiver(self) -> dict[Receiver, int]:
        out = {r: 0 for r in self.receivers}
        for route in self.routes:
            for r in route.receivers:
                out[r] += route.nbytes
        if self.engine_copies > 1:
            out = {(e, w): n for e in range(self.engine_copies) for (first, w), n in out.items() if first == 0}
        return out

    def summary(self) -> dict:
        """Bytes per sender and per receiver, as the update report prints them."""
        senders = self.bytes_per_sender()
        receivers = self.bytes_per_receiver()
        sending = [b for b in senders.values() if b]
        return {"fanout": self.fanout, "routes": self.num_routes,
                "bytes_per_sender": senders,
                "bytes_per_receiver": {f"engine {e} worker {w}": b for (e, w), b in receivers.items()},
                "max_sender_bytes": max(senders.values(), default=0),
                "mean_sender_bytes": sum(sending) / len(sending) if sending else 0,
                "max_receiver_bytes": max(receivers.values(), default=0)}


def build_plan(model: ModelTensors, holdings: list[dict[str, Box]], needs: dict[Receiver, dict[str, Box]],
               fanout: str = BROADCAST, local: dict[Receiver, int] | None = None) -> TransferPlan:
    """Routes that bring every receiver its boxes from the ranks that hold them; checked by
    :func:`check_coverage` before it is returned. ``local``: the trainer rank on each receiver's GPU
    (colocated); a piece that rank holds is sent by it, and receivers are not grouped."""
    if fanout not in (BROADCAST, WRITE):
        raise ValueError(f"fanout {fanout!r} is not {BROADCAST!r} or {WRITE!r}")
    groups: dict[tuple, list[Receiver]] = collections.defaultdict(list)
    for receiver in sorted(needs):
        for name, box in needs[receiver].items():
            groups[(name, box) + ((receiver,) if local or fanout == WRITE else ())].append(receiver)
    held: dict[str, dict[Box, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for rank, boxes in enumerate(holdings):
        for name, box in boxes.items():
            held[name][box].append(rank)
    pieces = []
    for (name, box, *_), receivers in groups.items():
        mine = local.get(receivers[0]) if local else None
        for hbox, ranks in held[name].items():
            part = intersect(box, hbox)
            if part is not None:
                pieces.append((name, part, (mine,) if mine in ranks else tuple(ranks), tuple(receivers)))
    load = [0] * len(holdings)
    least_loaded = _least_loaded(load)
    item = model.itemsize
    routes = []
    for name, part, ranks, receivers in sorted(pieces, key=lambda p: (-volume(p[1]) * len(p[3]), p[0], p[1])):
        nbytes = volume(part) * item
        sender = least_loaded(ranks)
        load[sender] += sent_bytes(nbytes, len(receivers), fanout)
        routes.append(Route(name, part, sender, receivers, nbytes))
    plan = TransferPlan(tuple(routes), len(holdings), tuple(sorted(needs)), fanout)
    check_coverage(plan, holdings, needs)
    return plan


def _least_loaded(load: list[int]):
    """``choose(ranks)``: the rank of ``ranks`` with the least ``load`` so far, the lowest on a tie; a heap per
    set of holders (a box's data-parallel replicas: hundreds at 1,024 GPUs), its entries brought up to date
    as they surface (``load`` only grows)."""
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def choose(ranks: tuple[int, ...]) -> int:
        if len(ranks) == 1:
            return ranks[0]
        heap = heaps.get(ranks)
        if heap is None:
            heap = heaps[ranks] = [(load[r], r) for r in ranks]
            heapq.heapify(heap)
        while True:
            held, rank = heap[0]
            if held == load[rank]:
                return rank
            heapq.heapreplace(heap, (load[rank], rank))

    return choose


def build_write_plan(model: ModelTensors, holdings: list[dict[str, Box]], worker_needs: list[dict[str, Box]],
                     engines: int) -> TransferPlan:
    """The ``write`` plan (p2p) of ``engines`` alike engines whose worker ``w`` keeps ``worker_needs[w]``:
    where every box has one holder (FSDP's rows, pieces, rank 0 holding everything) no choice of sender
    depends on the engine, so engine 0's routes are every engine's (``engine_copies``), built and checked
    once: a route per rank's box and worker, not also per engine (a hundred million at 1,024 GPUs).
    Otherwise the plan of every engine, from :func:`build_plan`."""
    needs = {(e, w): need for e in range(engines) for w, need in enumerate(worker_needs)}
    holders: dict[tuple[str, Box], int] = collections.Counter(
        (name, box) for boxes in holdings for name, box in boxes.items())
    if engines == 1 or any(n > 1 for n in holders.values()):
        return build_plan(model, holdings, needs, WRITE)
    plan = build_plan(model, holdings, {(0, w): need for w, need in enumerate(worker_needs)}, WRITE)
    return dataclasses.replace(plan, receivers=tuple(sorted(needs)), engine_copies=engines)


def check_coverage(plan: TransferPlan, holdings: list[dict[str, Box]],
                   needs: dict[Receiver, dict[str, Box]]) -> None:
    """Raise :class:`PlanCoverageError` unless every route sends only what its sender holds and every
    receiver gets each box it keeps exactly once."""
    if plan.engine_copies > 1:  # engine 0's routes are every engine's: its receivers are checked
        needs = {r: boxes for r, boxes in needs.items() if r[0] == 0}
    arriving: dict[Receiver, dict[str, list[Route]]] = {r: collections.defaultdict(list) for r in needs}
    for route in plan.routes:
        hbox = holdings[route.sender].get(route.tensor) if route.sender < len(holdings) else None
        if hbox is None or intersect(route.box, hbox) != route.box:
            raise PlanCoverageError(f"trainer rank {route.sender} is to send {route.tensor}{describe(route.box)}, "
                                    f"which it does not hold ({describe(hbox) if hbox else 'nothing of it'})")
        for r in route.receivers:
            if r not in arriving:
                raise PlanCoverageError(f"{route.tensor}{describe(route.box)} is routed to engine {r[0]} worker "
                                        f"{r[1]}, which is not in the layout")
            arriving[r][route.tensor].append(route)
    checked: set = set()
    for receiver, boxes in needs.items():
        where = f"engine {receiver[0]} worker {receiver[1]}"
        extra = set(arriving[receiver]) - set(boxes)
        if extra:
            name = sorted(extra)[0]
            raise PlanCoverageError(f"{name} is routed to {where}, which keeps none of it")
        for name, box in boxes.items():
            routes = arriving[receiver].get(name, [])
            key = (name, box, tuple(id(r) for r in routes))
            if key in checked:
                continue
            _check_tiling(name, box, routes, where)
            checked.add(key)


def _check_tiling(name: str, box: Box, routes: list[Route], where: str) -> None:
    for route in routes:
        if intersect(route.box, box) != route.box:
            raise PlanCoverageError(f"{name}{describe(route.box)} from rank {route.sender} reaches {where}, which "
                                    f"keeps only {describe(box)} of it")
    ordered = sorted(routes, key=lambda r: r.box[0])
    for i, a in enumerate(ordered):  # a sweep along dim 0: only boxes whose rows overlap can overlap
        for b in ordered[i + 1:]:
            if b.box[0][0] >= a.box[0][1]:
                break
            both = intersect(a.box, b.box)
            if both is not None:
                raise PlanCoverageError(f"{name}{describe(both)} is written twice into {where}: by rank {a.sender} "
                                        f"and by rank {b.sender}")
    got = sum(volume(r.box) for r in routes)
    if got != volume(box):
        raise PlanCoverageError(f"{name}{describe(box)} of {where}: {volume(box) - got} of {volume(box)} elements "
                                f"are sent by no trainer rank")
