"""verl's resource pools on the nodes our layout chose (the hook ``patches/verl`` adds).

verl 0.9.1 creates the trainer pool (``global_pool``) and each standalone rollout replica's pool
(``rollout_pool_<replica>``) as Ray placement groups with no node choice, so a layout from
``rlplacement plan`` is not reproducible there. The patch makes
``RayResourcePool.get_placement_groups`` ask :func:`placement_group_options` for extra
``placement_group(...)`` arguments: with ``RLPLACEMENT_VERL_LAYOUT`` set to the output of
``rlplacement plan --json`` (same flags as the verl overrides from ``--emit verl``), each group's
bundles are pinned to one node through Ray's ``ray.io/node-id`` label; without it, nothing changes.

Layout node ``n`` is the n-th alive GPU node ordered by IP then node id, as in our own
placement (``rlplacement.placement.ray_groups``).
"""

from __future__ import annotations

import json
import os
import re

LAYOUT_ENV = "RLPLACEMENT_VERL_LAYOUT"
TRAINER_POOL = "global_pool"
ROLLOUT_POOL = re.compile(r"rollout_pool_(\d+)$")


def _nodes_in_order(gpus) -> list[int]:
    """The distinct nodes of ``gpus`` ([[node, gpu], ...]) in order of first use."""
    return list(dict.fromkeys(node for node, _ in gpus))


def layout_node(layout: dict, pool_name: str, index: int) -> int | None:
    """Our layout's node for placement group ``index`` of verl pool ``pool_name``; None for a pool
    the layout does not describe (reward, teacher, colocated pools)."""
    if pool_name == TRAINER_POOL:
        nodes = _nodes_in_order(layout["trainer"]["gpus"])
    elif (match := ROLLOUT_POOL.match(pool_name)) is not None:
        engines = layout["rollout"]["engines"]
        replica = int(match.group(1))
        if replica >= len(engines):
            raise ValueError(f"{LAYOUT_ENV} has {len(engines)} rollout engine(s) but verl asked for replica "
                             f"{replica}: give verl the overrides from `rlplacement plan --emit verl` with the same flags")
        nodes = _nodes_in_order(engines[replica])
    else:
        return None
    if index >= len(nodes):
        raise ValueError(f"{LAYOUT_ENV}: verl pool {pool_name} has a placement group {index} but the layout puts it on "
                         f"{len(nodes)} node(s): give verl the overrides from `rlplacement plan --emit verl`")
    return nodes[index]


def placement_group_options(pool_name: str, index: int, num_bundles: int) -> dict:
    """Extra ``ray.util.placement_group`` arguments for verl's group ``index`` of ``pool_name``."""
    text = os.environ.get(LAYOUT_ENV)
    if not text:
        return {}
    node = layout_node(json.loads(text), pool_name, index)
    if node is None:
        return {}
    from rlplacement.placement.ray_groups import NODE_ID_LABEL, cluster_nodes

    nodes = cluster_nodes()
    if node >= len(nodes):
        raise ValueError(f"{LAYOUT_ENV} places verl pool {pool_name} on node {node}, but the Ray cluster has "
                         f"{len(nodes)} GPU node(s)")
    return {"bundle_label_selector": [{NODE_ID_LABEL: nodes[node].node_id}] * num_bundles}
