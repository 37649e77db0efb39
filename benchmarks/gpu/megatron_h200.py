"""Megatron colocated on one H200 beside FSDP on the same shape: per backend a colocated ``RLJob`` on GPU 0
(``--colocate --offload-train --offload-rollout``, the trainer's state and the engine's memory handed off
every step), the 4B Qwen3 shape with random weights, run as the loop runs it: generate -> train ->
update, every update checked bit for bit by the job (``--check-weight-update-equal`` raises on a mismatch).
Megatron: megatron-core's GPTModel (TE spec where TE imports; local spec and fp32 on CPU), TP=1, bf16 with
fp32 main parameters, the distributed optimizer, full uniform recompute of every layer. FSDP: the same
mixed precision (fp32 master weights and AdamW state, bf16 compute) with gradient checkpointing. The
realistic step's MFU is measured by ``train_step_h200.py --variants megatron:eager eager``, not here.

After the last update, unless ``--no-fresh-check``: greedy tokens (temperature 0, 32 tokens, 8 prompts in
one ``job.generate``) of the updated engine, the trainer's weights saved as an HF folder, and after
``job.close()`` the greedy tokens of a fresh engine started from that folder (twice: whether greedy
decoding of random weights repeats at all); an error there is recorded, the other numbers kept.

Results contract (``megatron_h200.json``): ``backends`` {megatron, fsdp}: ``command``, ``commit``, ``argv``
(the job's flags), ``startup_s``, ``steps`` rows (``train_s``, ``update_s``, ``trainer_update_s``, ``path``
direct|buckets, ``bytes``, ``engine_load_s``, ``load_path`` (the engine's commit, its workers'
``rlplacement_load_path``), ``loss``, ``grad_norm``, ``handoff_to_rollout_s``, ``handoff_to_train_s``, ``trainer_peak_gb_in_train`` (the
trainer's torch peak over the step's training and update), every ``perf/*`` of the step, ``bit_exact``),
``update_s`` (median over steps >= 1), ``train_s`` (median), ``path`` (the last update's), ``peak_train_gb``
(largest), ``fresh`` {``generation_equal``, ``fresh_repeats_itself``, ``first_divergence``,
``logprob_max_abs_diff``} or ``fresh_error``, ``ok`` (else ``error``, ``traceback``). Top level: ``update_s``
per backend, ``megatron_update_over_fsdp`` where both ran. ``--merge-from FILE`` starts from an earlier
results file and replaces this run's backends (one device call per backend, one file); the file is
written after each backend, so a timeout keeps what finished.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/megatron_h200.py --backends megatron --out $OUT --commit SHA
    python3 benchmarks/gpu/megatron_h200.py --backends fsdp --merge-from benchmarks/gpu/results/megatron_h200.json \
        --out $OUT  # the first call's file, carried
    python3 benchmarks/gpu/megatron_h200.py --size smoke --steps 2            # the same code on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

NAME = "megatron_h200.json"
PEAK = "perf/trainer_gpu_peak_gb_in_train"  # read at the next hand-off to rollout: moved to its own step's row


def job_argv(backend: str, args) -> list[str]:
    argv = ["--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1", "--train-backend", backend,
            "--offload-train", "--offload-rollout"] + ([] if args.unchecked else ["--check-weight-update-equal"])
    if backend == "megatron":
        argv += ["--use-distributed-optimizer", "--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "1"]
    else:
        argv += ["--gradient-checkpointing"]
    if args.max_tokens_per_gpu:
        argv += ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(args.max_tokens_per_gpu)]
    return argv


def train_batch(vocab: int, n: int, length: int):
    """``common.random_batch``'s recipe (the same batch for n <= 4; its advantages stop at 4), for any ``n``."""
    import torch

    from rlplacement import Batch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    mask = torch.zeros(n, length)
    mask[:, length // 2:] = 1
    return Batch(ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5] * n)[:n])


def tokens(samples) -> list[dict]:
    return [{"token_ids": [int(t) for t in s["token_ids"]], "logprobs": [float(x) for x in s["logprobs"]]}
            for s in samples]


def wait_for_gpu_memory(fraction: float, timeout_s: float = 120.0) -> None:
    """Until GPU 0 has ``fraction`` of its memory (and 5% more) free: ``ray.kill`` does not wait for exits."""
    import torch

    deadline = time.monotonic() + timeout_s
    while torch.cuda.is_available() and time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info(0)
        if free >= (fraction + 0.05) * total:
            return
        time.sleep(1.0)


