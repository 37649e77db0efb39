"""Rollout throughput through ``RLJob.generate`` against a bare ``vllm.LLM.generate`` of the same
prompts on the same model, in the same run, on one H200: generated tokens per second, goal >= 95%.

Both sides run the engine the job's defaults make (dtype from the model's config: bf16; CUDA graphs;
prefix caching; ``logprobs=0``, which the job always asks for; the same memory fraction) and the same
work: P prompts of L random tokens, N samples each (one request per sample, each with its own seed),
exactly M tokens per sample (``min_tokens = max_tokens``, so both sides generate the same number of
tokens whatever the random model samples). The bare engine runs first, in its own process, and is
gone before the job starts. The job is the README's layout on one GPU: ``--colocate`` with the FSDP
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
import subprocess
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


def bare(args) -> dict:
    """vLLM alone: ``LLM.generate`` of every sample as its own request."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="bfloat16", enable_prefix_caching=True, seed=0,
              gpu_memory_utilization=args.gpu_memory_utilization, logprobs_mode="processed_logprobs")
    prompts = workload(args)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(args.samples)]

    def run(seed: int) -> tuple[float, int]:
        params = [SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=1.0, logprobs=0,
                                 seed=seed + j) for j in range(len(requests))]
        start = time.perf_counter()
        outs = llm.generate(requests, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)

    run(10_000)  # warm-up: CUDA graphs captured at start, first-batch allocations here
    timed = [run(1000 * r) for r in range(args.repeats)]
    mc = llm.llm_engine.vllm_config
    return {"seconds": [t for t, _ in timed], "tokens": [n for _, n in timed],
            "engine": {"dtype": str(mc.model_config.dtype), "max_model_len": mc.model_config.max_model_len,
                       "enforce_eager": mc.model_config.enforce_eager}}


def ours(args) -> dict:
    """The same work through ``RLJob.generate`` (samples grouped per prompt on the one engine)."""
    import rlplacement

    common.export_path()
    flags = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
             "--n-samples-per-prompt", str(args.samples), "--rollout-max-response-len", str(args.max_tokens),
             "--vllm-gpu-memory-utilization", str(args.gpu_memory_utilization)]
    config = rlplacement.config_from_args(rlplacement.add_arguments(argparse.ArgumentParser()).parse_args(flags))
    prompts = workload(args)
    with rlplacement.RLJob.start(config, args.model, timeout_s=900) as job:
        def run(seed: int) -> tuple[float, int]:
            job.prepare_rollout()
            start = time.perf_counter()
            samples = job.generate(prompts, {"temperature": 1.0}, seed=seed, exact_lengths=True)
            return time.perf_counter() - start, sum(len(s.token_ids) for s in samples)

        run(10_000)
        timed = [run(1000 * r) for r in range(args.repeats)]
        info = job.engine_info[0]
    return {"seconds": [t for t, _ in timed], "tokens": [n for _, n in timed], "flags": flags,
            "engine": {k: info[k] for k in ("dtype", "max_model_len", "enforce_eager", "prefix_caching",
                                            "gpu_memory_utilization")}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5B", choices=sorted(common.SIZES))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--phase", choices=("bare", "ours"), default=None, help="(internal) one side, JSON to stdout")
    parser.add_argument("--model", default=None, help="(internal) the model folder")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(bare(args) if args.phase == "bare" else ours(args)), flush=True)
        return 0
    model = common.make_model(Path(tempfile.mkdtemp(prefix="rollout_h200_")), args.size, "bfloat16",
                              max_position_embeddings=4096)
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--out") and a != args.out]
    sides = {}
    for phase in ("bare", "ours"):
        proc = subprocess.run([sys.executable, __file__, *passthrough, "--phase", phase, "--model", str(model)],
                              capture_output=True, text=True, timeout=900)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-2000:], proc.stderr[-6000:])
            return 1
        sides[phase] = json.loads(lines[-1][len("RESULT "):])
        sides[phase]["tokens_per_s"] = [n / t for n, t in zip(sides[phase]["tokens"], sides[phase]["seconds"])]
        sides[phase]["median_tokens_per_s"] = statistics.median(sides[phase]["tokens_per_s"])
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
