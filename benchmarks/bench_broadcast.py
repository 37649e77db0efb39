"""broadcast vs broadcast_packed vs the raw flat-buffer broadcast of the same bytes (the ceiling),
on this machine's transport (NCCL GPU 0 -> GPU 1 where there are two GPUs, else gloo over
loopback TCP; each row names it), for a Qwen3-shaped model of a few hundred MB with >= 300 tensors.

    python benchmarks/bench_broadcast.py [--size-mb 400] [--num-tensors 311] [--bucket-mb 64]
                                         [--repeats 3] [--small]

Prints GB/s per mode, each mode's ratio to the ceiling, and the packed / per-tensor speedup.
Goals from issue 3: packed >= 85% of the ceiling and >= 5x per-tensor broadcast. ``--small``
adds a run with many small tensors (where per-tensor overhead, not bandwidth, decides).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlplacement.bench import run  # noqa: E402


def report(title: str, rows: list[dict]) -> dict:
    by_mode = {r["mode"]: r for r in rows}
    per_tensor, packed = by_mode["broadcast"], by_mode["broadcast_packed"]
    print(f"== {title}: {packed['bytes'] / 1e6:.0f} MB in {packed['num_tensors']} tensors, "
          f"bucket {packed['buffer_size'] / 1e6:.0f} MB, over {packed['transport']}")
    print(f"   ceiling (one flat broadcast): {packed['ceiling_gbps']:.3f} GB/s")
    for r in rows:
        print(f"   {r['mode']:>17}: {r['seconds']:.3f} s  {r['gbps']:.3f} GB/s  ratio {r['ratio']:.2f}")
    speedup = per_tensor["seconds"] / packed["seconds"]
    print(f"   packed / per-tensor speedup: {speedup:.2f}x   (goals: ratio >= 0.85, speedup >= 5x)")
    return {"title": title, "rows": rows, "speedup": speedup}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=float, default=400.0)
    p.add_argument("--num-tensors", type=int, default=311)
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--small", action="store_true", help="also run a model of ~3000 smaller tensors")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: NCCL GPU 0 -> GPU 1 where there are two GPUs, else cpu (gloo)")
    p.add_argument("--json", type=str, default=None, help="also write the results to this file")
    args = p.parse_args()
    out = [report("Qwen3-shaped", run(["broadcast", "broadcast_packed"], size_mb=args.size_mb,
                                      num_tensors=args.num_tensors, bucket_bytes=int(args.bucket_mb * 1e6),
                                      repeats=args.repeats, device=args.device))]
    if args.small:
        out.append(report("many small tensors", run(["broadcast", "broadcast_packed"], size_mb=40,
                                                    num_tensors=3000, bucket_bytes=int(args.bucket_mb * 1e6),
                                                    repeats=args.repeats, device=args.device)))
    load = os.getloadavg()[0]
    print(f"(load average during the run: {load:.1f} on {os.cpu_count()} cores)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": out, "load_average": load}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
