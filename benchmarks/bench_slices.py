"""Each engine worker taking only its slices (``rlplacement.transfer.shards``) against every worker taking
every tensor whole, in the same run: p2p (Mooncake over loopback TCP), broadcast and broadcast_packed (gloo
over loopback, a group per worker position) and disk-delta, one sender and the workers of one TP engine as
receiver threads, a Qwen3-shaped bf16 model.

    python benchmarks/bench_slices.py [--hidden 1024] [--layers 16] [--tp 2 4] [--repeats 3] [--json FILE]

Per mode and width it prints, for whole tensors and for slices: seconds per update (median of the timed
updates after one warm-up: every write landed, every worker staged and committed, its commit copying what
vLLM's loader copies: a slice's box, a whole tensor whole),
bytes per worker (received; disk-delta: the host copy kept for the next delta) and the ratios
slices / whole. The workers are threads of one process on this machine's cores, so the times say what
the bytes cost here (loopback TCP, memcpy), not on a NIC.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def model_config(hidden: int, layers: int) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden,
            "intermediate_size": 3 * hidden, "num_attention_heads": hidden // 128, "num_key_value_heads": 4,
            "head_dim": 128, "num_hidden_layers": layers, "vocab_size": 32000, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def tensors(config: dict):
    import torch

    from rlplacement.transfer.plan.tensors import ModelTensors

    g = torch.Generator().manual_seed(0)
    return [(t.name, (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16))
            for t in ModelTensors.from_hf_config(config).tensors]


def scaled(named, step: int):
    return [(n, t * (1 + 0.01 * step)) for n, t in named]


def load_like_vllm(receiver, staged) -> None:
    """What the engine's loader copies: a sliced tensor's box (out of the ``slice_tensor`` it is handed, into a
    parameter-sized destination, as vLLM's ``param.copy_(loaded.narrow(...))``), every other tensor whole."""
    import torch

    from rlplacement.transfer.shards import cut

    sliced = receiver.sliced
    for name, t in staged:
        view = cut(t, sliced[name][0] if name in sliced else None)
        torch.empty(view.shape, dtype=view.dtype).copy_(view)


def run_update(s, version: int, named) -> tuple:
    def recv(i):
        r = s.receivers[i]
        r.begin(version)
        r.receive()
        r.commit(lambda staged: load_like_vllm(r, staged))

    def send():
        try:
            return s.sender.update(version, named), None
        except BaseException as exc:  # noqa: BLE001 - reported
            return None, exc

    (report, send_error), errors = s._threads([lambda i=i: recv(i) for i in range(len(s.receivers))], send)
    return report, send_error, errors


def one(mode: str, named, keeps: list, repeats: int) -> dict:
    from tests.test_transfer_broadcast import Session

    s = Session(mode, n_receivers=len(keeps), bucket_bytes=64 << 20, keeps=keeps, timeout_s=120.0)
    try:
        seconds = []
        for version in range(1, repeats + 2):
            start = time.perf_counter()
            _, send_error, errors = run_update(s, version, scaled(named, version))
            if send_error is not None or any(errors):
                raise RuntimeError(f"{mode}: {send_error or errors}")
            if version > 1:  # the first update learns destinations (p2p) or is a keyframe (disk-delta)
                seconds.append(time.perf_counter() - start)
        per_worker = [r.staging_bytes if mode == "disk-delta" else r.received_bytes for r in s.receivers]
        return {"seconds": round(statistics.median(seconds), 4), "bytes_per_worker": per_worker}
    finally:
        s.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=["p2p", "broadcast", "broadcast_packed", "disk-delta"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from rlplacement.transfer import shards

    config = model_config(args.hidden, args.layers)
    named = tensors(config)
    total = sum(t.numel() * t.element_size() for _, t in named)
    rows = []
    print(f"model: {total / 1e6:.1f} MB bf16, {len(named)} tensors, hidden {args.hidden}, {args.layers} layers")
    for mode in args.modes:
        for tp in args.tp:
            keeps = [shards.keeps_for_worker(config, w, tp) for w in range(tp)]
            whole = one(mode, named, [None] * tp, args.repeats)
            sliced = one(mode, named, keeps, args.repeats)
            row = {"mode": mode, "tp": tp, "model_bytes": total, "whole": whole, "slices": sliced,
                   "seconds_ratio": round(sliced["seconds"] / whole["seconds"], 3),
                   "max_worker_bytes_ratio": round(max(sliced["bytes_per_worker"]) / max(whole["bytes_per_worker"]), 3)}
            rows.append(row)
            print(f"{mode:10s} TP={tp}: whole {whole['seconds']:.3f} s, {max(whole['bytes_per_worker']) / 1e6:.1f} MB "
                  f"per worker; slices {sliced['seconds']:.3f} s, {max(sliced['bytes_per_worker']) / 1e6:.1f} MB per "
                  f"worker; ratio time {row['seconds_ratio']}, bytes {row['max_worker_bytes_ratio']}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"what": "each worker taking its slices against whole tensors, same run",
                       "command": "python benchmarks/bench_slices.py " + " ".join(sys.argv[1:]), "commit": commit,
                       "machine": f"{os.cpu_count()} cores, receivers as threads, loopback TCP", "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
