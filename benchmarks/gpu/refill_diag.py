"""What changes an engine's greedy generation across a colocated hand-off, on one GPU: the same
weights throughout (no training), compared with the fresh engine's own generation, after (c) an
update with the engines awake, (a) a level-1 sleep and wake (weights kept, KV cache discarded), and
(b) a level-2 sleep, the weights refilled by an update, and the KV cache woken. Each row: whether
tokens are equal, the first differing position, the largest log-prob difference, and whether the
served parameters and buffers are bit-exact. Also times ``unmap_trainer_memory`` after an update.

    python3 benchmarks/gpu/refill_diag.py --size 4B --out $OUT     # -> refill_diag_h200.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _greedy(job, prompts):
    samples = job.generate(prompts, {"temperature": 0.0}, max_tokens=32, n_samples_per_prompt=1)
    return [([int(t) for t in s.token_ids], [float(x) for x in s.logprobs]) for s in samples]


def _compare(ref, got) -> dict:
    first, worst = None, 0.0
    for (t0, l0), (t1, l1) in zip(ref, got):
        for i, (a, b) in enumerate(zip(t0, t1)):
            if a != b:
                first = i if first is None else min(first, i)
                break
            worst = max(worst, abs(l0[i] - l1[i]))
    return {"tokens_equal": all(a[0] == b[0] for a, b in zip(ref, got)), "first_differing_token": first,
            "max_logprob_diff_before_it": worst}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4B", choices=sorted(common.SIZES))
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import os
    import tempfile

    import ray

    from rlplacement import OptimConfig, RLJob
    from rlplacement.args import build_parser, config_from_args

    os.environ.update(common.NVLS_OFF)
    common.export_path()
    model_dir = common.make_model(Path(tempfile.mkdtemp()), args.size, "bfloat16")
    config = config_from_args(build_parser().parse_args(
        ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", "fsdp",
         "--offload-train", "--offload-rollout"]))
    out = {"command": " ".join(["python3", *sys.argv]), "commit": args.commit, "size": args.size,
           "gpus": common.gpu_names()[:1], "versions": common.versions(), "rows": {}}
    job = RLJob.start(config, str(model_dir), optim=OptimConfig(name="adamw", lr=1e-4),
                      engine_kwargs={"dtype": "bfloat16", "max_model_len": 512, "gpu_memory_utilization": 0.6})
    engine = job.engines[0]
    try:
        prompts = [[(7 * i + j) % 8192 for j in range(16)] for i in range(8)]
        sums = ray.get(engine.model_checksums.remote())
        ref = _greedy(job, prompts)
        out["rows"]["repeat"] = _compare(ref, _greedy(job, prompts))

        def row(name):
            out["rows"][name] = {**_compare(ref, _greedy(job, prompts)),
                                 "served_equal": ray.get(engine.model_checksums.remote()) == sums}
            print(name, out["rows"][name], flush=True)

        job.prepare_update()
        job.update_weights()
        t0 = time.perf_counter()
        ray.get(engine.unmap_trainer_memory.remote())
        out["unmap_s"] = time.perf_counter() - t0
        row("c_update_awake")
        ray.get(engine.release_memory.remote(keep_weights=True))
        ray.get(engine.resume_all.remote())
        row("a_level1_sleep_wake")
        ray.get(engine.release_memory.remote(keep_weights=False))
        ray.get(engine.resume_weights.remote())
        job.update_weights()
        t0 = time.perf_counter()
        ray.get(engine.unmap_trainer_memory.remote())
        out["unmap_after_refill_s"] = time.perf_counter() - t0
        ray.get(engine.resume_kv_cache.remote())
        row("b_level2_sleep_refill")
    finally:
        common.write(args.out, "refill_diag_h200.json", out)
        job.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
