"""Rollout throughput through ``RLJob.generate`` against a bare ``vllm.LLM.generate`` of the same
prompts on the same model, in the same run, on one H200: generated tokens per second, goal >= 95%.

Both sides run the engine the job's defaults make (dtype from the model's config: bf16; CUDA graphs;
prefix caching; ``logprobs=0``, which the job always asks for; the same memory fraction) and the same
work: P prompts of L random tokens, N samples each (one request per sample, each with its own seed),
exactly M tokens per sample (``min_tokens = max_tokens``, so both sides generate the same number of
tokens whatever the random model samples). Both engines are up at once (the bare one in this process)
and take turns, run by run, so a drift of the host hits both alike (at this size both are bound by
the CPU work around each decode step). The job is the README's layout on one GPU: ``--colocate`` with the FSDP
trainer (its state offloaded while the engine generates, as in a real step); the hand-off is done
before the timed part (``prepare_rollout``), so the figure is generation alone.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/rollout_h200.py --out $OUT        # -> rollout_h200.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def workload(args) -> list[list[int]]:
    vocab = min(8000, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    return [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def bare_side(args, gpu_memory_utilization: float):
    """vLLM alone in this process: ``LLM.generate`` of every sample as its own request."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=True, seed=0,
              gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs")
    requests = [TokensPrompt(prompt_token_ids=p) for p in workload(args) for _ in range(args.samples)]

    def run(seed: int) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=1.0, logprobs=0,
                                 seed=seed + j) for j in range(len(requests))]
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    mc = llm.llm_engine.vllm_config
    return run, {"dtype": str(mc.model_config.dtype), "max_model_len": mc.model_config.max_model_len,
                 "enforce_eager": mc.model_config.enforce_eager}


def job_side(args, gpu_memory_utilization: float):
    """The same work through ``RLJob.generate`` (samples grouped per prompt on the one engine)."""
    import rlplacement

    common.export_path()
    flags = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
             "--n-samples-per-prompt", str(args.samples), "--rollout-max-response-len", str(args.max_tokens),
             "--vllm-gpu-memory-utilization", str(gpu_memory_utilization)]
    config = rlplacement.config_from_args(rlplacement.add_arguments(argparse.ArgumentParser()).parse_args(flags))
    prompts = workload(args)
    job = rlplacement.RLJob.start(config, args.model, timeout_s=900)

    def run(seed: int) -> tuple[float, int]:
        job.prepare_rollout()
        start = time.perf_counter()
        samples = job.generate(prompts, {"temperature": 1.0}, seed=seed, exact_lengths=True)
        return time.perf_counter() - start, sum(len(s.token_ids) for s in samples)

    info = job.engine_info[0]
    return job, run, {"flags": flags, **{k: info[k] for k in ("dtype", "max_model_len", "enforce_eager",
                                                              "prefix_caching", "gpu_memory_utilization")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5B", choices=sorted(common.SIZES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="each engine's (both are up)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.model = str(common.make_model(Path(tempfile.mkdtemp(prefix="rollout_h200_")), args.size, "bfloat16",
                                       max_position_embeddings=4096))
    # both engines stay up and take turns, so a drift of the host (these runs are CPU-bound) hits both alike
    job, run_job, job_engine = job_side(args, args.gpu_memory_utilization)
    try:
        run_bare, bare_engine = bare_side(args, args.gpu_memory_utilization)
        run_bare(10_000), run_job(10_000)  # warm-up: first-batch allocations
        timed = {"bare": [], "ours": []}
        for r in range(args.repeats):
            timed["bare"].append(run_bare(1000 * r))
            timed["ours"].append(run_job(1000 * r))
    finally:
        job.close()
    sides = {}
    for side, engine in (("bare", bare_engine), ("ours", job_engine)):
        rows = timed[side]
        sides[side] = {"seconds": [t for t, _ in rows], "tokens": [n for _, n in rows], "engine": engine,
                       "tokens_per_s": [n / t for t, n in rows]}
        sides[side]["median_tokens_per_s"] = statistics.median(sides[side]["tokens_per_s"])
    ratio = sides["ours"]["median_tokens_per_s"] / sides["bare"]["median_tokens_per_s"]
    result = {"command": " ".join(["python3", *sys.argv]), "commit": args.commit, "gpus": common.gpu_names()[:1],
              "versions": common.versions(), "size": args.size,
              "work": {"prompts": args.prompts, "samples_per_prompt": args.samples, "prompt_len": args.prompt_len,
                       "tokens_per_sample": args.max_tokens},
              "bare_vllm": sides["bare"], "rlplacement": sides["ours"], "ratio": ratio, "goal": 0.95,
              "meets_goal": ratio >= 0.95}
    common.write(args.out, "rollout_h200.json", result)
    print(f"{args.size}: bare vLLM {sides['bare']['median_tokens_per_s']:.0f} tok/s, RLJob.generate "
          f"{sides['ours']['median_tokens_per_s']:.0f} tok/s: {ratio:.3f} of bare (goal >= 0.95)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
