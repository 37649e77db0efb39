"""Pure layout math: cluster shape + placement config -> which (node, gpu) serves what.

No Ray here, so every shape is testable in microseconds. Invariants of a :class:`Layout`:

* split: the trainer takes its GPUs first (``--actor-num-gpus-per-node`` on each of
  ``--actor-num-nodes`` nodes), engines take free GPUs after it; no GPU appears twice; an engine
  that fits in one node never spans two; an engine wider than a node takes whole nodes.
* colocate: engines tile the trainer's GPUs in order; both sides use the same GPUs and the job
  takes ``max(trainer, rollout)`` GPUs.
"""

from __future__ import annotations

import dataclasses
from rlplacement.config import PlacementConfig
from rlplacement.errors import ConfigError

Gpu = tuple[int, int]  # (node index, gpu index within the node), both in the cluster's sorted order


@dataclasses.dataclass(frozen=True)
class ClusterShape:
    """GPUs on each node, nodes in the order bundles are sorted (node IP, then id).

    ``None`` means "as many nodes as the layout needs", which is what ``rlplacement plan`` uses.
    """

    gpus_per_node: tuple[int, ...] | None = None

    def node_gpus(self, node: int, default: int) -> int:
        if self.gpus_per_node is None:
            return default
        if node >= len(self.gpus_per_node):
            return 0
        return self.gpus_per_node[node]


