"""Colocated memory hand-off on one GPU (issue: time-sharing for real): an FSDP trainer with AdamW
and a vLLM engine on GPU 0 under ``--colocate``, a model that does not fit twice (Qwen3-8B shape,
random bf16 weights: trainer weights + gradients + AdamW moments ~66 GB, engine weights + KV cache
at ``--gpu-memory-utilization``), run as the loop runs it: generate -> train -> update, each
update checked bit for bit (``--check-weight-update-equal``).

Two runs, same model and steps: with the hand-off (the default under --colocate) it must finish
every step with no memory growth; with ``--no-offload-train --no-offload-rollout`` it must fail
with the error that names the flags. Per step: hand-off seconds each way and GiB per role and
phase (the ``perf/*`` keys of ``runtime/handoff.py``).

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/offload_h200.py --size 8B --steps 5 --out $OUT   # -> offload_h200.json
    python3 benchmarks/gpu/offload_h200.py --size smoke --steps 2            # the same code on CPU (no hand-off)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def job_config(offload: bool):
    from rlplacement.args import build_parser, config_from_args

    flags = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
             "--check-weight-update-equal"]
    return config_from_args(build_parser().parse_args(flags + ([] if offload else ["--no-offload-train",
                                                                                     "--no-offload-rollout"])))


def run(model_dir: Path, args, offload: bool) -> dict:
    import torch

    from rlplacement import OptimConfig, RLJob

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    engine_kwargs = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512}
    master = torch.float32 if args.master_fp32 else dtype  # fp32: --bf16 mixed precision, bf16 served
    if cuda:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    vocab = 8192 if args.size != "smoke" else 300
    out: dict = {"offload": offload, "steps": []}
    t0 = time.time()
    job = None
    try:
        job = RLJob.start(job_config(offload), str(model_dir), optim=OptimConfig(name="adamw", lr=1e-4),
                          engine_kwargs=engine_kwargs, backend_options={"dtype": master})
        out["startup_s"] = round(time.time() - t0, 1)
        prompts = [[(7 * i + j) % vocab for j in range(16)] for i in range(args.prompts)]
        for step in range(args.steps):
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
            row = {"step": step, **times, "loss": metrics[0].loss, "tokens": sum(len(s.token_ids) for s in samples),
                   "bytes": report.trainer.bytes, "version": job.version, "bit_exact": True,
                   **job.pop_handoff_metrics()}
            out["steps"].append(row)
            print(f"[offload={offload}] step {step}: " + " ".join(
                f"{k.removeprefix('perf/')}={v:.3g}" for k, v in row.items() if isinstance(v, float)), flush=True)
        out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - the run without the hand-off is expected to fail; record how
        out["ok"] = False
        out["error_type"] = type(exc).__name__
        out["error"] = str(exc)[:3000]
        print(f"[offload={offload}] failed: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
    finally:
        if job is not None:
            job.close()
    return out


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
    parser.add_argument("--skip-without", action="store_true", help="only the run with the hand-off")
    parser.add_argument("--master-fp32", action="store_true",
                        help="fp32 master weights and AdamW state with bf16 compute (mixed precision), bf16 served "
                             "(-> offload_h200_<size>_fp32.json)")
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
    results: dict = {"command": " ".join(["python3", *sys.argv]), "gpus": common.gpu_names()[:1],
                     "versions": common.versions(), "size": args.size, "master_fp32": args.master_fp32, "runs": []}
    name = f"offload_h200_{args.size}_fp32.json" if args.master_fp32 else "offload_h200.json"
    try:
        for offload in (True, False)[:1 if args.skip_without else 2]:
            run_result = run(model_dir, args, offload)
            for key in ("perf/gpu_used_gb_in_train", "perf/gpu_used_gb_in_rollout",
                        "perf/trainer_gpu_peak_gb_in_train", "perf/rollout_gpu_resident_gb_in_train"):
                run_result[f"growth_{key.removeprefix('perf/')}"] = growth(run_result["steps"], key)
            results["runs"].append(run_result)
            common.write(args.out, name, results)
            if ray.is_initialized():
                ray.shutdown()
    finally:
        common.write(args.out, name, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