def fresh_check(job, config, engine_kwargs: dict, prompts: list[list[int]], folder: Path, out: dict) -> None:
    """Greedy tokens of the updated engine, the trainer's weights saved as an HF folder, the job closed, and
    the same greedy generation (twice) of a fresh engine started from the folder."""
    import ray

    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement.engines.registry import engine_class
    from rlplacement.placement import ray_groups
    from rlplacement.runtime.waits import get_all

    samples = job.generate(prompts, {"temperature": 0.0}, max_tokens=32, n_samples_per_prompt=1)
    updated = tokens([{"token_ids": s.token_ids, "logprobs": s.logprobs} for s in samples])
    job.prepare_train()  # the trainer resident (engines asleep) to read its weights
    saved = get_all([t.save_hf_folder.remote(str(folder), job.hf_dir) for t in job.trainers], 600, "saving")[0]
    job.close()
    wait_for_gpu_memory(engine_kwargs.get("gpu_memory_utilization", 0.0))  # the killed actors' memory back
    placement = ray_groups.place(config.placement, verbose=False)
    engine = create_engine_actor(0, saved, options=placement.engine_options(0),
                                 env=engine_class().process_env(False),
                                 **{**config.rollout.engine_kwargs(), **engine_kwargs, "verbose": False})
    try:
        fresh = [tokens(common.greedy(engine, prompts)) for _ in range(2)]
    finally:
        ray.get(engine.shutdown.remote(), timeout=120)
        ray.kill(engine)
        placement.remove()
    first = [next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
             for a, b in zip(updated, fresh[0])]
    out["fresh"] = {"generation_equal": [a["token_ids"] for a in updated] == [b["token_ids"] for b in fresh[0]],
                    "fresh_repeats_itself": fresh[0] == fresh[1], "first_divergence": first,
                    "logprob_max_abs_diff": max((abs(x - y) for a, b in zip(updated, fresh[0])
                                                 for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0)}


def run(backend: str, model_dir: Path, root: Path, args) -> dict:
    import ray
    import torch

    from rlplacement import OptimConfig, RLJob
    from rlplacement.args import build_parser, config_from_args

    cuda = torch.cuda.is_available()
    engine_kwargs = {"dtype": "bfloat16" if cuda else "float32", "max_model_len": 512}
    if cuda:
        engine_kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    vocab = common.SIZES[args.size]["vocab_size"]
    argv = job_argv(backend, args)
    config = config_from_args(build_parser().parse_args(argv))
    out: dict = {"backend": backend, "argv": argv, "steps": []}
    t0 = time.time()
    job = None
    try:  # fp32 master weights: megatron keeps them in its optimizer under --bf16, FSDP as its parameters
        job = RLJob.start(config, str(model_dir), optim=OptimConfig(name="adamw", lr=1e-4),
                          engine_kwargs=engine_kwargs, backend_options={"dtype": torch.float32})
        out["startup_s"] = round(time.time() - t0, 1)
        print(f"[{backend}] started in {out['startup_s']} s", flush=True)
        prompts = [[(7 * i + j) % vocab for j in range(16)] for i in range(args.prompts)]
        batch = train_batch(vocab, args.train_batch, args.train_len)
        rows = out["steps"]
        for step in range(args.steps):
            job.prepare_rollout()
            perf = job.pop_handoff_metrics()  # the previous step's train peak was read just now
            if rows and PEAK in perf:
                rows[-1]["trainer_peak_gb_in_train"] = perf.pop(PEAK)
            g0 = time.perf_counter()
            samples = job.generate(prompts, {"temperature": 1.0}, max_tokens=args.max_tokens, seed=step)
            rollout_s = time.perf_counter() - g0
            job.prepare_train()
            t1 = time.perf_counter()
            metrics = job.train(batch)
            train_s = time.perf_counter() - t1
            job.prepare_update()
            u0 = time.perf_counter()
            report = job.update_weights()  # checked: raises naming the tensor on any mismatch
            update_s = time.perf_counter() - u0
            perf.update(job.pop_handoff_metrics())
            commit = ray.get(job.engines[0].call_workers.remote("rlplacement_load_path"), timeout=120)
            rows.append({"step": step, "rollout_s": rollout_s, "train_s": train_s, "update_s": update_s,
                         "trainer_update_s": report.trainer.seconds, "path": report.trainer.path,
                         "bytes": report.trainer.bytes, "engine_load_s": report.engines[0].load,
                         "load_path": commit[0] if commit else None, "loss": metrics[0].loss,
                         "grad_norm": metrics[0].grad_norm, "tokens": sum(len(s.token_ids) for s in samples),
                         "handoff_to_rollout_s": perf.get("perf/handoff_to_rollout_time", 0.0),
                         "handoff_to_train_s": perf.get("perf/handoff_to_train_time", 0.0),
                         "version": job.version, "bit_exact": True, **perf})
            loaded = (rows[-1]["load_path"] or {}).get("path")
            print(f"[{backend}] step {step}: path={report.trainer.path} load={loaded} " + " ".join(
                f"{k.removeprefix('perf/')}={v:.3g}" for k, v in rows[-1].items() if isinstance(v, float)), flush=True)
        job.prepare_rollout()
        last = job.pop_handoff_metrics()
        if rows and PEAK in last:
            rows[-1]["trainer_peak_gb_in_train"] = last[PEAK]
        out["ok"] = True
        summarize(out)
        if not args.no_fresh_check:
            try:
                fresh_check(job, config, engine_kwargs, prompts[:8], root / f"{backend}_trained", out)
                print(f"[{backend}] fresh engine: {out['fresh']}", flush=True)
            except Exception as exc:  # noqa: BLE001 - random weights' near-ties must not lose the numbers above
                out["fresh_error"] = f"{type(exc).__name__}: {exc}"[:3000]
                print(f"[{backend}] fresh check failed: {traceback.format_exc()[-3000:]}", flush=True)
    except Exception as exc:  # noqa: BLE001 - one backend failing must not lose the other's numbers
        out["ok"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        out["traceback"] = traceback.format_exc()[-6000:]
        print(f"[{backend}] failed: {out['traceback']}", flush=True)
        summarize(out)
    finally:
        if job is not None:
            job.close()
    return out


def summarize(out: dict) -> None:
    rows = out["steps"]
    later = [r for r in rows if r["step"] >= 1]
    if later:
        out["update_s"] = statistics.median(r["update_s"] for r in later)
        out["trainer_update_s"] = statistics.median(r["trainer_update_s"] for r in later)
    if rows:
        out["train_s"] = statistics.median(r["train_s"] for r in rows)
        out["path"] = rows[-1]["path"]
        peaks = [r["trainer_peak_gb_in_train"] for r in rows if "trainer_peak_gb_in_train" in r]
        out["peak_train_gb"] = max(peaks) if peaks else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["megatron", "fsdp"], choices=["megatron", "fsdp"])
    parser.add_argument("--size", default="4B", choices=sorted(common.SIZES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-len", type=int, default=512)
    parser.add_argument("--max-tokens-per-gpu", type=int, default=None,
                        help="pack micro-batches by tokens (--use-dynamic-batch-size); default: one micro-batch")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--unchecked", action="store_true",
                        help="updates without --check-weight-update-equal (its hashing of every tensor on both sides "
                             "dominates a checked update): the update time itself (-> megatron_h200_unchecked.json)")
    parser.add_argument("--no-fresh-check", action="store_true",
                        help="leave out greedy generation against a fresh engine started from the saved weights")
    parser.add_argument("--merge-from", default=None, help="an earlier results file: this run's backends replace its")
    parser.add_argument("--commit", default=None, help="the checkout's commit, recorded with the results")
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    name = "megatron_h200_unchecked.json" if args.unchecked else NAME
    import tempfile

    import ray
    import torch

    if torch.cuda.is_available():
        os.environ.update(common.NVLS_OFF)
        common.export_path()
    root = Path(tempfile.mkdtemp(prefix="megatron_h200_"))
    model_dir = common.make_model(root, args.size, "bfloat16" if torch.cuda.is_available() else "float32")
    results: dict = json.loads(Path(args.merge_from).read_text()) if args.merge_from else {}
    results.update({"command": " ".join(["python3", *sys.argv]), "commit": args.commit,
                    "gpus": common.gpu_names()[:1], "versions": common.versions(), "size": args.size,
                    "shape": common.SIZES[args.size]})
    results.setdefault("backends", {})
    try:
        for backend in args.backends:
            results["backends"][backend] = {"command": results["command"], "commit": args.commit,
                                            **run(backend, model_dir, root, args)}
            results["update_s"] = {b: r.get("update_s") for b, r in results["backends"].items()}
            both = [results["update_s"].get(b) for b in ("megatron", "fsdp")]
            if all(both):
                results["megatron_update_over_fsdp"] = round(both[0] / both[1], 3)
            common.write(args.out, name, results)
            if ray.is_initialized():
                ray.shutdown()
    finally:
        common.write(args.out, name, results)
    print(json.dumps({b: {k: r.get(k) for k in ("ok", "update_s", "train_s", "path", "peak_train_gb", "fresh", "error")}
                      for b, r in results["backends"].items()}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
