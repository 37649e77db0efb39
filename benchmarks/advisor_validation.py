"""Advisor validation: fit the step-time model on one split, predict the others, measure them all.

    python benchmarks/advisor_validation.py [--steps 5] [--fit 4:4] [--device cpu|cuda] [--out DIR]

Runs ``examples/tiny_grpo.py`` when it exists and ``--loop tiny`` is given; otherwise (default)
the real-computation stub ``benchmarks/stub_loop.py``, whose time scales with the
logical GPU counts as its docstring documents. Layouts: 6:2, 4:4, 2:6 (8 GPUs on one node,
2-GPU engines) and colocated on 8. Prints, per layout, the measured median step time, the
model's prediction fitted from ``--fit`` alone, the error, and whether the advisor's
recommendation is the measured best. Goal: every error within 15%.

What it shows and what it does not: logical GPUs add no compute, so the stub's per-GPU shares
stand for parallel GPUs. The table checks that telemetry, fit and composition (overlap, waits,
sync, tail) predict other layouts of a job whose scaling is known; it does not show that real
engines scale as the model assumes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlplacement.advisor import Placement, candidate_placements, fit, measure, recommend  # noqa: E402
from rlplacement.telemetry import read_rows  # noqa: E402

LAYOUTS = (Placement(False, 6, 2), Placement(False, 4, 4), Placement(False, 2, 6), Placement(True, 8, 8))
TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny_grpo.py"


def run_stub(p: Placement, steps: int, path: Path, device: str) -> list[dict]:
    from benchmarks.stub_loop import StubConfig, run

    kw = {}
    if device == "cuda":  # two GPUs: trainer and rollout each on its own; bigger rows keep kernels busy
        kw = dict(dim=4096, trainer_device="cuda:0", rollout_device="cuda:1", sync_mb=1024)
    return run(StubConfig(p.trainer_gpus, p.rollout_gpus, colocate=p.colocate, steps=steps, **kw), path)


def run_tiny(p: Placement, steps: int, path: Path, gpus_per_engine: int, gpus_per_node: int) -> list[dict]:
    flags = ["--colocate", "--actor-num-gpus-per-node", str(p.trainer_gpus)] if p.colocate else [
        "--actor-num-gpus-per-node", str(p.trainer_gpus), "--rollout-num-gpus", str(p.rollout_gpus)]
    # 12 samples a step split evenly over 1, 2, 3, 4 or 6 data-parallel trainer ranks
    cmd = [sys.executable, str(TINY), *flags, "--rollout-num-gpus-per-engine", str(gpus_per_engine),
           "--num-gpus-per-node", str(gpus_per_node), "--prompts-per-step", "3", "--group-size", "4",
           "--steps", str(steps), "--telemetry", str(path)]
    log = path.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: see {log}")
    return read_rows(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--fit", default=None, help="layout to fit on: T:R or 'colocate' (default: the middle split)")
    ap.add_argument("--loop", choices=("stub", "tiny"), default="stub")
    ap.add_argument("--num-gpus", type=int, default=None,
                    help="tiny loop: total logical GPUs on one node (default 4; the stub uses 8)")
    ap.add_argument("--gpus-per-engine", type=int, default=1, help="tiny loop: GPUs per engine")
    ap.add_argument("--colocate", action="store_true", help="tiny loop: also run colocated")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", default=None, help="folder for the telemetry files (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the table here")
    ap.add_argument("--from", dest="reuse", default=None, metavar="DIR",
                    help="analyse telemetry files a previous run left in DIR instead of running again")
    args = ap.parse_args()
    if args.loop == "tiny" and not TINY.exists():
        print(f"{TINY} does not exist yet: use --loop stub", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="advisor_validation_"))
    out.mkdir(parents=True, exist_ok=True)
    layouts = LAYOUTS
    if args.loop == "tiny":
        total = args.num_gpus or 4
        layouts = tuple(p for p in candidate_placements(total, total, args.gpus_per_engine)
                        if args.colocate or not p.colocate)
    measured = {}
    for p in layouts:
        path = out / f"{'colocate' if p.colocate else f'{p.trainer_gpus}-{p.rollout_gpus}'}.jsonl"
        if args.reuse:
            rows = read_rows(Path(args.reuse) / path.name)
        else:
            path.unlink(missing_ok=True)
            rows = (run_tiny(p, args.steps, path, args.gpus_per_engine, args.num_gpus or 4) if args.loop == "tiny"
                    else run_stub(p, args.steps, path, args.device))
        measured[p] = measure(rows)
        m = measured[p]
        util = {role: [r.get(f"perf/{role}_gpu_util") for r in rows[1:] if r.get(f"perf/{role}_gpu_util") is not None]
                for role in ("trainer", "rollout")}
        util_text = ", ".join(f"{role} GPU util {statistics.median(v):.0f}%" for role, v in util.items() if v)
        print(f"ran {p}: step {m.step_time:.3f} s (rollout {m.rollout_time:.3f}, train {m.train_time:.3f}, "
              f"sync {m.sync_time:.3f}, tail {m.rollout_tail:.3f}) over {m.steps} step(s)"
              f"{'; ' + util_text if util_text else ''}", flush=True)
    splits = [p for p in layouts if not p.colocate]
    args.fit = args.fit or f"{splits[len(splits) // 2].trainer_gpus}:{splits[len(splits) // 2].rollout_gpus}"
    fit_on = next(p for p in layouts if p.colocate) if args.fit == "colocate" else \
        Placement(False, *map(int, args.fit.split(":")))
    if fit_on not in measured:
        raise SystemExit(f"--fit {args.fit} is not one of the layouts run: {[str(p) for p in layouts]}")
    model = fit(measured[fit_on])
    advice = recommend(measured[fit_on])
    best = min(layouts, key=lambda p: measured[p].step_time)
    table = []
    print(f"\nfitted on {fit_on} ({args.loop} loop, {args.device}); predicted vs measured median step time")
    print(f"{'layout':>16} {'measured s':>11} {'predicted s':>12} {'error':>7}  phases measured -> predicted (R / T / S)")
    for p in layouts:
        m, pred = measured[p], model.predict(p)
        err = pred.step_time / m.step_time - 1
        table.append({"layout": str(p), **p.to_json(), "measured": m.step_time, "predicted": pred.step_time,
                      "error": err, "fitted_on": p == fit_on})
        print(f"{str(p):>16} {m.step_time:11.3f} {pred.step_time:12.3f} {err:+7.1%}  "
              f"{m.rollout_time:.2f}/{m.train_time:.2f}/{m.sync_time:.2f} -> "
              f"{pred.rollout_time:.2f}/{pred.train_time:.2f}/{pred.sync_time:.2f}{'  (fit)' if p == fit_on else ''}")
    others = [abs(r["error"]) for r in table if not r["fitted_on"]]
    rec = advice.recommended.placement
    print(f"\nmax |error| on layouts not fitted: {max(others):.1%} (median {statistics.median(others):.1%}); goal 15%")
    verdict = "MATCH" if rec == best else ("MISMATCH" if rec in measured else "not run, so unchecked")
    print(f"recommended: {rec}; measured best: {best} -> {verdict}")
    print(f"advisor: {advice.reason}")
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "recommended": str(rec), "measured_best": str(best),
                                               "loop": args.loop, "device": args.device}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
