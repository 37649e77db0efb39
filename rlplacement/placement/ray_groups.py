"""Turn a :class:`Layout` into one Ray placement group and per-actor ``.options(...)``.

One bundle per GPU the layout uses, each pinned to its node with Ray's ``ray.io/node-id`` label,
so node boundaries in the layout are node boundaries on the cluster. Nodes are ordered by IP then
node id; within a node, bundles by the GPU id Ray assigned them. Layout GPU ``(n, j)`` is the j-th
GPU of node n in that order.

Every actor gets ``CUDA_VISIBLE_DEVICES`` set explicitly (with Ray's own setting disabled for it),
because a multi-GPU engine must see all of its GPUs while Ray would show it only its first bundle's.
Split layouts claim whole GPUs; under ``--colocate`` a trainer rank and the engine on the same GPU
claim fractional shares that add up to one GPU. Shares are scheduler bookkeeping, not memory caps:
memory is time-shared by the loop (offload / sleep).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

from rlplacement.config import PlacementConfig
from rlplacement.errors import ConfigError
from rlplacement.placement.layout import ClusterShape, Gpu, Layout, compute_layout

TRAINER_GPU_SHARE_COLOCATED = 0.5
ENGINE_GPU_SHARE_COLOCATED = 0.5
NODE_ID_LABEL = "ray.io/node-id"
# Environment the driver has that every actor must keep, e.g. NCCL_NVLS_ENABLE=0 on shared hosts, Mooncake's
# MC_MIN_RPC_PORT/MC_MAX_RPC_PORT (the port range a firewall names, docs/security.md).
FORWARDED_ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_", "VLLM_", "RLPLACEMENT_", "MC_")


@dataclasses.dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    num_gpus: int


def private_token_file() -> None:
    """Create Ray's default token file owner-only (0600 in a 0700 folder) where Ray would generate it.

    Ray (2.60) writes ``~/.ray/auth_token`` with the process umask when a local cluster starts with
    token auth and finds no token, usually readable by every local user, who could then join the
    cluster (its ports are reachable from this machine). Nothing is done where a token is given
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``), the file exists, or ``RAY_AUTH_MODE`` says other
    than token.
    """
    import secrets
    from pathlib import Path

    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        return
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    path = Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # Ray's own token format


def cluster_to_join(address: str | None) -> str | None:
    """The cluster a job joins: ``address`` (``--ray-address``), else ``RAY_ADDRESS``; None (either of them
    ``local``, or neither set) means a cluster of the job's own. Never the one Ray would find by itself:
    ``ray.init()`` without an address joins the last cluster ``ray start`` left on this machine, which was
    not asked for and refuses the local cluster's logical GPU count."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def connect(address: str | None = None, *, local_num_gpus: int = 8, local_num_cpus: int | None = None,
            verbose: bool = True) -> None:
    """Join :func:`cluster_to_join`, else start a local one-node cluster of logical GPUs (a new one even where
    another runs on this machine). Without ``verbose`` Ray's own messages are WARNING and above (actors'
    output still reaches the driver).

    A local cluster keeps Ray's token authentication, which Ray 2.60 turns on for ``ray.init()``
    when ``RAY_AUTH_MODE`` is unset (its ports listen on every interface; without a token anyone who
    reaches them runs code as this user); the token file is made owner-only (:func:`private_token_file`).
    A ``RAY_AUTH_MODE`` you set is kept. Ray reads the mode once per process: a process that
    started a token cluster cannot later start one whose workers are told ``RAY_AUTH_MODE=disabled``
    (their calls are refused), so a test process that does so sets ``RAY_AUTH_MODE`` before its first
    cluster. A cluster you join (``address``) keeps the authentication it was started with."""
    import ray

    from rlplacement.console import RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_NOTICE, drop_notices

    if ray.is_initialized():
        return
    address = cluster_to_join(address)
    level = logging.INFO if verbose else logging.WARNING
    if not sys.stdout.isatty():  # actors' lines reach a file or a pipe: no colour codes in them
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if not verbose:  # the trainer ranks drop their libraries' notices to developers (backends.quiet)
        os.environ.setdefault("RLPLACEMENT_QUIET_TRAINER_NOTICES", "1")
    if address:
        ray.init(address=address, log_to_driver=True, logging_level=level)
    else:
        private_token_file()
        drop_notices(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_NOTICE)  # token auth kept on: nothing to act on
        ray.init(address="local", num_gpus=local_num_gpus, num_cpus=local_num_cpus or os.cpu_count(),
                 include_dashboard=False, log_to_driver=True, logging_level=level)


def cluster_nodes() -> list[RayNode]:
    """Alive nodes that have GPUs, in bundle order (IP, then node id)."""
    import ray

    nodes = [RayNode(n["NodeID"], n["NodeManagerAddress"], int(n["Resources"].get("GPU", 0)))
             for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) >= 1]
    return sorted(nodes, key=lambda n: (tuple(int(p) if p.isdigit() else p for p in n.ip.split(".")), n.node_id))


