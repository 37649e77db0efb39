"""``rlplacement plan [flags] [--json | --emit verl|miles | --simulate-transfer]``: the layout the flags ask
for, without a cluster; the same layout in verl's or Miles' settings; or its weight-transfer plan with
the bytes on every link and the predicted update time: the sharded plan, the plan that runs (every rank
sending its share in split layouts of the modes that spread, else rank 0 alone) and the rank-0 plan. The link rates are the advisor's flags (``--link-gbps``, ``--nvlink-gbps``, ``--ipc-gbps``,
``--disk-gbps``) with the same defaults and help.

It lives at the top of the package because it joins three layers: placement's layout, transfer's
plan and the advisor's link assumptions."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from rlplacement.advisor.thresholds import ModelAssumptions, field_help
from rlplacement.args import add_arguments, config_from_args
from rlplacement.placement.layout import Layout, compute_layout

RATE_FIELDS = ("link_gbps", "nvlink_gbps", "ipc_gbps", "disk_gbps")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="print the layout the flags ask for (no cluster needed)")
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print the layout as JSON")
    p.add_argument("--emit", choices=("verl", "miles"), default=None,
                   help="print the same layout and transfer mode as verl Hydra overrides or Miles flags")
    g = p.add_argument_group("transfer simulation")
    g.add_argument("--simulate-transfer", action="store_true",
                   help="print the transfer plan's bytes per sender, receiver and link and the predicted update "
                        "time, ours against the rank-0 plan (needs --hf-config or --hf-checkpoint)")
    g.add_argument("--memory", action="store_true",
                   help="print the GPU memory of the model's state: the busiest trainer rank's weights, gradients "
                        "and optimizer state under the flags' backend and TP/PP/EP, and an engine worker's weights "
                        "(needs --hf-config or --hf-checkpoint; activations and KV cache not modelled)")
    g.add_argument("--hf-config", default=None, metavar="CONFIG.json",
                   help="the model's config.json (default: the one in --hf-checkpoint)")
    helps = field_help(ModelAssumptions)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelAssumptions)}
    for name in RATE_FIELDS:
        g.add_argument("--" + name.replace("_", "-"), type=float, default=defaults[name], help=helps[name])


def config_path(args: argparse.Namespace) -> str:
    if args.hf_config:
        path = args.hf_config
    elif args.hf_checkpoint:
        path = os.path.join(args.hf_checkpoint, "config.json")
    else:
        raise ValueError("--simulate-transfer and --memory need the model: give --hf-config CONFIG.json or "
                         "--hf-checkpoint DIR")
    if not os.path.isfile(path):
        raise ValueError(f"--hf-config {path}: no such file; give the model's config.json")
    return path


def simulate_layout(config, layout, args: argparse.Namespace) -> dict:
    """The plan pair of the validated flags' layout, as JSON."""
    from rlplacement.transfer.plan.for_layout import plans_for
    from rlplacement.transfer.plan.tensors import ModelTensors

    model = ModelTensors.from_hf_config(config_path(args))
    assumptions = ModelAssumptions(**{n: getattr(args, n) for n in RATE_FIELDS})
    b = config.backend
    pair = plans_for(model, layout, backend=b.name, tp=b.tensor_model_parallel_size,
                     pp=b.pipeline_model_parallel_size, mode=config.transfer.mode, assumptions=assumptions,
                     ep=b.expert_model_parallel_size, slices=config.transfer.slices)
    return {"model": model.source, "model_bytes": model.total_bytes, "mode": config.transfer.mode,
            "backend": b.name, "engine_staging": engine_staging(config, model), **pair.to_json()}


def memory_of(config, layout, path: str) -> dict:
    """:func:`rlplacement.advisor.memory.layout_memory` of the validated flags (``--bf16`` unset: on, as on a
    GPU trainer)."""
    from rlplacement.advisor.memory import layout_memory
    from rlplacement.transfer.plan.tensors import ModelTensors

    b, t = config.backend, config.train
    return layout_memory(ModelTensors.from_hf_config(path), backend=b.name,
                         trainer_gpus=len(layout.trainer_gpus), tp=b.tensor_model_parallel_size,
                         pp=b.pipeline_model_parallel_size, ep=b.expert_model_parallel_size,
                         bf16=t.bf16 is not False, distributed_optimizer=t.use_distributed_optimizer,
                         engine_tp=layout.gpus_per_engine, lora=b.lora)


