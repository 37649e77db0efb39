"""The transfer docs' modelled tables: dense 8B, 32B and 70B shapes on 8 to 1,024 GPUs (and mixture-of-experts
shapes: Qwen3-30B-A3B, Qwen3-235B-A22B, Kimi-K2's sizes as a Qwen3-MoE, their trainers without expert
parallelism, and with it: ``--moe-ep``), rank 0 sending everything, every rank sending the parts of the
tensors it holds (pieces: what these split layouts run) and the sharded plan, predicted by the transfer
simulator (nothing here ran on a cluster); and the same shapes colocated
(``cuda_ipc``), where the plan that runs has each trainer rank hand the worker on its GPU the whole model.

Split: half the GPUs train (Megatron, the TP x PP below, the rest data-parallel), half serve engines of
the width below, 8 GPUs a node, trainer and engines on their own nodes. Colocated: every GPU of one node
trains and serves. Rates are the advisor's defaults.

    python benchmarks/simulate_transfer_table.py [--models 8B 32B 70B] [--moe-ep | --fsdp] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlplacement.advisor.thresholds import ModelAssumptions  # noqa: E402
from rlplacement.config import PlacementConfig  # noqa: E402
from rlplacement.placement.layout import compute_layout  # noqa: E402
from rlplacement.transfer.plan.for_layout import plans_for  # noqa: E402
from rlplacement.transfer.plan.tensors import ModelTensors  # noqa: E402

BASE = {"torch_dtype": "bfloat16", "hidden_act": "silu", "tie_word_embeddings": False, "head_dim": 128}
MODELS = {  # Qwen3-8B, Qwen3-32B, Llama-3-70B shapes
    "8B": {**BASE, "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936},
    "32B": {**BASE, "model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 151936},
    "70B": {**BASE, "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256},
}
MOE = {"model_type": "qwen3_moe", "norm_topk_prob": True, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
       "mlp_only_layers": []}
MODELS.update({  # mixture-of-experts shapes: Qwen3-30B-A3B, Qwen3-235B-A22B, and Kimi-K2's sizes as a Qwen3-MoE
    "30B-A3B": {**BASE, **MOE, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_experts": 128, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "vocab_size": 151936},
    "235B-A22B": {**BASE, **MOE, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                  "num_experts": 128, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                  "vocab_size": 151936},
    "1T (Kimi-K2 sizes)": {**BASE, **MOE, "hidden_size": 7168, "intermediate_size": 18432,
                           "moe_intermediate_size": 2048, "num_experts": 384, "num_hidden_layers": 61,
                           "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 163840},
})
# trainer TP, trainer PP, engine width (mixture-of-experts models without expert parallelism: what trains today)
SHAPES = {"8B": (1, 1, 1), "32B": (4, 1, 2), "70B": (8, 2, 8), "30B-A3B": (2, 1, 2), "235B-A22B": (4, 2, 8),
          "1T (Kimi-K2 sizes)": (8, 1, 16)}  # 235B: 4 KV heads, 94 layers; Kimi's 61 layers take no PP
GPUS = (8, 64, 256, 1024)
# plan build time bounds the mixture-of-experts rows (pure Python over ~19k-71k tensors: 12 s to 8 min a row on
# one core; Kimi's p2p row, every expert written to every worker, is left out)
MOE_GPUS = {"30B-A3B": (64, 256), "235B-A22B": (256,), "1T (Kimi-K2 sizes)": (256,)}
MOE_MODES = {"1T (Kimi-K2 sizes)": ("broadcast_packed",)}
MODES = ("broadcast_packed", "p2p")
COLOCATED_SHAPES = {"8B": (1, 1, 1), "32B": (4, 1, 2)}  # on one node of 8 GPUs (every rank hands its own
# GPU's worker the update, so more nodes add nothing per GPU); 70B does not train on 8 GPUs


def _row(name: str, model: ModelTensors, layout, mode: str, tp: int, pp: int, trainer_gpus: int, ep: int = 1,
         backend: str = "megatron") -> dict:
    started = time.perf_counter()
    pair = plans_for(model, layout, backend=backend, tp=tp, pp=pp, mode=mode, assumptions=ModelAssumptions(),
                     ep=ep)
    width = layout.gpus_per_engine
    trainer = f"FSDP{trainer_gpus}" if backend == "fsdp" else \
        f"TP{tp} PP{pp} {f'EP{ep} ' if ep > 1 else ''}DP{trainer_gpus // (tp * pp)}"
    return {"model": name, "gpus": len(layout.gpus), "ep": ep, "backend": backend, "trainer": trainer,
            "engines": f"{len(layout.engines)} x TP{width}", "mode": mode, "model_bytes": model.total_bytes,
            "colocate": layout.colocate, "who_sends": pair.who,
            "rank0_s": pair.rank0_sim.total_s, "sharded_s": pair.sharded_sim.total_s,
            "spread_s": pair.spread_sim.total_s if pair.spread_sim else None, "runs": pair.runs,
            "rank0_max_sender_bytes": max(pair.rank0.bytes_per_sender().values()),
            "spread_max_sender_bytes": max(pair.spread.bytes_per_sender().values()) if pair.spread else None,
            "sharded_max_sender_bytes": max(pair.sharded.bytes_per_sender().values()),
            "rank0_busiest_link": pair.rank0_sim.busiest,
            "spread_busiest_link": pair.spread_sim.busiest if pair.spread_sim else None,
            "sharded_busiest_link": pair.sharded_sim.busiest,
            "plan_build_s": time.perf_counter() - started}


# the mixture-of-experts rows again with megatron's expert parallelism (--moe-ep): each rank holds and sends
# its own experts
MOE_EP = {"30B-A3B": 8, "235B-A22B": 8, "1T (Kimi-K2 sizes)": 16}


def ep_rows() -> list[dict]:
    out = []
    for name, ep in MOE_EP.items():
        model = ModelTensors.from_hf_config(MODELS[name], source=name)
        tp, pp, width = SHAPES[name]
        for total in MOE_GPUS[name]:
            half = total // 2
            nodes = max(1, half // 8)
            placement = PlacementConfig(actor_num_nodes=nodes, actor_num_gpus_per_node=half // nodes,
                                        rollout_num_gpus=half, rollout_num_gpus_per_engine=width)
            for mode in MOE_MODES.get(name, MODES):
                out.append(_row(name, model, compute_layout(placement), mode, tp, pp, half, ep))
                print(f"{name} {total} {mode} EP{ep}: {out[-1]['spread_s']:.2f} s", file=sys.stderr, flush=True)
    return out


def fsdp_rows(only: list[str] | None = None) -> list[dict]:
    """The dense split rows with an FSDP trainer on the same GPUs: every rank sends its own rows of every
    tensor (``transfer.pieces``), so the plan that runs is the sharded plan's routes."""
    out = []
    for name in only or ("8B", "32B", "70B"):
        model = ModelTensors.from_hf_config(MODELS[name], source=name)
        width = SHAPES[name][2]
        for total in GPUS:
            half = total // 2
            if half < width:
                continue
            nodes = max(1, half // 8)
            placement = PlacementConfig(actor_num_nodes=nodes, actor_num_gpus_per_node=half // nodes,
                                        rollout_num_gpus=half, rollout_num_gpus_per_engine=width)
            for mode in MODES:
                out.append(_row(name, model, compute_layout(placement), mode, 1, 1, half, backend="fsdp"))
                print(f"{name} {total} {mode} fsdp: {out[-1]['spread_s']:.2f} s", file=sys.stderr, flush=True)
    return out


def rows(only: list[str] | None = None) -> list[dict]:
    out = []
    for name, config in MODELS.items():
        if only and name not in only:
            continue
        model = ModelTensors.from_hf_config(config, source=name)
        tp, pp, width = SHAPES[name]
        for total in MOE_GPUS.get(name, GPUS):
            half = total // 2
            if half < tp * pp or half < width:
                continue
            nodes = max(1, half // 8)
            placement = PlacementConfig(actor_num_nodes=nodes, actor_num_gpus_per_node=half // nodes,
                                        rollout_num_gpus=half, rollout_num_gpus_per_engine=width)
            for mode in MOE_MODES.get(name, MODES):
                out.append(_row(name, model, compute_layout(placement), mode, tp, pp, half))
        if name in COLOCATED_SHAPES:
            tp, pp, width = COLOCATED_SHAPES[name]
            placement = PlacementConfig(colocate=True, actor_num_nodes=1, actor_num_gpus_per_node=8,
                                        rollout_num_gpus=8, rollout_num_gpus_per_engine=width)
            out.append(_row(name, model, compute_layout(placement), "cuda_ipc", tp, pp, 8))
    return out


def markdown(table: list[dict], *, colocate: bool = False) -> str:
    runs = "each rank to its GPU's worker (runs)" if colocate else "every rank sends (runs)"
    lines = [f"| model | GPUs | trainer | engines | mode | rank 0 sends | {runs} | sharded plan | "
             "most bytes out of one GPU: rank 0 / the plan that runs / sharded |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        if r["colocate"] != colocate:
            continue
        runs_s = f"{r['spread_s']:.2f} s" if r["spread_s"] is not None else "-"
        runs_bytes = f"{r['spread_max_sender_bytes'] / 1e9:,.1f} GB" if r["spread_s"] is not None else "-"
        lines.append(f"| {r['model']} | {r['gpus']} | {r['trainer']} | {r['engines']} | {r['mode']} | "
                     f"{r['rank0_s']:.2f} s | {runs_s} | {r['sharded_s']:.2f} s | "
                     f"{r['rank0_max_sender_bytes'] / 1e9:,.0f} GB / {runs_bytes} / "
                     f"{r['sharded_max_sender_bytes'] / 1e9:,.1f} GB |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--models", nargs="*", default=None, choices=list(MODELS),
                        help="only these models' rows (default: every one)")
    parser.add_argument("--moe-ep", action="store_true",
                        help="only the mixture-of-experts rows, their trainers with expert parallelism (MOE_EP)")
    parser.add_argument("--fsdp", action="store_true",
                        help="only the dense split rows, their trainers FSDP over all the training GPUs")
    args = parser.parse_args()
    table = ep_rows() if args.moe_ep else fsdp_rows(args.models) if args.fsdp else rows(args.models)
    print(markdown(table))
    print()
    print(markdown(table, colocate=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "modelled": True, "rows": table},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
