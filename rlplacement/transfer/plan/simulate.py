"""Predict an update's time from a :class:`~rlplacement.transfer.plan.build.TransferPlan`: the bytes on
every link of every GPU, the busiest link's time, the gather today's rank-0 senders do first, and a
fixed cost.

The link model, per GPU and direction (full duplex, so sending and receiving do not compete):

* ``ipc``: a sender and a receiver on the same GPU (colocated): an in-GPU copy, counted once;
* ``nvlink``: two GPUs of one node;
* ``network``: two nodes, one NIC per GPU (GPUDirect RDMA, as H100/H200 clusters are built);
* ``disk``: disk-delta, written once by each sender and read by each receiver at the disk's rate.

A ``broadcast`` route leaves its sender once per link kind it reaches (NCCL pipelines the ring); a
``write`` route (p2p, colocated IPC reads) once per receiver. Every link runs at once, so the wire
time is the busiest link's bytes over its rate; the gather (a rank collecting from other trainer ranks
what it sends: rank 0 of a rank-0 plan, each rank colocated) runs before it, as today's senders do per
bucket. ``fixed_s`` is the rest of an update
(pause, commit, resume, RPC): :data:`FIXED_S`, measured.
"""

from __future__ import annotations

import collections
import dataclasses

from rlplacement.transfer.plan.build import BROADCAST, TransferPlan

Gpu = tuple[int, int]

FIXED_S = 0.020
"""An update's cost beyond its wire time: 20 ms, the 8B split update on one H200 pair (whole 78.7 ms,
wire 58.3 ms: ``benchmarks/gpu/results/split_h200.json``, broadcast)."""


@dataclasses.dataclass(frozen=True)
class LinkRates:
    """Achieved Gb/s per link kind: the advisor's datasheet rates times the mode's efficiency."""

    ipc_gbps: float
    nvlink_gbps: float
    network_gbps: float
    disk_gbps: float

    @classmethod
    def from_assumptions(cls, assumptions, efficiency: float) -> "LinkRates":
        a = assumptions
        return cls(a.ipc_gbps * efficiency, a.nvlink_gbps * efficiency, a.link_gbps * efficiency, a.disk_gbps)

    def of(self, kind: str) -> float:
        return getattr(self, f"{kind}_gbps")


def link_between(a: Gpu, b: Gpu) -> str:
    return "ipc" if a == b else "nvlink" if a[0] == b[0] else "network"


@dataclasses.dataclass(frozen=True)
class Simulation:
    link_bytes: dict[str, int]
    """``node N gpu G out|in KIND`` -> bytes that link carries in one update."""
    busiest: str
    wire_s: float
    gather_s: float
    fixed_s: float

    @property
    def total_s(self) -> float:
        return self.gather_s + self.wire_s + self.fixed_s

    def to_json(self) -> dict:
        return {"predicted_seconds": self.total_s, "wire_seconds": self.wire_s, "gather_seconds": self.gather_s,
                "fixed_seconds": self.fixed_s, "busiest_link": self.busiest,
                "busiest_link_bytes": self.link_bytes.get(self.busiest, 0)}


def simulate(plan: TransferPlan, trainer_gpus: tuple[Gpu, ...], engines: tuple[tuple[Gpu, ...], ...],
             rates: LinkRates, *, disk: bool = False, gather_bytes: dict[int, int] | None = None,
             fixed_s: float = FIXED_S) -> Simulation:
    """The plan's bytes on every link and the predicted update time. ``disk``: the bytes go through a
    shared disk (disk-delta). ``gather_bytes``: per rank, bytes it collects from other trainer ranks
    before it sends (rank 0 of a rank-0 plan; every rank of a colocated one), over the network when the
    trainer spans nodes, else NVLink."""
    link: dict[str, int] = collections.defaultdict(int)

    def add(gpu: Gpu, direction: str, kind: str, nbytes: int) -> None:
        link[f"node {gpu[0]} gpu {gpu[1]} {direction} {kind}"] += nbytes

    for route in plan.routes:
        src = trainer_gpus[route.sender]
        kinds = set()
        for e, w in route.receivers:
            dst = engines[e][w]
            kind = "disk" if disk else link_between(src, dst)
            add(dst, "in", kind, route.nbytes)
            if kind == "ipc":
                continue
            if plan.fanout == BROADCAST or disk:
                kinds.add(kind)
            else:
                add(src, "out", kind, route.nbytes)
        for kind in kinds:
            add(src, "out", kind, route.nbytes)
    times = {name: b * 8 / (rates.of(name.rsplit(" ", 1)[1]) * 1e9) for name, b in link.items()}
    busiest = max(times, key=times.get) if times else "-"
    gather_s = 0.0
    if gather_bytes:
        nodes = {g[0] for g in trainer_gpus}
        kind = "network" if len(nodes) > 1 else "nvlink"
        for rank, nbytes in gather_bytes.items():
            if nbytes:
                gpu = trainer_gpus[rank]
                link[f"node {gpu[0]} gpu {gpu[1]} in {kind} (gather)"] += nbytes
                gather_s = max(gather_s, nbytes * 8 / (rates.of(kind) * 1e9))
    return Simulation(dict(link), busiest, times.get(busiest, 0.0), gather_s, fixed_s)
