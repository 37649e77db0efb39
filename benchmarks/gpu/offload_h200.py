"""Colocated memory hand-off on one GPU against the host link's limit: an FSDP trainer with AdamW and a
vLLM engine on GPU 0 under ``--colocate``, a model that does not fit twice (Qwen3-8B shape, random
bf16 weights: trainer weights + gradients + AdamW moments ~66 GB, engine weights + KV cache at
``--gpu-memory-utilization``), run as the loop runs it: generate -> train -> update, each update
checked bit for bit (``--check-weight-update-equal``).

In the same process, first: the pinned rate of the host link (``host_link.host_link_gbps``), the
ceiling. Then the job, with ``--offload-train --offload-rollout`` given (``--flags explicit``: the
trainer's whole state crosses PCIe each way every step) or left unset (``--flags auto``: a side moves
only when the other would not fit beside it). Before the steps, the refill check: greedy tokens
and log-probs of the fresh engine, then a level-2 sleep, the trainer's weights sent back unchanged,
and the same greedy generation, which must be equal.

Results contract (``offload_h200.json``; ``offload_h200_<size>.json`` for another ``--size``, e.g. the
mixture-of-experts ``30B-A3B-L4``; ``offload_h200_4B_fp32.json`` with ``--size 4B --master-fp32``):
``host_link_gbps`` {d2h, h2d, both}; ``steps``: rows with ``handoff_to_rollout_s``,
``handoff_to_train_s``, ``handoff_bytes_to_host``, ``handoff_bytes_to_device``,
``engine_weight_bytes_over_pcie`` and every ``perf/handoff_*`` part; ``steady_handoff_s`` (median over
steps >= 2 of both directions), ``bound_s`` = 1.15 x (steady bytes to host / d2h + to device / h2d)
+ 0.2 s, ``setup_s`` (the pinned host buffer made at start). With ``--no-overlap-steps N``, N more
steps with each side moving after the other (rows with ``overlap`` false, left out of the steady
figures) and ``steady_handoff_no_overlap_s``: what the overlaps save, measured in the same job.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/offload_h200.py --size 8B --steps 5 --out $OUT   # -> offload_h200.json
    python3 benchmarks/gpu/offload_h200.py --size smoke --steps 2            # the same code on CPU (no hand-off)

With ``--lora-ranks 0 32`` the same job runs once per rank, in the same process (``offload_h200_<size>_lora.json``):
rank 0 is full fine-tuning, the baseline; rank N trains rank-N adapters on every decoder linear layer with the
base frozen and sends adapter-only updates into the engine's live adapter. Each run's rows give the update's
seconds and bytes (``update_s``, ``bytes``) and the hand-off's, so the adapter update stands beside the full one.

    python3 benchmarks/gpu/offload_h200.py --size 4B --steps 5 --lora-ranks 0 32 --out $OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def job_config(flags: str, lora_rank: int = 0):
    from rlplacement.args import build_parser, config_from_args

    argv = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
            "--check-weight-update-equal"] + (["--lora-rank", str(lora_rank)] if lora_rank else [])
    argv += {"explicit": ["--offload-train", "--offload-rollout"], "auto": [],
             "off": ["--no-offload-train", "--no-offload-rollout"]}[flags]
    return config_from_args(build_parser().parse_args(argv))


def _greedy(job, prompts: list[list[int]]) -> list[dict]:
    samples = job.generate(prompts, {"temperature": 0.0}, max_tokens=32, n_samples_per_prompt=1)
    return [{"token_ids": [int(t) for t in s.token_ids], "logprobs": [float(x) for x in s.logprobs]} for s in samples]


def refill_check(job, prompts: list[list[int]]) -> dict:
    """Greedy generation and the served parameters' and buffers' checksums of the fresh engine (twice:
    whether greedy decoding of these random weights repeats at all), then the hand-off to training (a
    level-2 sleep discards the weights), the trainer's unchanged weights sent back, and both again."""
    import ray

    job.prepare_rollout()
    fresh = [_greedy(job, prompts), _greedy(job, prompts)]
    before = ray.get(job.engines[0].model_checksums.remote())
    job.prepare_train()
    job.prepare_update()
    job.update_weights()
    job.prepare_rollout()
    refilled = _greedy(job, prompts)
    after = ray.get(job.engines[0].model_checksums.remote())
    metrics = job.pop_handoff_metrics()
    return {"generation_equal": refilled == fresh[0], "tokens_equal": [r["token_ids"] for r in refilled] == [
                r["token_ids"] for r in fresh[0]],
            "fresh_repeats_itself": fresh[0] == fresh[1],
            "served_tensors_equal": before == after, "served_tensors": len(before),
            "served_tensors_differing": sorted(n for n in before if after.get(n) != before[n])[:20],
            "version": job.version, "setup_s": metrics.get("perf/handoff_setup_time")}


