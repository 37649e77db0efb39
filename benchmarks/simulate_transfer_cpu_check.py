"""The transfer simulator against updates measured on this machine with several senders and receivers:
predicted / measured seconds per row.

Rows: ``broadcast_packed`` (gloo) and ``p2p`` (Mooncake over TCP), 1 and 2 sending trainer ranks (each its
share, ``plan.trainer_shards.share_holdings``: the runtime's assignment), 1, 2 and 4 receivers (engines of
one worker each, so whole tensors: the simulator's GPU model), senders and receivers as threads of one
process over loopback, a Qwen3-shaped bf16 model. Each mode is calibrated once in the same run: its fixed
cost from an update of one small tensor, its link rate from the one-sender, one-receiver row (which so holds
by construction); every other row is the check. The simulator lays the ranks on one node (links
``nvlink``), every sender and receiver on its own GPU, and prices no commit (the receivers here commit
nothing). |ratio - 1| <= 0.15 is the goal; a row outside it names the term that is off. Two more columns
isolate the terms a single host changes: the same plan with a per-receiver fanout (gloo's broadcast sends
to each receiver in turn; NCCL's pipelined broadcast, which the simulator prices, leaves its sender once)
and, on top, every sender's outgoing bytes through one shared link (loopback).

``--throttle-mbit N`` shapes loopback to N Mbit/s with ``tc`` (root; the qdisc is removed on exit), so the
wire, not this machine's two cores, sets the rate, as a NIC would. Loopback is one link for every flow, so
under a throttle the rows of two senders share it.

    python benchmarks/simulate_transfer_cpu_check.py [--hidden 512] [--layers 8] [--repeats 3]
        [--throttle-mbit 2000] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("broadcast_packed", "p2p")
LAYOUTS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4))  # (senders, receivers)


def model_config(hidden: int, layers: int) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden,
            "intermediate_size": 3 * hidden, "num_attention_heads": max(1, hidden // 128), "num_key_value_heads": 1,
            "head_dim": 128, "num_hidden_layers": layers, "vocab_size": 32000, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def tensors(model):
    import torch

    g = torch.Generator().manual_seed(0)
    return [(t.name, (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)) for t in model.tensors]


def measure(mode: str, shares: list[list], n_receivers: int, repeats: int) -> float:
    """Median seconds of ``repeats`` updates after one warm-up (p2p's first learns destinations)."""
    from tests.test_transfer_multi_sender import Senders, _run_threads

    s = Senders(mode, num_senders=len(shares), n_receivers=n_receivers, bucket_bytes=64 << 20)

    def receive(r, version):
        r.begin(version)
        r.receive()
        r.commit(lambda staged: None)  # nothing copied out: the simulator prices no commit here

    try:
        seconds = []
        for version in range(1, repeats + 2):
            start = time.perf_counter()
            _, errors = _run_threads([lambda x=x, share=share, v=version: x.update(v, share)
                                      for x, share in zip(s.senders, shares)] +
                                     [lambda r=r, v=version: receive(r, v) for r in s.receivers])
            if any(errors):
                raise RuntimeError(f"{mode}: {errors}")
            if version > 1:
                seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)
    finally:
        s.close()


def predicted(model, senders: int, receivers: int, fanout: str, rate_gbps: float, fixed_s: float):
    """The simulator's prediction for this layout with ``fanout`` (``build.BROADCAST``: what it prices for a
    broadcast mode, NCCL's pipelined broadcast leaving its sender once; ``build.WRITE``: once per receiver)."""
    from rlplacement.transfer.plan.build import build_plan
    from rlplacement.transfer.plan.engine_shards import whole_model_needs
    from rlplacement.transfer.plan.simulate import LinkRates, simulate
    from rlplacement.transfer.plan.trainer_shards import share_holdings

    whole = whole_model_needs(model, 1)[0]
    plan = build_plan(model, share_holdings(model, senders), {(e, 0): whole for e in range(receivers)}, fanout)
    trainer = tuple((0, g) for g in range(senders))
    engines = tuple(((0, senders + e),) for e in range(receivers))
    return simulate(plan, trainer, engines, LinkRates(rate_gbps, rate_gbps, rate_gbps, rate_gbps),
                    rpc_s=fixed_s, commit_gbps=1e12)