def cluster_shape(cfg: PlacementConfig, nodes: list[RayNode]) -> ClusterShape:
    """The shape the layout may use; rejects nodes smaller than ``--num-gpus-per-node``."""
    if not nodes:
        raise ConfigError("The Ray cluster has no node with GPUs: start Ray with GPUs (ray start --num-gpus N).")
    small = [n for n in nodes if n.num_gpus < cfg.num_gpus_per_node]
    if small:
        raise ConfigError(
            f"--num-gpus-per-node is {cfg.num_gpus_per_node} but Ray node {small[0].ip} ({small[0].node_id[:8]}) "
            f"has {small[0].num_gpus} GPUs: set --num-gpus-per-node {min(n.num_gpus for n in nodes)}.")
    return ClusterShape(tuple(cfg.num_gpus_per_node for _ in nodes))


def check_fits(cfg: PlacementConfig, nodes: list[RayNode]) -> Layout:
    """The layout on this cluster, or a ConfigError saying how many GPUs/nodes are missing."""
    wanted = compute_layout(cfg)
    shape = cluster_shape(cfg, nodes)
    have_gpus = sum(shape.gpus_per_node)
    if wanted.num_nodes > len(nodes) or len(wanted.gpus) > have_gpus:
        raise ConfigError(
            f"The layout needs {len(wanted.gpus)} GPUs on {wanted.num_nodes} node(s) of --num-gpus-per-node "
            f"{cfg.num_gpus_per_node}, but the Ray cluster has {have_gpus} GPUs on {len(nodes)} node(s): lower "
            f"--actor-num-nodes/--actor-num-gpus-per-node/--rollout-num-gpus or add nodes.")
    return compute_layout(cfg, shape)


@dataclasses.dataclass
class RayPlacement:
    """A created placement group and where each layout GPU landed in it."""

    layout: Layout
    placement_group: Any
    bundle_of: dict[Gpu, int]
    device_of: dict[Gpu, str]
    node_id_of: dict[int, str]

    def visible_devices(self, gpus: tuple[Gpu, ...]) -> str:
        return ",".join(self.device_of[g] for g in gpus)

    def _options(self, gpus: tuple[Gpu, ...], num_gpus: float) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        env.update({"CUDA_VISIBLE_DEVICES": self.visible_devices(gpus),
                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
        return {
            "num_cpus": 0,
            "num_gpus": num_gpus,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self.bundle_of[gpus[0]]),
            "runtime_env": {"env_vars": env},
        }

    def trainer_options(self, rank: int) -> dict:
        share = TRAINER_GPU_SHARE_COLOCATED if self.layout.colocate else 1
        return self._options((self.layout.trainer_gpus[rank],), share)

    def engine_node(self, index: int) -> str:
        """The Ray node id engine ``index`` runs on."""
        return self.node_id_of[self.layout.engines[index][0][0]]

    def engine_options(self, index: int) -> dict:
        share = ENGINE_GPU_SHARE_COLOCATED if self.layout.colocate else 1
        return self._options(self.layout.engines[index], share)

    def remove(self) -> None:
        from ray.util import remove_placement_group

        remove_placement_group(self.placement_group)


def _probe_bundles(pg: Any, count: int, timeout_s: float = 60.0) -> list[tuple[str, str]]:
    """(node id, GPU id) of each bundle, read by a tiny task inside it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=0.01)
    def where() -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])

    refs = [where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, i)).remote() for i in range(count)]
    return ray.get(refs, timeout=timeout_s)


def place(cfg: PlacementConfig, *, timeout_s: float = 60.0, verbose: bool = True) -> RayPlacement:
    """Connect to Ray, check the cluster can hold the layout, create and map the placement group."""
    import ray
    from ray.util import placement_group

    layout_wanted = compute_layout(cfg)
    if cluster_to_join(cfg.ray_address) is None and layout_wanted.num_nodes > 1 and not ray.is_initialized():
        raise ConfigError(
            f"The layout needs {layout_wanted.num_nodes} nodes but no cluster was given and a local Ray cluster "
            f"has one node: pass --ray-address (or set RAY_ADDRESS) to a cluster's address, or shrink the layout to one node.")
    connect(cfg.ray_address, local_num_gpus=cfg.num_gpus_per_node, verbose=verbose)
    nodes = cluster_nodes()
    layout = check_fits(cfg, nodes)
    gpus = layout.gpus
    pg = placement_group([{"GPU": 1} for _ in gpus], strategy="PACK",
                         bundle_label_selector=[{NODE_ID_LABEL: nodes[n].node_id} for n, _ in gpus])
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except Exception as exc:  # GetTimeoutError: GPUs held by other jobs
        from ray.util import remove_placement_group

        remove_placement_group(pg)
        raise ConfigError(
            f"Ray could not reserve {len(gpus)} GPUs for the layout within {timeout_s:.0f}s ({type(exc).__name__}): "
            f"other jobs may hold them; free them or shrink the layout.") from exc
    probed = _probe_bundles(pg, len(gpus))
    bundle_of: dict[Gpu, int] = {}
    device_of: dict[Gpu, str] = {}
    for node in sorted({n for n, _ in gpus}):
        mine = sorted((i for i, (nid, _) in enumerate(probed) if nid == nodes[node].node_id),
                      key=lambda i: int(probed[i][1]))
        node_gpus = [g for g in gpus if g[0] == node]
        for gpu, bundle in zip(node_gpus, mine, strict=True):
            bundle_of[gpu] = bundle
            device_of[gpu] = probed[bundle][1]
    node_id_of = {n: nodes[n].node_id for n in sorted({n for n, _ in gpus})}
    return RayPlacement(layout, pg, bundle_of, device_of, node_id_of)
