"""Training during rollout on one H200, colocated with the trainer and the engine both resident, beside the
synchronous loop on the same samples in the same run: step time, the trainer's idle, the tail's tokens/s with
training beside it, and the advisor's prediction with and without the contention term it reads off the pair.
``--modes ... fully_async`` adds fully async on the same GPU (the single-GPU form of the split layout).

The example loop runs on a random-weight Qwen3 shape (``common.SIZES``) with ``--long-tail`` lengths (each
request's ``max_tokens`` drawn from a Pareto tail, by default p99/p50 about 7 as published RL workloads show,
generated exactly that long; each step's longest at ``--max-response-len``), so both runs decode the same tokens: the tail's tokens/s is that longest
response's length over the step's rollout time.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/train_during_rollout_h200.py --size 0.5B --out $OUT   # -> train_during_rollout_h200_0.5B.json (h100 on an H100)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

sys.path.insert(0, str(common.REPO))
from benchmarks import async_modes  # noqa: E402

# the engine's share leaves the trainer's weights, AdamW state and activations room beside it on the one GPU
COLOCATED_RESIDENT = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
                      "--no-offload-train", "--no-offload-rollout", "--vllm-gpu-memory-utilization", "0.5"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5B", choices=sorted(common.SIZES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-response-len", type=int, default=1024)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--long-tail-alpha", type=float, default=2.0,
                        help="the lengths' Pareto exponent: p99/p50 about 7 at 2, as published RL workloads")
    parser.add_argument("--long-tail-min", type=int, default=None, help="shortest response (default: max / 10)")
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--modes", nargs="+", default=["sync", "train_during_rollout"],
                        choices=["sync", "train_during_rollout", "fully_async"])
    parser.add_argument("extra", nargs="*", help="more flags for both runs of the loop (after --)")
    args = parser.parse_args()
    modes = ["sync", "train_during_rollout", *[m for m in args.modes if m not in ("sync", "train_during_rollout")]]
    from rlplacement.advisor import asynchrony
    from rlplacement.telemetry.jsonl import read_rows

    work = Path(tempfile.mkdtemp(prefix="tdr_h200_"))
    model = common.make_model(work, args.size, "bfloat16", max_position_embeddings=args.max_response_len + 64)
    runs = work / "runs"
    tail = ["--long-tail-alpha", str(args.long_tail_alpha),
            "--long-tail-min", str(args.long_tail_min or args.max_response_len // 10)]
    extra = [*COLOCATED_RESIDENT, *tail, "--hf-checkpoint", str(model), *args.extra]
    async_modes.run_modes(runs, modes, args.steps, args.max_response_len, args.prompts_per_step, extra)
    report = async_modes.report_modes(runs, modes, "python3 benchmarks/gpu/train_during_rollout_h200.py", sys.argv[1:])
    rows = {name: read_rows(runs / f"{name}.jsonl") for name in modes}

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name][2:])

    for name in ("sync", "train_during_rollout"):  # the same samples, so the same straggler: its rate compares
        rollout = median(name, "perf/rollout_time")
        report["modes"][name].update(
            rollout_time=rollout, train_time=median(name, "perf/train_time"),
            tail_tokens_per_s=args.max_response_len / rollout,
            response_length_p50=statistics.median(n for r in rows[name][2:] for n in r["rollout/response_lengths"]),
            response_length_p99=statistics.quantiles([n for r in rows[name][2:] for n in r["rollout/response_lengths"]],
                                                     n=100)[98])
    report["modes"]["train_during_rollout"]["train_overlap_time"] = median("train_during_rollout",
                                                                           "perf/train_overlap_time")
    slowdown = asynchrony.measured_overlap_slowdown(rows["sync"], rows["train_during_rollout"])
    x = asynchrony.inputs_from_rows(rows["sync"])
    other = asynchrony.measured(rows["sync"])["step_time"] - asynchrony.predict(x, "sync").step_time
    with_term = asynchrony.predict(x, "train-during-rollout", overlap_slowdown=slowdown).step_time + other
    measured = report["modes"]["train_during_rollout"]["measured"]["step_time"]
    report.update(size=args.size, gpus=common.gpu_names()[:1], versions=common.versions(),
                  overlap_slowdown=slowdown, predicted_step_with_overlap_slowdown=with_term,
                  predicted_over_measured_with_overlap_slowdown=with_term / measured,
                  step_ratio_flag_over_sync=measured / report["modes"]["sync"]["measured"]["step_time"],
                  tail_tokens_per_s_ratio=(report["modes"]["train_during_rollout"]["tail_tokens_per_s"]
                                           / report["modes"]["sync"]["tail_tokens_per_s"]))
    print(f"overlap slowdown {slowdown:.3f}; predicted step with it {with_term:.3f} s "
          f"({with_term / measured:.2f} of measured {measured:.3f} s)")
    common.write(args.out, f"train_during_rollout_{common.card_tag()}_{args.size}.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