def one_shared_link_s(sim, rate_gbps: float, fixed_s: float) -> float:
    """The same bytes if every sender's outgoing link were one link (loopback is): all of them over its rate."""
    out = sum(b for name, b in sim.link_bytes.items() if " out " in name)
    return fixed_s + out * 8 / (rate_gbps * 1e9)


@contextlib.contextmanager
def throttled(mbit: int | None):
    if not mbit:
        yield
        return
    subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{mbit}mbit", "burst", "1mbit",
                    "latency", "200ms"], check=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throttle-mbit", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from rlplacement.transfer.plan.build import BROADCAST, WRITE
    from rlplacement.transfer.plan.tensors import ModelTensors
    from rlplacement.transfer.plan.trainer_shards import share_holdings

    model = ModelTensors.from_hf_config(model_config(args.hidden, args.layers))
    named = tensors(model)
    small = [[("model.norm.weight", named[-1][1][:64].clone())]]
    print(f"model: {model.total_bytes / 1e6:.1f} MB bf16, {len(named)} tensors; throttle "
          f"{args.throttle_mbit or 'none'} Mbit/s")
    rows = []
    with throttled(args.throttle_mbit):
        for mode in MODES:
            fixed = measure(mode, small, 1, args.repeats)
            rate = None
            for senders, receivers in LAYOUTS:
                holdings = share_holdings(model, senders)
                shares = [[(n, t) for n, t in named if n in holdings[s]] for s in range(senders)]
                measured = measure(mode, shares, receivers, args.repeats)
                if rate is None:  # the calibration row
                    rate = model.total_bytes * 8 / max(measured - fixed, 1e-9) / 1e9
                sim = predicted(model, senders, receivers, BROADCAST if mode.startswith("broadcast") else WRITE,
                                rate, fixed)
                # gloo's broadcast sends to each receiver in turn: once per receiver, as a write
                per_receiver = predicted(model, senders, receivers, WRITE, rate, fixed)
                shared = one_shared_link_s(per_receiver, rate, fixed)
                row = {"mode": mode, "senders": senders, "receivers": receivers, "bytes": model.total_bytes,
                       "measured_s": round(measured, 4), "predicted_s": round(sim.total_s, 4),
                       "ratio": round(sim.total_s / measured, 3),
                       "predicted_per_receiver_fanout_s": round(per_receiver.total_s, 4),
                       "predicted_one_shared_link_s": round(shared, 4), "ratio_one_shared_link": round(shared / measured, 3),
                       "fixed_s": round(fixed, 4), "calibrated_gbps": round(rate, 3), "busiest_link": sim.busiest,
                       "busiest_link_bytes": sim.link_bytes.get(sim.busiest, 0)}
                rows.append(row)
                print(f"{mode:17s} senders {senders} receivers {receivers}: measured {measured:.3f} s, simulator "
                      f"{sim.total_s:.3f} s (ratio {row['ratio']:.2f}), per-receiver fanout "
                      f"{per_receiver.total_s:.3f} s, one shared link {shared:.3f} s (ratio "
                      f"{row['ratio_one_shared_link']:.2f})")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        Path(args.json).write_text(json.dumps({
            "what": "transfer simulator against CPU runs of several senders and receivers, calibrated per mode in "
                    "the same run", "command": "python benchmarks/simulate_transfer_cpu_check.py " + " ".join(sys.argv[1:]),
            "commit": commit, "machine": f"{os.cpu_count()} cores, threads of one process, loopback",
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