def render_memory(memory: dict) -> str:
    from rlplacement.specs.backend import backend_spec

    gb = 1e9
    sharded_optimizer = memory["distributed_optimizer"] and backend_spec(memory["backend"]).distributed_optimizer
    r = memory["trainer_rank"]
    gathered = f" + a layer gathered {r['gathered'] / gb:.2f}" if r["gathered"] else ""
    experts = (f", {memory['expert_parameters'] / 1e9:.2f} B of them experts" if memory["expert_parameters"] else "")
    if memory.get("adapter_parameters"):
        experts += f", {memory['adapter_parameters'] / 1e6:.1f} M LoRA parameters trained"
    return (f"model state in GPU memory ({memory['parameters'] / 1e9:.2f} B parameters{experts}; "
            f"{'--bf16' if memory['bf16'] else 'fp32'}, {memory['backend']}"
            f"{', distributed optimizer' if sharded_optimizer else ''}):\n"
            f"  busiest trainer rank: {r['total'] / gb:.2f} GB = weights {r['weights'] / gb:.2f} + gradients "
            f"{r['gradients'] / gb:.2f} + optimizer {r['optimizer'] / gb:.2f}{gathered} (activations not modelled)\n"
            f"  engine worker weights: {memory['engine_worker_weights'] / gb:.2f} GB (the KV cache takes what "
            f"--vllm-gpu-memory-utilization leaves)")


def engine_staging(config, model) -> dict:
    """What an update holds on each engine worker under each ``--update-weight-staging`` option (of the
    worker's share: :func:`worker_share`; with what it assembles where the trainer sends pieces, as the engine
    counts it), and the options this run's mode offers."""
    from rlplacement.engines.engine_settings import staging_per_option
    from rlplacement.job_start import trainer_sends_pieces_for
    from rlplacement.transfer import registry

    pieces = trainer_sends_pieces_for(config)
    per_option = staging_per_option(worker_share(config, model), config.transfer.bucket_bytes, pieces)
    offered = ("full", "bucket") if registry.spec(config.transfer.mode).bucket_staging else ("full",)
    return {"bytes": {k: v for k, v in per_option.items() if k in offered}, "requested": config.transfer.staging,
            "bucket_size": config.transfer.bucket_bytes, "pieces": pieces}


def worker_share(config, model) -> dict[str, int]:
    """HF name -> bytes of the busiest engine worker's part of each tensor: its slices where the run's workers
    receive only those (``registry.workers_take_slices``), else every tensor whole."""
    from rlplacement.transfer import registry, shards

    width = config.placement.rollout_num_gpus_per_engine
    whole = {t.name: t.bytes(model.itemsize) for t in model.tensors}
    if not registry.workers_take_slices(config.transfer.mode, width, config.transfer.slices):
        return whole
    return shards.busiest_share(whole, [shards.keeps_of(model, w, width) for w in range(width)], model.itemsize)


def render(result: dict) -> str:
    gb = 1e9
    lines = [f"transfer: {result['mode']} from {result['backend']}, {result['model']} "
             f"({result['model_bytes'] / gb:.2f} GB a version)",
             f"{'plan':<24}{'routes':>8}{'max sent/rank':>15}{'max recv/worker':>17}{'gather s':>10}"
             f"{'wire s':>9}{'total s':>9}  busiest link"]
    runs = result["runs"]
    spread_title = "each GPU's rank sends" if result.get("who_sends") == "own gpu" else "every rank sends"
    for key, title in (("sharded", "sharded (planned)"), ("spread", spread_title), ("rank0", "rank 0 sends")):
        if key not in result:
            continue
        r = result[key]
        title += " *" if key == runs else ""
        lines.append(f"{title:<24}{r['routes']:>8}{r['max_sender_bytes'] / gb:>12.2f} GB{r['max_receiver_bytes'] / gb:>14.2f}"
                     f" GB{r['gather_seconds']:>10.3f}{r['wire_seconds']:>9.3f}{r['predicted_seconds']:>9.3f}  "
                     f"{r['busiest_link']} ({r['busiest_link_bytes'] / gb:.2f} GB)")
    staging = result["engine_staging"]
    held = ", ".join(f"{option} {nbytes / gb:.2f} GB" for option, nbytes in staging["bytes"].items())
    pieces = ("; with pieces, two buckets, or three times a fused group larger than half a bucket: its pieces in "
              "the channels' buffers beside it assembling; full: the pieces and the tensors assembled") \
        if staging["pieces"] else ""
    lines.append(f"engine worker memory for an update (--update-weight-staging {staging['requested']}): {held} "
                 f"(bucket: two of the largest buckets at --update-weight-buffer-size {staging['bucket_size'] / gb:.2f}"
                 f" GB{pieces}), counted inside --vllm-gpu-memory-utilization")
    lines.append("* the plan this layout and mode run")
    lines.append(f"modelled: the busiest link at the datasheet rate x the mode's efficiency, the busiest worker's "
                 f"commit, {result['sharded']['rpc_seconds'] * 1e3:.0f} ms of calls (docs/transfer/README.md#simulator)")
    return "\n".join(lines)


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
    if args.simulate_transfer or args.memory:
        from rlplacement.errors import ConfigError

        try:
            memory = memory_of(config, layout, config_path(args)) if args.memory else None
            result = simulate_layout(config, layout, args) if args.simulate_transfer else None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if args.json:
            print(json.dumps({**layout.to_json(), **({"transfer": result} if result else {}),
                              **({"memory": memory} if memory else {})}))
        else:
            parts = [render_table(layout)] + ([render(result)] if result else []) + (
                [render_memory(memory)] if memory else [])
            print("\n\n".join(parts))
        return 0
    print(json.dumps(layout.to_json()) if args.json else render_table(layout))
    return 0
