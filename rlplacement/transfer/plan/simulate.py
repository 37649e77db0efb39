"""Predict an update's time from a :class:`~rlplacement.transfer.plan.build.TransferPlan`: the bytes on
every link of every GPU, the busiest link's time, the gather today's rank-0 senders do first, the
commit and the calls.

The link model, per GPU and direction (full duplex, so sending and receiving do not compete):

* ``ipc``: a sender and a receiver on the same GPU (colocated): an in-GPU copy, counted once;
* ``nvlink``: two GPUs of one node;
* ``network``: two nodes, one NIC per GPU (GPUDirect RDMA, as GPU clusters are built);
* ``disk``: disk-delta, written once by each sender and read by each receiver at the disk's rate.

A ``broadcast`` route leaves its sender once per link kind it reaches (NCCL pipelines the ring); a
``write`` route (p2p, colocated IPC reads) once per receiver. Every link runs at once, so the wire
time is the busiest link's bytes over its rate; the gather (a rank collecting from other trainer ranks
what it sends: rank 0 of a rank-0 plan, each rank colocated) runs before it, as today's senders do per
bucket. After the wire comes the commit (each worker copying what it received into its parameters, the busiest worker's bytes at
:data:`COMMIT_GBPS`) and :data:`RPC_S` for the rest (pause, resume, calls), both measured (sources below).
"""

from __future__ import annotations

import collections
import dataclasses

from rlplacement.transfer.plan.build import BROADCAST, TransferPlan

Gpu = tuple[int, int]

RPC_S = 0.006
"""A split update's cost beyond moving and committing bytes (pause, resume, the calls). Source:
benchmarks/README.md, figures moved from the code (8B broadcast: whole - wire - commit seconds)."""

RPC_S_COLOCATED = 0.001
"""The same for a colocated update, whose handles are exchanged inside one job. Source:
benchmarks/README.md, figures moved from the code (8B colocated: whole - wire seconds)."""

COMMIT_GBPS = 9160.0
"""The engine copying received bytes into its parameters (the recorded copy plan replayed on the GPU). Source:
benchmarks/README.md, figures moved from the code (8B split: bytes over commit seconds). A colocated
worker's IPC read is its commit, so it has none."""


@dataclasses.dataclass(frozen=True)
class LinkRates:
    """Achieved Gb/s per link kind: the advisor's datasheet rates times the mode's efficiency."""

    ipc_gbps: float
    nvlink_gbps: float
    network_gbps: float
    disk_gbps: float

    @classmethod
    def for_mode(cls, assumptions, spec) -> "LinkRates":
        """``assumptions``' datasheet rates (the advisor's ``ModelAssumptions``) times ``spec``'s measured
        share of each link kind where a GPU run measured it, else its ``advisor_efficiency``."""
        a, measured = assumptions, dict(spec.measured_efficiency)

        def share(kind: str) -> float:
            return measured.get(kind, spec.advisor_efficiency)

        return cls(a.ipc_gbps * share("ipc"), a.nvlink_gbps * share("nvlink"), a.link_gbps * share("network"),
                   a.disk_gbps)

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
    commit_s: float
    rpc_s: float

    @property
    def total_s(self) -> float:
        return self.rpc_s + self.gather_s + self.wire_s + self.commit_s

    def to_json(self) -> dict:
        return {"predicted_seconds": self.total_s, "wire_seconds": self.wire_s, "gather_seconds": self.gather_s,
                "commit_seconds": self.commit_s, "rpc_seconds": self.rpc_s, "busiest_link": self.busiest,
                "busiest_link_bytes": self.link_bytes.get(self.busiest, 0)}


def simulate(plan: TransferPlan, trainer_gpus: tuple[Gpu, ...], engines: tuple[tuple[Gpu, ...], ...],
             rates: LinkRates, *, disk: bool = False, gather_bytes: dict[int, int] | None = None,
             rpc_s: float = RPC_S, commit_gbps: float = COMMIT_GBPS) -> Simulation:
    """The plan's bytes on every link and the predicted update time. ``disk``: the bytes go through a
    shared disk (disk-delta). ``gather_bytes``: per rank, bytes it collects from other trainer ranks
    before it sends (rank 0 of a rank-0 plan; every rank of a colocated one), over the network when the
    trainer spans nodes, else NVLink."""
    link: dict[str, int] = collections.defaultdict(int)
    committed: dict[Gpu, int] = collections.defaultdict(int)

    def add(gpu: Gpu, direction: str, kind: str, nbytes: int) -> None:
        link[f"node {gpu[0]} gpu {gpu[1]} {direction} {kind}"] += nbytes

    if plan.engine_copies > 1:  # writes (build.build_write_plan): each engine's flows are engine 0's
        flows: dict[tuple[int, int], int] = collections.defaultdict(int)
        for route in plan.routes:
            for _, w in route.receivers:
                flows[(route.sender, w)] += route.nbytes
        for e in range(plan.engine_copies):
            for (sender, w), nbytes in flows.items():
                src, dst = trainer_gpus[sender], engines[e][w]
                kind = "disk" if disk else link_between(src, dst)
                add(dst, "in", kind, nbytes)
                if kind != "ipc":
                    committed[dst] += nbytes
                    add(src, "out", kind, nbytes)
    for route in plan.routes if plan.engine_copies == 1 else ():
        src = trainer_gpus[route.sender]
        kinds = set()
        for e, w in route.receivers:
            dst = engines[e][w]
            kind = "disk" if disk else link_between(src, dst)
            add(dst, "in", kind, route.nbytes)
            if kind == "ipc":
                continue
            committed[dst] += route.nbytes
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
    commit_s = max(committed.values(), default=0) * 8 / (commit_gbps * 1e9)
    return Simulation(dict(link), busiest, times.get(busiest, 0.0), gather_s, commit_s, rpc_s)
