"""The transfer simulator against every update measured on GPUs: predicted / measured seconds per row.

Rows: ``benchmarks/gpu/results/split_h200.json`` (one trainer GPU broadcasting to a one-GPU engine on
the same node, broadcast and broadcast_packed, 0.5B-8B) and ``colocate_h200.json`` (CUDA IPC on one
GPU, 4B and 8B). The simulator builds the rank-0 plan those runs executed from each size's shape
(``benchmarks/gpu/common.SIZES``) at the advisor's default rates and prints the ratio; |ratio - 1| <= 0.15
is the goal, and a row outside it names the term that is off.

    python benchmarks/simulate_transfer_check.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

from common import SIZES  # noqa: E402

from rlplacement.advisor.thresholds import ModelAssumptions  # noqa: E402
from rlplacement.placement.layout import Layout  # noqa: E402
from rlplacement.transfer.plan.for_layout import plans_for  # noqa: E402
from rlplacement.transfer.plan.tensors import ModelTensors  # noqa: E402

RESULTS = ROOT / "benchmarks" / "gpu" / "results"


def model_of(size: str) -> ModelTensors:
    return ModelTensors.from_hf_config({"model_type": "qwen3", "head_dim": 128, "torch_dtype": "bfloat16",
                                        "hidden_act": "silu", **SIZES[size]}, source=f"the {size} shape")


def rows() -> list[dict]:
    out = []
    split = Layout(False, ((0, 0),), (((0, 1),),), 8)
    colocate = Layout(True, ((0, 0),), (((0, 0),),), 8)
    for file, layout, modes in (("split_h200.json", split, ("broadcast", "broadcast_packed")),
                                ("colocate_h200.json", colocate, ("cuda_ipc",))):
        data = json.loads((RESULTS / file).read_text())
        for row in data["sizes"]:
            model = model_of(row["size"])
            assert model.total_bytes == row["bytes"], (row["size"], model.total_bytes, row["bytes"])
            for mode in modes:
                pair = plans_for(model, layout, backend="fsdp", tp=1, pp=1, mode=mode, assumptions=ModelAssumptions())
                sim = pair.rank0_sim
                measured = row[mode]["whole_seconds"]
                out.append({"file": file, "commit": data.get("commit"), "size": row["size"], "mode": mode,
                            "bytes": row["bytes"], "measured_s": measured, "predicted_s": sim.total_s,
                            "ratio": sim.total_s / measured, "wire_predicted_s": sim.wire_s,
                            "wire_measured_s": row[mode].get("wire_seconds"),
                            "commit_predicted_s": sim.commit_s, "commit_measured_s": row[mode].get("load_seconds")})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    table = rows()
    print(f"{'file':<20}{'size':>6} {'mode':<18}{'measured s':>11}{'predicted s':>12}{'ratio':>7}"
          f"{'wire meas':>10}{'wire pred':>10}")
    for r in table:
        print(f"{r['file']:<20}{r['size']:>6} {r['mode']:<18}{r['measured_s']:>11.4f}{r['predicted_s']:>12.4f}"
              f"{r['ratio']:>7.2f}{r['wire_measured_s'] or 0:>10.4f}{r['wire_predicted_s']:>10.4f}")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "code": commit, "rows": table},
                                              indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
