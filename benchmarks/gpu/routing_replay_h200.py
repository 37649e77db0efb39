"""Rollout routing replay on one GPU: how far the trainer's log-probs of the engine's own samples are from the
engine's, with and without ``--use-rollout-routing-replay``, on a mixture-of-experts model (Qwen3-30B-A3B's
layer at reduced depth, ``common.SIZES``; random bf16 weights) colocated with a bf16 vLLM engine, FSDP.

Each step: generate (the engine returns each token's experts), then on the same samples and the same weights
the trainer's log-probs routed by the engine's experts (``job.log_probs``, the batch carrying
``routed_experts``) and routed by the trainer's own top-k (the same batch without them, straight to the
trainer rank: the job refuses a batch without routes under the flag), each against the engine's log-prob of
every response token; then a train step with the routes and a checked update. Also timed: both log-prob
calls (what replay costs the trainer).

Results contract (``routing_replay_h200.json``): ``steps`` rows with ``replayed`` and ``own_routing`` each
{mean, p99, max} absolute log-prob difference over response tokens, ``tokens``, the two calls' seconds;
``summary``: the medians over steps and ``mean_ratio`` (own routing's mean over replayed's).

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/routing_replay_h200.py --steps 3 --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def make_batch(samples, seed: int):
    import torch

    from rlplacement import Batch, routed_experts_of

    lengths = [len(s.prompt_ids) + len(s.token_ids) for s in samples]
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    mask = torch.zeros(len(samples), width)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        ids[i, :p] = torch.tensor(s.prompt_ids)
        ids[i, p:lengths[i]] = torch.as_tensor(s.token_ids)
        mask[i, p:lengths[i]] = 1.0
    advantages = torch.randn(len(samples), generator=torch.Generator().manual_seed(seed))
    return Batch(ids, mask, advantages, lengths=torch.tensor(lengths),
                 routed_experts=routed_experts_of(samples, width))


def differences(trainer_logp, samples) -> dict:
    import torch

    diffs = torch.cat([(trainer_logp[i, len(s.prompt_ids):len(s.prompt_ids) + len(s.token_ids)]
                        - torch.as_tensor(s.logprobs)).abs() for i, s in enumerate(samples)])
    return {"mean": float(diffs.mean()), "p99": float(diffs.quantile(0.99)), "max": float(diffs.max()),
            "tokens": int(diffs.numel())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="30B-A3B-L4", choices=sorted(common.SIZES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("routing_replay_h200: needs a CUDA GPU (vLLM returns routed experts only from its GPU runner)")
        return 0
    os.environ.update(common.NVLS_OFF)
    common.export_path()
    import ray

    from rlplacement import OptimConfig, RLJob
    from rlplacement.args import build_parser, config_from_args

    model_dir = common.make_model(Path(tempfile.mkdtemp(prefix="routing_replay_")), args.size, "bfloat16")
    results: dict = {"command": " ".join(["python3", *sys.argv]), "commit": args.commit,
                     "gpus": common.gpu_names()[:1], "versions": common.versions(), "size": args.size, "steps": []}
    name = "routing_replay_h200.json"
    config = config_from_args(build_parser().parse_args(
        ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
         "--use-rollout-routing-replay", "--check-weight-update-equal"]))
    job = None
    try:
        job = RLJob.start(config, str(model_dir), optim=OptimConfig(name="adamw", lr=1e-5),
                          engine_kwargs={"dtype": "bfloat16", "max_model_len": 512,
                                         "gpu_memory_utilization": args.gpu_memory_utilization},
                          backend_options={"dtype": torch.bfloat16})
        prompts = [[(7 * i + j) % 8192 for j in range(16)] for i in range(args.prompts)]
        for step in range(args.steps):
            job.prepare_rollout()
            samples = job.generate(prompts, {"temperature": 1.0}, max_tokens=args.max_tokens, seed=step)
            batch = make_batch(samples, seed=step)
            job.prepare_train()
            t0 = time.perf_counter()
            replayed = job.log_probs(batch)
            t1 = time.perf_counter()
            own = ray.get(job.trainers[0].log_probs.remote(dataclasses.replace(batch, routed_experts=None)))
            t2 = time.perf_counter()
            row = {"step": step, "replayed": differences(replayed, samples),
                   "own_routing": differences(own, samples), "log_probs_replayed_s": t1 - t0,
                   "log_probs_own_routing_s": t2 - t1,
                   "routed_experts_shape": list(batch.routed_experts.shape)}
            row["loss"] = job.train(batch)[0].loss
            job.prepare_update()
            job.update_weights()  # checked bit for bit (--check-weight-update-equal)
            row["bit_exact"] = True
            results["steps"].append(row)
            print(f"step {step}: replayed {row['replayed']} own routing {row['own_routing']}", flush=True)
            common.write(args.out, name, results)
        steps = results["steps"]
        results["summary"] = {
            key: {stat: statistics.median(r[key][stat] for r in steps) for stat in ("mean", "p99", "max")}
            for key in ("replayed", "own_routing")}
        results["summary"]["mean_ratio"] = (results["summary"]["own_routing"]["mean"]
                                            / max(results["summary"]["replayed"]["mean"], 1e-12))
        results["ok"] = True
    except Exception as exc:  # noqa: BLE001 - recorded with the results, then raised
        results["ok"] = False
        results["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
        raise
    finally:
        common.write(args.out, name, results)
        if job is not None:
            job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
