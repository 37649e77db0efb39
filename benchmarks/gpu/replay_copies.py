"""How fast the engine's commit can copy a Qwen3 shape's tensors on one GPU, by strategy: one flat
copy of all the bytes (the ceiling), ``_foreach_copy_`` over every pair, one ``copy_`` per pair,
the copy plan's split (pairs of at least ``copy_plan.LARGE_COPY_BYTES`` one by one, the rest in one
``_foreach_copy_``), and the chunk kernel the engine's commit runs (``copy_kernel``: each variant, and
the shipped choice among them, replayed from a CUDA graph). Wall time per replay (launches included, then a
synchronize), median.

    python3 benchmarks/gpu/replay_copies.py --sizes 4B 8B --out $OUT   # -> replay_copies_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def shapes(size: str) -> list[tuple[int, ...]]:
    c = common.SIZES[size]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c.get("head_dim", 128)
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter), (h,), (h,), (hd,), (hd,)]
    out = [(c["vocab_size"], h)] + per_layer * layers + [(h,)]
    return out if c["tie_word_embeddings"] else out + [(c["vocab_size"], h)]


def timed(fn, repeats: int) -> float:
    import torch

    times = []
    for i in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(size: str, repeats: int) -> dict:
    import torch

    from rlplacement.engines import copy_plan

    dsts = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in shapes(size)]
    srcs = [torch.empty_like(d).normal_() for d in dsts]
    nbytes = sum(d.numel() * 2 for d in dsts)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    large = [i for i, d in enumerate(dsts) if d.numel() * 2 >= copy_plan.LARGE_COPY_BYTES]
    small = [i for i in range(len(dsts)) if i not in set(large)]

    def split():
        for i in large:
            dsts[i].copy_(srcs[i])
        torch._foreach_copy_([dsts[i] for i in small], [srcs[i] for i in small])

    def one_by_one():
        for d, s in zip(dsts, srcs):
            d.copy_(s)

    row = {"size": size, "bytes": nbytes, "num_tensors": len(dsts), "large": len(large),
           "flat_copy_s": timed(lambda: flat_dst.copy_(flat_src), repeats),
           "foreach_s": timed(lambda: torch._foreach_copy_(dsts, srcs), repeats),
           "one_by_one_s": timed(one_by_one, repeats), "split_s": timed(split, repeats)}
    keys = ["foreach_s", "one_by_one_s", "split_s"]
    # the chunk kernel (copy_kernel: what the engine's commit runs): each variant on its own, then the
    # shipped one, which times every variant on its first launch, keeps the fastest and replays a CUDA graph
    from rlplacement.engines import copy_kernel

    def check(fused, key):
        for d in dsts:
            d.zero_()
        fused.launch()
        torch.cuda.synchronize()
        row[key.removesuffix("_s") + "_bit_exact"] = all(torch.equal(d, s_) for d, s_ in zip(dsts, srcs))

    for variant in copy_kernel.VARIANTS:
        fused = copy_kernel.FusedCopies(dsts, srcs, variants=(variant,))
        key = f"kernel_{variant.name}_s"
        row[key] = timed(fused.launch, repeats)
        check(fused, key)
        keys.append(key)
    fused = copy_kernel.FusedCopies(dsts, srcs)
    fused.launch()  # chooses and captures
    row["kernel_s"] = timed(fused.launch, repeats)
    check(fused, "kernel_s")
    row["kernel_chosen"], row["kernel_fused"] = fused.summary(), len(fused.fused)
    keys.append("kernel_s")
    for key in keys:
        row[key.removesuffix("_s") + "_ratio"] = round(row["flat_copy_s"] / row[key], 3)
    print({k: (round(v * 1e3, 2) if k.endswith("_s") else v) for k, v in row.items()}, flush=True)
    del dsts, srcs, flat_src, flat_dst
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["4B", "8B"], choices=sorted(common.SIZES))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("replay_copies: needs a CUDA GPU; nothing run")
        return 0
    results = {"command": " ".join(["python3", *sys.argv]), "gpus": common.gpu_names()[:1],
               "versions": common.versions(), "sizes": [run(s, args.repeats) for s in args.sizes]}
    common.write(args.out, "replay_copies_h200.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
