"""Pure layout math over many shapes, checked against the invariants rather than fixed tables."""

import itertools

import pytest

from rlplacement.config import PlacementConfig
from rlplacement.errors import ConfigError
from rlplacement.placement.layout import ClusterShape, Split, colocated_sender_ranks, compute_layout, feasible_splits


def cfg(colocate=False, nodes=1, per_node=8, rollout=None, per_engine=1, gpus_per_node=8):
    if colocate:
        rollout = nodes * per_node
    return PlacementConfig(colocate=colocate, actor_num_nodes=nodes, actor_num_gpus_per_node=per_node,
                           rollout_num_gpus=rollout, rollout_num_gpus_per_engine=per_engine,
                           num_gpus_per_node=gpus_per_node)


def check_split_invariants(c: PlacementConfig, layout):
    trainer, rollout = layout.trainer_gpus, layout.rollout_gpus
    assert len(trainer) == c.trainer_num_gpus and len(rollout) == c.rollout_num_gpus
    assert len(set(trainer + rollout)) == len(trainer) + len(rollout), "a GPU is used twice"
    assert all(0 <= g < c.num_gpus_per_node for _, g in trainer + rollout)
    # trainer: --actor-num-gpus-per-node on each of the first --actor-num-nodes nodes
    for node in range(c.actor_num_nodes):
        assert [g for n, g in trainer if n == node] == list(range(c.actor_num_gpus_per_node))
    for engine in layout.engines:
        assert len(engine) == c.rollout_num_gpus_per_engine
        nodes = sorted({n for n, _ in engine})
        if c.rollout_num_gpus_per_engine <= c.num_gpus_per_node:
            assert len(nodes) == 1, f"engine {engine} spans nodes though it fits in one"
        else:
            assert len(nodes) == c.rollout_num_gpus_per_engine // c.num_gpus_per_node
            assert nodes == list(range(nodes[0], nodes[0] + len(nodes)))
    assert len(layout.gpus) == c.trainer_num_gpus + c.rollout_num_gpus


SPLIT_SHAPES = [
    (nodes, per_node, rollout, per_engine, gpn)
    for gpn in (4, 8)
    for nodes in (1, 2, 3, 4)
    for per_node in sorted({1, gpn // 2, gpn})
    for per_engine in (1, 2, 4, 8)
    for rollout in (per_engine, 2 * per_engine, 4 * per_engine)
    if not (per_engine > gpn and per_engine % gpn)
]


@pytest.mark.parametrize("nodes, per_node, rollout, per_engine, gpn", SPLIT_SHAPES)
def test_split_layout_invariants(nodes, per_node, rollout, per_engine, gpn):
    c = cfg(False, nodes, per_node, rollout, per_engine, gpn)
    check_split_invariants(c, compute_layout(c))


@pytest.mark.parametrize("nodes, per_node, per_engine, gpn", [
    (n, p, e, g) for g in (4, 8) for n in (1, 2, 3, 4) for p in (g // 2, g) for e in (1, 2, 4, 8)
    if e <= p and p % e == 0])
def test_colocate_layout_shares_the_trainer_gpus(nodes, per_node, per_engine, gpn):
    c = cfg(True, nodes, per_node, None, per_engine, gpn)
    layout = compute_layout(c)
    assert set(layout.rollout_gpus) == set(layout.trainer_gpus)
    assert len(layout.gpus) == max(c.trainer_num_gpus, c.rollout_num_gpus) == nodes * per_node
    assert all(len({n for n, _ in e}) == 1 for e in layout.engines)
    assert layout.to_json()["mode"] == "colocate"
    # each engine worker's sender is the trainer rank on its own GPU, every rank at most once
    ranks = colocated_sender_ranks(layout)
    assert [layout.trainer_gpus[r] for r in ranks] == list(layout.rollout_gpus)
    assert len(set(ranks)) == len(ranks)


def test_split_example_two_nodes():
    layout = compute_layout(cfg(False, 1, 6, 4, 2, 8))
    # 6 trainer GPUs on node 0, one 2-GPU engine in the 2 left, the next on node 1
    assert layout.engines == (((0, 6), (0, 7)), ((1, 0), (1, 1)))
    assert layout.to_json() == {
        "mode": "split", "num_nodes": 2, "num_gpus": 10,
        "trainer": {"num_gpus": 6, "gpus": [[0, g] for g in range(6)]},
        "rollout": {"num_gpus": 4, "gpus_per_engine": 2, "num_engines": 2,
                    "engines": [[[0, 6], [0, 7]], [[1, 0], [1, 1]]]}}


def test_engine_skips_a_node_rather_than_straddle():
    layout = compute_layout(cfg(False, 1, 6, 4, 4, 8))
    assert layout.engines == (tuple((1, g) for g in range(4)),)
    assert layout.roles_of((0, 7)) == []


def test_engine_wider_than_a_node_takes_whole_nodes():
    layout = compute_layout(cfg(False, 1, 8, 16, 16, 8))
    assert layout.engines == (tuple((n, g) for n in (1, 2) for g in range(8)),)


def test_bounded_cluster_rejects_what_does_not_fit():
    with pytest.raises(ConfigError, match="cannot hold .* without splitting an engine"):
        compute_layout(cfg(False, 1, 6, 4, 4, 8), ClusterShape((8,)))
    with pytest.raises(ConfigError, match="cluster node 1 has 0"):
        compute_layout(cfg(False, 2, 8, 8, 1, 8), ClusterShape((8,)))


@pytest.mark.parametrize("total, gpn, width, want", [
    (8, 8, 2, ["6:2", "4:4", "2:6"]),
    (8, 8, 1, [f"{t}:{8 - t}" for t in range(7, 0, -1)]),
    (8, 8, 4, ["4:4"]),
    (16, 8, 8, ["8:8"]),
    (16, 8, 4, ["8:8", "4:12"]),
    (4, 4, 2, ["2:2"]),
])
def test_feasible_splits(total, gpn, width, want):
    assert [str(s) for s in feasible_splits(total, gpn, width)] == want


def test_feasible_splits_respect_the_trainer_floor_and_multiple():
    assert feasible_splits(8, 8, 2, trainer_min_gpus=4) == [Split(6, 2), Split(4, 4)]
    assert feasible_splits(8, 8, 1, trainer_multiple=4) == [Split(4, 4)]


def test_every_feasible_split_really_places():
    for total, gpn, width in itertools.product((8, 16, 24), (4, 8), (1, 2, 4)):
        for split in feasible_splits(total, gpn, width):
            assert split.rollout_gpus % width == 0 and split.trainer_gpus + split.rollout_gpus == total
