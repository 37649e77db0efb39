"""Sync, one-step-off, training during rollout and fully async on one long-tailed workload, against the advisor's prediction from the
sync run of the same call.

Runs the example loop once per mode on the same flags (``--long-tail``: Pareto response lengths, each step's
longest at ``--max-response-len``), writes each run's telemetry to OUT/{sync,one_step_off,train_during_rollout,fully_async}.jsonl,
then prints per mode: the median step, the trainer's idle per step, staleness (mean, max), and
``rlplacement.advisor.asynchrony``'s prediction from the sync run with the ratio predicted / measured.
Where a GPU is present the loop's engines and trainer run on it (a split layout needs two GPUs); on CPU it
runs on logical GPUs, which share the host's cores.

    python benchmarks/async_modes.py --out benchmarks/results/fully_async_cpu [--steps 12] [-- extra loop flags]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "one_step_off": ["--one-step-off"], "train_during_rollout": ["--train-during-rollout"],
         "fully_async": ["--fully-async", "--partial-rollout", "--max-weight-staleness", "2", "--use-tis"]}
ADVISOR_MODE = {"sync": "sync", "one_step_off": "one-step-off", "train_during_rollout": "train-during-rollout",
                "fully_async": "fully-async"}


def run_modes(out: Path, modes: list[str], steps: int, max_response_len: int, prompts_per_step: int,
              extra: list[str]) -> None:
    """The example loop once per mode of ``modes`` on the same flags, each run's telemetry to OUT/<mode>.jsonl;
    raises with the loop's stderr tail when one fails."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    for name in modes:
        telemetry = out / f"{name}.jsonl"
        telemetry.unlink(missing_ok=True)
        cmd = [sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--rollout-num-gpus", "1", "--long-tail",
               "--max-response-len", str(max_response_len), "--prompts-per-step", str(prompts_per_step),
               "--steps", str(steps), "--telemetry", str(telemetry), *MODES[name], *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{name} loop failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def report_modes(out: Path, modes: list[str], script: str, argv: list[str]) -> dict:
    """Each mode's measured step, idle and staleness beside the advisor's prediction from the sync run (which
    ``modes`` must include), printed and returned with the run's facts."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.run_facts import run_facts
    from rlplacement.advisor import asynchrony
    from rlplacement.telemetry.jsonl import read_rows

    sync_rows = read_rows(out / "sync.jsonl")
    x = asynchrony.inputs_from_rows(sync_rows)
    other = asynchrony.measured(sync_rows)["step_time"] - asynchrony.predict(x, "sync").step_time
    predicted = {p.mode: p for p in asynchrony.predict_modes(x, other=other, max_staleness=2)}
    report = {**run_facts(script, argv), "modes": {}}
    print(f"{'mode':>20} {'step':>7} {'pred':>7} {'ratio':>6} {'idle':>7} {'pred':>7} {'stale mean/max':>15} {'pred':>10}")
    for name in modes:
        m, p = asynchrony.measured(read_rows(out / f"{name}.jsonl")), predicted[ADVISOR_MODE[name]]
        report["modes"][name] = {"measured": m, "predicted": {"step_time": p.step_time,
                                                               "train_wait_time": p.train_wait_time,
                                                               "mean_staleness": p.mean_staleness,
                                                               "max_staleness": p.max_staleness}}
        print(f"{name:>20} {m['step_time']:7.3f} {p.step_time:7.3f} {p.step_time / m['step_time']:6.2f} "
              f"{m['train_wait_time']:7.3f} {p.train_wait_time:7.3f} {m['mean_staleness']:9.2f}/{m['max_staleness']} "
              f"{p.mean_staleness:7.2f}/{p.max_staleness}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-response-len", type=int, default=96)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="which modes to run (sync always runs: the prediction is made from it)")
    parser.add_argument("extra", nargs="*", help="more flags for every run of the loop (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    modes = ["sync", *[m for m in args.modes if m != "sync"]]
    try:
        run_modes(out, modes, args.steps, args.max_response_len, args.prompts_per_step, args.extra)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    report = report_modes(out, modes, "python benchmarks/async_modes.py", sys.argv[1:])
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
