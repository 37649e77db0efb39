"""``rlplacement plan [flags] [--json | --emit verl|miles]``: the layout the flags ask for, without a
cluster, or the same layout in verl's or Miles' settings."""

from __future__ import annotations

import argparse
import json

from rlplacement.args import add_arguments, config_from_args
from rlplacement.placement.layout import Layout, compute_layout


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="print the layout the flags ask for (no cluster needed)")
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.add_argument("--emit", choices=("verl", "miles"), default=None,
                   help="print the same layout and transfer mode as verl Hydra overrides or Miles flags")


def render_table(layout: Layout) -> str:
    """A per-node table of GPUs and the roles on each."""
    lines = [f"mode: {'colocate' if layout.colocate else 'split'}   nodes: {layout.num_nodes}   "
             f"GPUs: {len(layout.gpus)} (trainer {len(layout.trainer_gpus)}, rollout "
             f"{len(layout.rollout_gpus)} in {len(layout.engines)} engine(s) of {layout.gpus_per_engine})"]
    for node, gpus in layout.gpus_by_node().items():
        lines.append(f"node {node}:")
        for gpu in range(layout.num_gpus_per_node):
            roles = layout.roles_of((node, gpu)) if gpu in gpus else []
            lines.append(f"  gpu {gpu}: {', '.join(roles) if roles else '-'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args, this_host=False)  # plans a cluster, maybe from elsewhere
    if args.emit:
        from rlplacement.placement.emit import EMITTERS

        print("\n".join(EMITTERS[args.emit](config, args)))
        return 0
    layout = compute_layout(config.placement)
    print(json.dumps(layout.to_json()) if args.json else render_table(layout))
    return 0