def run(model_dir: Path, args, flags: str, lora_rank: int = 0) -> dict:
    import torch

    from rlplacement import OptimConfig, RLJob

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    engine_kwargs = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512}
    master = torch.float32 if args.master_fp32 else dtype  # fp32: --bf16 mixed precision, bf16 served
    if cuda:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    vocab = 8192 if args.size != "smoke" else 300
    out: dict = {"flags": flags, "lora_rank": lora_rank, "steps": []}
    t0 = time.time()
    job = None
    try:
        job = RLJob.start(job_config(flags, lora_rank), str(model_dir), optim=OptimConfig(name="adamw", lr=1e-4),
                          engine_kwargs=engine_kwargs, backend_options={"dtype": master})
        out["startup_s"] = round(time.time() - t0, 1)
        prompts = [[(7 * i + j) % vocab for j in range(16)] for i in range(args.prompts)]
        out["refill"] = refill_check(job, prompts[:8])
        print(f"[{flags}] refill check: {out['refill']}", flush=True)
        for step in range(args.steps + args.no_overlap_steps):
            if step == args.steps and job.handoff is not None:  # each side's move after the other's
                job.handoff.overlap = False
            times = {}
            s0 = time.perf_counter()
            job.prepare_rollout()
            times["handoff_to_rollout_call_s"] = time.perf_counter() - s0
            g0 = time.perf_counter()
            samples = job.generate(prompts, {"temperature": 1.0}, max_tokens=args.max_tokens, seed=step)
            times["rollout_s"] = time.perf_counter() - g0
            job.prepare_train()
            t1 = time.perf_counter()
            metrics = job.train(common.random_batch(vocab, batch=4, length=args.train_len))
            times["train_s"] = time.perf_counter() - t1
            job.prepare_update()
            u0 = time.perf_counter()
            report = job.update_weights()  # checked: raises naming the tensor on any mismatch
            times["update_s"] = time.perf_counter() - u0
            perf = job.pop_handoff_metrics()
            row = {"step": step, "overlap": step < args.steps, **times, "loss": metrics[0].loss, "tokens": sum(len(s.token_ids) for s in samples),
                   "bytes": report.trainer.bytes, "version": job.version, "bit_exact": True,
                   "handoff_to_rollout_s": perf.get("perf/handoff_to_rollout_time", 0.0),
                   "handoff_to_train_s": perf.get("perf/handoff_to_train_time", 0.0),
                   "handoff_bytes_to_host": perf.get("perf/handoff_bytes_to_host", 0.0),
                   "handoff_bytes_to_device": perf.get("perf/handoff_bytes_to_device", 0.0),
                   "engine_weight_bytes_over_pcie": perf.get("perf/handoff_engine_weight_bytes", 0.0), **perf}
            out["steps"].append(row)
            print(f"[{flags}] step {step}: " + " ".join(
                f"{k.removeprefix('perf/')}={v:.3g}" for k, v in row.items() if isinstance(v, float)), flush=True)
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the run without the hand-off is expected to fail; record how
        out["ok"] = False
        out["error_type"] = type(exc).__name__
        out["error"] = str(exc)[:3000]
        print(f"[{flags}] failed: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
    finally:
        if job is not None:
            job.close()
    return out


def summarize(run_result: dict, link: dict | None) -> None:
    """``steady_handoff_s``, ``bound_s`` and the first steps against the steady one, into ``run_result``."""
    steps = [r for r in run_result["steps"] if r.get("overlap", True)]
    apart = [r["handoff_to_rollout_s"] + r["handoff_to_train_s"] for r in run_result["steps"] if not r.get("overlap", True)]
    if apart:
        import statistics

        run_result["steady_handoff_no_overlap_s"] = round(statistics.median(apart), 4)
    both = [r["handoff_to_rollout_s"] + r["handoff_to_train_s"] for r in steps]
    steady = [b for r, b in zip(steps, both) if r["step"] >= 2]
    if not steady:
        return
    import statistics

    run_result["steady_handoff_s"] = round(statistics.median(steady), 4)
    if run_result["steady_handoff_s"] > 0:
        run_result["first_steps_over_steady"] = [round(b / run_result["steady_handoff_s"], 3) for b in both[:2]]
    if link:
        to_host = statistics.median(r["handoff_bytes_to_host"] for r in steps if r["step"] >= 2)
        to_device = statistics.median(r["handoff_bytes_to_device"] for r in steps if r["step"] >= 2)
        run_result["bound_s"] = round(1.15 * (to_host / (link["d2h"] * 1e9) + to_device / (link["h2d"] * 1e9))
                                      + 0.2, 4)
        run_result["steady_over_bound"] = round(run_result["steady_handoff_s"] / run_result["bound_s"], 3)
    run_result["setup_s"] = (run_result.get("refill") or {}).get("setup_s")


def growth(steps: list[dict], key: str) -> float | None:
    """GiB the reading ``key`` grew from the second step to the last (the first allocates AdamW's state)."""
    values = [s[key] for s in steps[1:] if key in s]
    return round(values[-1] - values[0], 3) if len(values) >= 2 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8B", choices=sorted(common.SIZES))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--train-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    parser.add_argument("--flags", nargs="+", default=["explicit"], choices=["explicit", "auto", "off"],
                        help="runs, in order: the offload flags given (explicit), left unset (auto), or both off "
                             "(off: expected to fail with the error naming the flags)")
    parser.add_argument("--no-overlap-steps", type=int, default=0,
                        help="steps after --steps with the overlaps off (each side moves after the other): rows with "
                             "overlap false, and steady_handoff_no_overlap_s")
    parser.add_argument("--master-fp32", action="store_true",
                        help="fp32 master weights and AdamW state with bf16 compute (mixed precision), bf16 served "
                             "(-> offload_h200_<size>_fp32.json)")
    parser.add_argument("--lora-ranks", type=int, nargs="+", default=[0],
                        help="one run per rank, after the --flags runs' first flags: 0 full fine-tuning, N rank-N LoRA "
                             "adapters with adapter-only updates (-> offload_h200_<size>_lora.json)")
    parser.add_argument("--commit", default=None, help="the checkout's commit, recorded with the results")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    import tempfile

    import ray
    import torch

    if torch.cuda.is_available():
        os.environ.update(common.NVLS_OFF)
        common.export_path()
    root = Path(tempfile.mkdtemp(prefix="offload_h200_"))
    model_dir = common.make_model(root, args.size, "bfloat16" if torch.cuda.is_available() else "float32")
    results: dict = {"command": " ".join(["python3", *sys.argv]), "commit": args.commit,
                     "gpus": common.gpu_names()[:1], "versions": common.versions(), "size": args.size,
                     "master_fp32": args.master_fp32, "runs": []}
    if torch.cuda.is_available():
        from host_link import host_link_gbps

        results["host_link_gbps"] = host_link_gbps(8 << 30)
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()  # the measurement's pinned buffers go back before the job starts
        print(f"host link: {results['host_link_gbps']}", flush=True)
    lora = args.lora_ranks != [0]
    name = (f"offload_h200_{args.size}_lora.json" if lora else f"offload_h200_{args.size}_fp32.json" if args.master_fp32
            else "offload_h200.json" if args.size == "8B" else f"offload_h200_{args.size}.json")
    runs = [(flags, 0) for flags in args.flags] if not lora else [(args.flags[0], rank) for rank in args.lora_ranks]
    try:
        for flags, rank in runs:
            run_result = run(model_dir, args, flags, rank)
            summarize(run_result, results.get("host_link_gbps"))
            for key in ("perf/gpu_used_gb_in_train", "perf/gpu_used_gb_in_rollout",
                        "perf/trainer_gpu_peak_gb_in_train", "perf/rollout_gpu_resident_gb_in_train"):
                run_result[f"growth_{key.removeprefix('perf/')}"] = growth(run_result["steps"], key)
            results["runs"].append(run_result)
            if (flags, rank) == runs[0]:  # the contract's top-level keys: the first run's
                results.update({k: run_result.get(k) for k in ("steps", "steady_handoff_s", "bound_s", "setup_s")})
            common.write(args.out, name, results)
            if ray.is_initialized():
                ray.shutdown()
    finally:
        common.write(args.out, name, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