@dataclasses.dataclass(frozen=True)
class Layout:
    colocate: bool
    trainer_gpus: tuple[Gpu, ...]
    engines: tuple[tuple[Gpu, ...], ...]
    num_gpus_per_node: int

    @property
    def rollout_gpus(self) -> tuple[Gpu, ...]:
        return tuple(g for e in self.engines for g in e)

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        """Every GPU the job uses, sorted; colocated GPUs once."""
        return tuple(sorted(set(self.trainer_gpus) | set(self.rollout_gpus)))

    @property
    def num_nodes(self) -> int:
        return 1 + max(n for n, _ in self.gpus)

    @property
    def gpus_per_engine(self) -> int:
        return len(self.engines[0])

    def gpus_by_node(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for node, gpu in self.gpus:
            out.setdefault(node, []).append(gpu)
        return out

    def roles_of(self, gpu: Gpu) -> list[str]:
        roles = []
        if gpu in self.trainer_gpus:
            roles.append(f"trainer[{self.trainer_gpus.index(gpu)}]")
        for i, engine in enumerate(self.engines):
            if gpu in engine:
                roles.append(f"engine[{i}].{engine.index(gpu)}")
        return roles

    def to_json(self) -> dict:
        """The object of the ``rlplacement plan --json`` contract."""
        return {
            "mode": "colocate" if self.colocate else "split",
            "num_nodes": self.num_nodes,
            "num_gpus": len(self.gpus),
            "trainer": {"num_gpus": len(self.trainer_gpus), "gpus": [list(g) for g in self.trainer_gpus]},
            "rollout": {
                "num_gpus": len(self.rollout_gpus),
                "gpus_per_engine": self.gpus_per_engine,
                "num_engines": len(self.engines),
                "engines": [[list(g) for g in e] for e in self.engines],
            },
        }


def _trainer_gpus(cfg: PlacementConfig, cluster: ClusterShape) -> list[Gpu]:
    gpus = []
    for node in range(cfg.actor_num_nodes):
        have = cluster.node_gpus(node, cfg.num_gpus_per_node)
        if have < cfg.actor_num_gpus_per_node:
            raise ConfigError(
                f"The trainer needs {cfg.actor_num_gpus_per_node} GPUs on each of {cfg.actor_num_nodes} "
                f"node(s) (--actor-num-nodes, --actor-num-gpus-per-node) but cluster node {node} has "
                f"{have}: lower those flags or add GPUs.")
        gpus.extend((node, g) for g in range(cfg.actor_num_gpus_per_node))
    return gpus


def _node_sizes(cfg: PlacementConfig, cluster: ClusterShape) -> list[int]:
    """Sizes of nodes engines may use; an open-ended cluster grows as needed."""
    if cluster.gpus_per_node is not None:
        return list(cluster.gpus_per_node)
    needed = cfg.actor_num_nodes + -(-cfg.rollout_num_gpus // cfg.num_gpus_per_node) + 1
    return [cfg.num_gpus_per_node] * needed


def _split_engines(cfg: PlacementConfig, cluster: ClusterShape, used: set[Gpu]) -> list[tuple[Gpu, ...]]:
    sizes = _node_sizes(cfg, cluster)
    free = [[g for g in range(size) if (n, g) not in used] for n, size in enumerate(sizes)]
    width = cfg.rollout_num_gpus_per_engine
    engines: list[tuple[Gpu, ...]] = []
    for _ in range(cfg.num_engines):
        if width <= cfg.num_gpus_per_node:
            node = next((n for n, f in enumerate(free) if len(f) >= width), None)
            if node is None:
                break
            engines.append(tuple((node, g) for g in free[node][:width]))
            free[node] = free[node][width:]
        else:
            span = width // cfg.num_gpus_per_node
            whole = [n for n, f in enumerate(free) if len(f) == sizes[n] == cfg.num_gpus_per_node]
            run = next((whole[i:i + span] for i in range(len(whole) - span + 1)
                        if whole[i + span - 1] - whole[i] == span - 1), None)
            if run is None:
                break
            engines.append(tuple((n, g) for n in run for g in free[n]))
            for n in run:
                free[n] = []
    if len(engines) < cfg.num_engines:
        raise ConfigError(
            f"The cluster ({_describe(cluster)}) cannot hold the trainer's {cfg.trainer_num_gpus} GPUs plus "
            f"{cfg.num_engines} engine(s) of --rollout-num-gpus-per-engine {width} without splitting an engine "
            f"across nodes: lower --rollout-num-gpus or add nodes.")
    return engines


def _colocated_engines(cfg: PlacementConfig, trainer: list[Gpu]) -> list[tuple[Gpu, ...]]:
    width = cfg.rollout_num_gpus_per_engine
    return [tuple(trainer[i:i + width]) for i in range(0, cfg.rollout_num_gpus, width)]


def colocated_sender_ranks(layout: Layout) -> list[int]:
    """Under ``--colocate``: for each engine worker, engines in order and each engine's workers in order (the
    order of its GPUs, which is its workers' local device order), the trainer rank on the same GPU."""
    rank_of = {gpu: r for r, gpu in enumerate(layout.trainer_gpus)}
    return [rank_of[gpu] for engine in layout.engines for gpu in engine]


def _describe(cluster: ClusterShape) -> str:
    if cluster.gpus_per_node is None:
        return "unbounded"
    return f"{len(cluster.gpus_per_node)} node(s) with {list(cluster.gpus_per_node)} GPUs"


def compute_layout(cfg: PlacementConfig, cluster: ClusterShape = ClusterShape()) -> Layout:
    """Place trainer ranks and engines; raise ConfigError naming the flag when it cannot fit."""
    trainer = _trainer_gpus(cfg, cluster)
    if cfg.colocate:
        engines = _colocated_engines(cfg, trainer)
    else:
        engines = _split_engines(cfg, cluster, set(trainer))
    return Layout(cfg.colocate, tuple(trainer), tuple(engines), cfg.num_gpus_per_node)


@dataclasses.dataclass(frozen=True)
class Split:
    trainer_gpus: int
    rollout_gpus: int

    def __str__(self) -> str:
        return f"{self.trainer_gpus}:{self.rollout_gpus}"


def feasible_splits(total_gpus: int, num_gpus_per_node: int, gpus_per_engine: int,
                    trainer_min_gpus: int = 1, trainer_multiple: int = 1) -> list[Split]:
    """Every trainer:rollout split of ``total_gpus`` that whole engines and node boundaries allow.

    A split is feasible when rollout is a positive multiple of the engine width, the trainer has at
    least ``trainer_min_gpus`` (its memory floor) and is a multiple of ``trainer_multiple`` (its
    TP x PP), and :func:`compute_layout` places it on nodes of ``num_gpus_per_node`` without an engine
    straddling nodes. Within one 8-GPU node and 2-GPU engines this gives 6:2, 4:4, 2:6. Ordered by
    trainer GPUs, descending.
    """
    if total_gpus <= 0 or num_gpus_per_node <= 0 or gpus_per_engine <= 0:
        raise ValueError("total_gpus, num_gpus_per_node and gpus_per_engine must be positive")
    nodes = -(-total_gpus // num_gpus_per_node)
    cluster = ClusterShape(tuple([num_gpus_per_node] * (total_gpus // num_gpus_per_node)
                                 + ([total_gpus % num_gpus_per_node] if total_gpus % num_gpus_per_node else [])))
    out = []
    for trainer in range(total_gpus - 1, 0, -1):
        rollout = total_gpus - trainer
        if trainer < trainer_min_gpus or trainer % trainer_multiple or rollout % gpus_per_engine:
            continue
        if any(_places(PlacementConfig(
                actor_num_nodes=n, actor_num_gpus_per_node=k, rollout_num_gpus=rollout,
                rollout_num_gpus_per_engine=gpus_per_engine, num_gpus_per_node=num_gpus_per_node), cluster)
               for n, k in _trainer_shapes(trainer, num_gpus_per_node, nodes)):
            out.append(Split(trainer, rollout))
    return out


def _places(cfg: PlacementConfig, cluster: ClusterShape) -> bool:
    try:
        compute_layout(cfg, cluster)
    except ConfigError:
        return False
    return True


def _trainer_shapes(trainer: int, per_node: int, max_nodes: int) -> list[tuple[int, int]]:
    """(actor nodes, actor GPUs per node) pairs that make a trainer of ``trainer`` GPUs."""
    return [(n, trainer // n) for n in range(1, max_nodes + 1)
            if trainer % n == 0 and trainer // n <= per_node]
