"""What assembling pieces costs an engine worker on one GPU (``rlplacement.transfer.pieces.PieceAssembler``): a
Qwen3-8B shape's tensors in bf16, cut into the dim-0 rows of 2 and 8 trainer ranks (FSDP2's ``Shard(0)``), fed
to the assembler of a worker taking every tensor whole (a 1-wide engine) and of worker 0 of a 2-wide engine
(its slices: each piece's part of them, as its channels hand them over); against the ceiling measured in the
same run, one device-to-device copy of the same bytes. Full staging (the assembled buffers kept between
updates) and bucket staging (each let go once handed on); each with its device copies batched per feed and, the
baseline, one copy per piece. The pieces are fed as a worker's channels hand them
over, one sender's bucket at a time (``--update-weight-buffer-size`` shared among the senders,
``multi_sender.sender_bucket_size``). Wall time per update after a warm-up, with a synchronize, median.

    python3 benchmarks/gpu/assemble_pieces.py --out $OUT --commit $(git rev-parse --short HEAD)
    # -> assemble_pieces_h100.json or _h200.json, by the card it ran on
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def arrived(named, ranks: int, keeps: dict | None):
    """What a worker's channels hand over from ``ranks`` senders' rows: each piece, or its part of the worker's
    slice (a tensor of the whole piece's shape over the part's bytes)."""
    from rlplacement.transfer import shards
    from rlplacement.transfer.pieces import kept_part, parse_piece, row_pieces
    from rlplacement.transfer.slice_tensor import as_whole

    out = []
    for name, t in named:
        for _, key, rows in row_pieces(name, t, ranks):
            if keeps and name in keeps:
                part = kept_part(parse_piece(key)[1], keeps[name])
                out.append((key, as_whole(shards.cut(rows, part).contiguous(), part, tuple(rows.shape), key)))
            else:
                out.append((key, rows))
    return out


def buckets_of(pieces, nbytes: int) -> list[list]:
    """``pieces`` cut into feeds of at most ``nbytes`` each (a larger piece alone)."""
    from rlplacement.transfer.slice_tensor import slice_of

    out, size = [[]], 0
    for pair in pieces:
        n = slice_of(pair[1]).numel() * pair[1].element_size()
        if out[-1] and size + n > nbytes:
            out.append([])
            size = 0
        out[-1].append(pair)
        size += n
    return out


def timed(fn, repeats: int) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for i in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="8B")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-size", type=int, default=512 << 20, help="--update-weight-buffer-size")
    parser.add_argument("--out", default="benchmarks/gpu/results")
    parser.add_argument("--commit", default=os.environ.get("COMMIT", ""))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    args = parser.parse_args()

    import torch

    from rlplacement.transfer import shards
    from rlplacement.transfer.multi_sender import sender_bucket_size
    from rlplacement.transfer.pieces import PieceAssembler
    from rlplacement.transfer.plan.tensors import ModelTensors
    from rlplacement.transfer.slice_tensor import slice_of

    config = {"head_dim": 128, **common.SIZES[args.size], "model_type": "qwen3", "torch_dtype": "bfloat16",
              "hidden_act": "silu"}
    model = ModelTensors.from_hf_config(config)
    g = torch.Generator(device=args.device).manual_seed(0)
    named = [(t.name, torch.randn(t.shape, generator=g, device=args.device).to(torch.bfloat16))
             for t in model.tensors]
    rows = []
    for width, keeps in ((1, None), (2, shards.keeps_of(model, 0, 2))):
        share = sum(shards.busiest_share({n: t.numel() * 2 for n, t in named}, [keeps or {}], 2).values())
        flat_src = torch.empty(share, dtype=torch.uint8, device=args.device)
        flat_dst = torch.empty_like(flat_src)
        ceiling = timed(lambda: flat_dst.copy_(flat_src), args.repeats)
        del flat_src, flat_dst
        for ranks in args.ranks:
            pieces = arrived(named, ranks, keeps)
            feeds = buckets_of(pieces, sender_bucket_size(args.buffer_size, ranks))
            for staging, keep, batch in (("full", True, True), ("bucket", False, True), ("full", True, False),
                                         ("bucket", False, False)):
                assembler = PieceAssembler(keeps, keep_buffers=keep, batch_copies=batch)

                def update():
                    assembler.begin(None)
                    assembled = [pair for feed in feeds for pair in assembler.feed(feed)]
                    assembler.finish()
                    return assembled

                got = dict(update())
                seconds = timed(update, args.repeats)
                exact = all(torch.equal(shards.cut(t, keeps.get(n) if keeps else None), slice_of(got[n]))
                            for n, t in named)
                rows.append({"engine_width": width, "trainer_ranks": ranks, "staging": staging,
                             "device_copies": "one _foreach_copy_ per feed" if batch else "one copy_ per piece",
                             "share_bytes": share, "pieces": len(pieces), "feeds": len(feeds), "seconds": round(seconds, 5),
                             "ceiling_seconds": round(ceiling, 5), "ratio_to_ceiling": round(seconds / ceiling, 2),
                             "gb_per_s": round(share / seconds / 1e9, 1), "bit_exact": exact})
                print(json.dumps(rows[-1]), flush=True)
                del assembler, got
            del pieces, feeds
            if args.device == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    card = next((c for c in ("h100", "h200") if c in device.lower()), "cpu" if device == "cpu" else "gpu")
    out = Path(args.out) / f"assemble_pieces_{card}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"what": __doc__.split("\n\n")[0], "command": "python3 " + " ".join(sys.argv),
                               "commit": args.commit, "device": device, "buffer_size": args.buffer_size,
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
