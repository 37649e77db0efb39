"""Trainer ranks sending their own rows of every tensor (``rlplacement.transfer.pieces``, what an FSDP trainer
runs) against each rank sending a share of whole tensors (what it ran before, and what Megatron and
torchtitan run), in the same run: 2 and 4 senders, the workers of one TP=2 engine keeping their slices,
p2p (Mooncake over loopback TCP), broadcast, broadcast_packed (gloo over loopback) and disk-delta, a
Qwen3-shaped bf16 model. Senders and receivers are threads of one process.

    python benchmarks/bench_pieces.py [--hidden 1024] [--layers 16] [--senders 2 4] [--repeats 3] [--json FILE]

Per mode and number of senders it prints, for whole-tensor shares and for pieces: seconds per update (median
of the timed updates after one warm-up: every sender done, every worker staged, assembled and committed, the
commit copying what vLLM's loader copies), the busiest sender's bytes against the mean, and the bytes a
trainer rank would gather from the others first: the shares' senders hold whole tensors here, so their
times leave out the gather an FSDP trainer pays for them (``dist.gather`` onto the owner), which pieces do
not need. On 2 cores the threads share the cores, so times say what the bytes cost here, not on a NIC.
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

from benchmarks.bench_slices import load_like_vllm, model_config, scaled, tensors  # noqa: E402


def whole_shares(named, num_senders: int):
    from rlplacement.transfer.bucket import fused_group_of
    from rlplacement.transfer.plan.senders import spread_owners_by_group

    owners = spread_owners_by_group([(n, t.numel() * t.element_size()) for n, t in named], num_senders,
                                    fused_group_of)
    return [[(n, t) for n, t in named if owners[n] == s] for s in range(num_senders)]


def row_pieces(named, num_senders: int):
    """Each sender's ``torch.chunk`` rows of every tensor (FSDP2's ``Shard(0)``), under piece names."""
    from rlplacement.transfer.pieces import row_pieces as rows_of

    shares = [[] for _ in range(num_senders)]
    for name, t in named:
        for s, key, rows in rows_of(name, t, num_senders):
            shares[s].append((key, rows))
    return shares


def gathered_bytes(named, shares, num_senders: int) -> int:
    """What the busiest rank gathers from the others before sending whole tensors: of each tensor it sends, the
    rows the other ranks hold (every rank holds 1/``num_senders`` of every tensor)."""
    sizes = {n: t.numel() * t.element_size() for n, t in named}
    return max(sum(sizes[n] - sizes[n] // num_senders for n, _ in share) for share in shares)


def one(mode: str, named, split, num_senders: int, keeps: list, repeats: int, disk_dir: str) -> dict:
    from tests.test_transfer_multi_sender import Senders, _run_threads

    options = (lambda i: {"disk_dir": os.path.join(disk_dir, f"{split.__name__}{num_senders}"), "sender_index": i}) \
        if mode == "disk-delta" else (lambda i: {})
    s = Senders(mode, num_senders=num_senders, n_receivers=len(keeps), bucket_bytes=64 << 20, options=options,
                keeps=lambda i: keeps[i])
    try:
        seconds, sent = [], None
        for version in range(1, repeats + 2):
            shares = split(scaled(named, version), num_senders)

            def recv(i):
                r = s.receivers[i]
                r.begin(version)
                r.receive()
                r.commit(lambda staged: load_like_vllm(r, staged))

            start = time.perf_counter()
            results, errors = _run_threads([lambda x=x, share=share: x.update(version, share)
                                            for x, share in zip(s.senders, shares)] +
                                           [lambda i=i: recv(i) for i in range(len(s.receivers))])
            if any(errors):
                raise RuntimeError(f"{mode}: {errors}")
            if version > 1:  # the first update learns destinations (p2p) or is a keyframe (disk-delta)
                seconds.append(time.perf_counter() - start)
            sent = [r.bytes for r in results[:num_senders]]
        return {"seconds": round(statistics.median(seconds), 4), "bytes_per_sender": sent,
                "max_over_mean_sender": round(max(sent) / (sum(sent) / len(sent)), 3),
                "bytes_per_worker": [r.staging_bytes if mode == "disk-delta" else r.received_bytes
                                     for r in s.receivers],
                "gathered_first_bytes": gathered_bytes(named, shares, num_senders) if split is whole_shares else 0}
    finally:
        s.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--senders", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["p2p", "broadcast", "broadcast_packed", "disk-delta"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import tempfile

    from rlplacement.transfer import shards

    config = model_config(args.hidden, args.layers)
    named = tensors(config)
    total = sum(t.numel() * t.element_size() for _, t in named)
    keeps = [shards.keeps_for_worker(config, w, args.tp) for w in range(args.tp)]
    rows = []
    print(f"model: {total / 1e6:.1f} MB bf16, {len(named)} tensors, hidden {args.hidden}, {args.layers} layers; "
          f"a TP={args.tp} engine")
    with tempfile.TemporaryDirectory() as disk_dir:
        for mode in args.modes:
            for n in args.senders:
                whole = one(mode, named, whole_shares, n, keeps, args.repeats, disk_dir)
                pieces = one(mode, named, row_pieces, n, keeps, args.repeats, disk_dir)
                row = {"mode": mode, "senders": n, "tp": args.tp, "model_bytes": total, "whole_shares": whole,
                       "pieces": pieces, "seconds_ratio": round(pieces["seconds"] / whole["seconds"], 3),
                       "max_sender_bytes_ratio": round(max(pieces["bytes_per_sender"]) /
                                                       max(whole["bytes_per_sender"]), 3)}
                rows.append(row)
                print(f"{mode:16s} {n} senders: whole shares {whole['seconds']:.3f} s, busiest sender "
                      f"{max(whole['bytes_per_sender']) / 1e6:.1f} MB ({whole['max_over_mean_sender']}x the mean), "
                      f"{whole['gathered_first_bytes'] / 1e6:.1f} MB to gather first; pieces {pieces['seconds']:.3f} s, "
                      f"busiest {max(pieces['bytes_per_sender']) / 1e6:.1f} MB ({pieces['max_over_mean_sender']}x); "
                      f"ratio time {row['seconds_ratio']}, busiest sender {row['max_sender_bytes_ratio']}", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"what": "trainer ranks sending their rows (pieces) against shares of whole tensors, same run",
                       "command": "python benchmarks/bench_pieces.py " + " ".join(sys.argv[1:]), "commit": commit,
                       "machine": f"{os.cpu_count()} cores, senders and receivers as threads, loopback TCP",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
