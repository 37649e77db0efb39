"""Placement: pure layout math (``layout``) apart from the Ray code (``ray_groups``)."""

from rlplacement.placement.layout import ClusterShape, Layout, Split, compute_layout, feasible_splits

__all__ = ["ClusterShape", "Layout", "Split", "compute_layout", "feasible_splits"]
