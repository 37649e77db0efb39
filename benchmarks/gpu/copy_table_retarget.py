"""The engine's commit after the trainer's memory moved (every step under --colocate with the hand-off):
the copy plan's chunk table retargeted in place (``FusedCopies.retarget``: the graph and variant kept)
against the table and graph built again (what a move cost before), for a 4B model's bytes cut into as
many copies as FSDP's update makes (398) and as Megatron's (1154: q/k/v copied per query group).

Per case: median seconds of ``plan.replay`` + synchronize right after a move (both sources alternate
between two buffers), and of a replay with nothing moved (the ceiling: the copies alone), same run.

    python3 benchmarks/gpu/copy_table_retarget.py --out $OUT --commit SHA   # -> copy_table_retarget_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

TOTAL_BYTES = 7_308_966_912  # the 4B shape's bf16 update


def case(copies: int, rebuild: bool, repeats: int) -> dict:
    import torch

    from rlplacement.engines import copy_plan

    per = (TOTAL_BYTES // 2 // copies) // 8 * 8  # bf16 elements per copy, 16-byte multiples
    dst = torch.empty(per * copies, dtype=torch.bfloat16, device="cuda")
    sources = [torch.randn(per * copies, device="cuda").bfloat16() for _ in range(2)]
    plan = copy_plan.CopyPlan((("w", "torch.bfloat16", (per * copies,), None),), [
        copy_plan._Copy("w", i * per, (per,), (1,), dst[i * per:(i + 1) * per], dst.untyped_storage().data_ptr())
        for i in range(copies)])
    plan.replay([("w", sources[0])])  # times the variants and captures the graph
    torch.cuda.synchronize()
    moved, still = [], []
    for r in range(repeats):
        plan.forget_staged()  # the receiver let its views go; the next update maps the trainer anew
        if rebuild:
            plan._fused = None  # as before retargeting: the table and graph built again (variant kept)
        staged = [("w", sources[(r + 1) % 2])]
        t0 = time.perf_counter()
        plan.replay(staged)
        torch.cuda.synchronize()
        moved.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        plan.replay(staged)
        torch.cuda.synchronize()
        still.append(time.perf_counter() - t0)
        assert torch.equal(dst, staged[0][1])
    return {"copies": copies, "how": "rebuild" if rebuild else "retarget",
            "after_move_ms": round(statistics.median(moved) * 1e3, 3),
            "unmoved_ms": round(statistics.median(still) * 1e3, 3), "summary": plan.chunk_kernel_summary()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default="benchmarks/gpu/results")
    args = parser.parse_args()
    import torch

    rows = []
    for copies in (398, 1154):
        for rebuild in (True, False):
            rows.append(case(copies, rebuild, args.repeats))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    result = {"command": " ".join(["python3", *sys.argv]), "commit": args.commit,
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "copy_table_retarget_h200.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
