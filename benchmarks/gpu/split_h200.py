"""Split layout on two GPUs: FSDP trainer on GPU 0, one vLLM engine on GPU 1, placed by
rlplacement on a local Ray cluster that sees the real GPUs; broadcast and broadcast_packed over
NCCL, bit-exact (--check-weight-update-equal), timed against a raw NCCL broadcast of one flat
buffer of the same bytes between the same GPUs, measured in the same run (the ceiling).

    source benchmarks/gpu/device_env.sh   # NVLink multicast off, carried packages on the path
    python3 benchmarks/gpu/split_h200.py --sizes 0.5B 1.5B --out $OUT

Per size: build a Qwen3-shaped model from a config (bf16, random), start the job, take one real
optimizer step (so the trainer's weights differ from the engine's), then per mode one checked
update (checksums of every tensor on both sides) and ``--repeats`` timed updates. For the first
size, greedy generation of the updated engine is compared with a fresh engine started from the
trainer's weights saved as a Hugging Face folder. Needs CUDA: exits 0 with a message without it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SIZES = {  # Qwen3-shaped, 28 layers, head_dim 128, tied embeddings
    "0.5B": dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_key_value_heads=8),
    "1.0B": dict(hidden_size=1536, intermediate_size=6144, num_attention_heads=12, num_key_value_heads=4),
    "1.5B": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                  num_hidden_layers=2, head_dim=32),
}
MODES = ("broadcast", "broadcast_packed")
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def make_model(root: Path, size: str) -> Path:
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    shape = {"num_hidden_layers": 28, "head_dim": 128, **SIZES[size]}
    spec = TinySpec(family="qwen3", vocab_size=8192, tie_word_embeddings=True, max_position_embeddings=1024,
                    dtype="bfloat16" if size != "smoke" else "float32", **shape)
    return make_tiny_model(root / size, spec)


def _raw_rank(rank: int, nbytes: int, repeats: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    if rank == 0:
        buf.random_(0, 255)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        sync()
        if i >= 2:  # two warm-ups: NCCL sets up its channels on first use
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def raw_nccl_broadcast(nbytes: int, repeats: int) -> list[float]:
    """Seconds per broadcast of one flat ``nbytes`` buffer from GPU 0 to GPU 1 (the ceiling)."""
    import torch.multiprocessing as mp

    from rlplacement.backends.launch import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_raw_rank, args=(r, nbytes, repeats, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    times = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return times


def job_config(mode: str, buffer_size: int):
    from rlplacement.args import build_parser, config_from_args

    return config_from_args(build_parser().parse_args([
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
        "--update-weight-buffer-size", str(buffer_size),
        "--train-backend", "fsdp", "--update-weight-transfer-mode", mode, "--check-weight-update-equal"]))


def random_batch(vocab: int, batch: int = 4, length: int = 64) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    mask = torch.zeros(batch, length)
    mask[:, length // 2:] = 1
    return {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "advantages": [1.0, -1.0, 0.5, -0.5][:batch]}


def greedy(engine, prompts: list[list[int]]) -> list[dict]:
    import ray

    return ray.get(engine.generate.remote(prompts, max_tokens=32, temperature=0.0), timeout=600)


def run_size(size: str, root: Path, args, results: dict, compare_generation: bool) -> None:
    import ray
    import torch

    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement.hooks import RLJob

    t0 = time.time()
    model_dir = make_model(root, size)
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    engine_kwargs = {"dtype": str(dtype).removeprefix("torch."), "max_model_len": 512}
    if torch.cuda.is_available():
        engine_kwargs["gpu_memory_utilization"] = 0.45
    job = RLJob.start(job_config(MODES[0], args.buffer_size), str(model_dir), optim={"lr": 1e-3},
                      engine_kwargs=engine_kwargs, backend_options={"dtype": dtype})
    row: dict = {"size": size, "startup_s": round(time.time() - t0, 1)}
    try:
        job.train(random_batch(8192, batch=1 if size == "smoke" else 4))  # the engine still serves the initial weights: updates must move them
        for mode in MODES:
            job.set_transfer(mode, check_equal=True)
            checked = job.update_weights()  # raises WeightUpdateError naming the tensor on any mismatch
            job.set_transfer(mode, check_equal=False)
            reports = [job.update_weights() for _ in range(args.repeats + 1)][1:]  # first: warm-up
            nbytes = checked["trainer"]["bytes"]
            wire = [r["trainer"]["seconds"] for r in reports]
            row.update({"bytes": nbytes, "num_tensors": checked["trainer"]["num_tensors"],
                        f"{mode}_checked_bit_exact": True, f"{mode}_seconds": wire,
                        f"{mode}_engine_load_s": [r["engines"][0].get("load") for r in reports]})
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [7] * 16]
        if compare_generation:
            updated = greedy(job.engines[0], prompts)
            saved = ray.get(job.trainers[0].save_hf_folder.remote(str(root / f"{size}_trained"), str(model_dir)))
            ray.get(job.engines[0].shutdown.remote())
            ray.kill(job.engines[0])
            fresh_engine = create_engine_actor(0, saved, options=job.placement.engine_options(0), **engine_kwargs)
            job.engines[0] = fresh_engine
            fresh = greedy(fresh_engine, prompts)
            row["generation_tokens_equal"] = all(a["token_ids"] == b["token_ids"] for a, b in zip(updated, fresh))
            row["generation_logprob_max_abs_diff"] = max(abs(x - y) for a, b in zip(updated, fresh)
                                                         for x, y in zip(a["logprobs"], b["logprobs"]))
    finally:
        job.close()
    raw = raw_nccl_broadcast(row["bytes"], args.repeats)
    row["raw_seconds"] = raw
    ceiling = row["bytes"] / statistics.median(raw) / 1e9
    row["ceiling_gbps"] = round(ceiling, 2)
    for mode in MODES:
        gbps = row["bytes"] / statistics.median(row[f"{mode}_seconds"]) / 1e9
        row[f"{mode}_gbps"], row[f"{mode}_ratio"] = round(gbps, 2), round(gbps / ceiling, 3)
    results["sizes"].append(row)
    print(json.dumps(row), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5B", "1.5B"], choices=sorted(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--buffer-size", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="CPU check of this script's own logic (gloo, vLLM CPU, the 'smoke' size); no GPU numbers")
    args = parser.parse_args()
    import torch

    if args.smoke:
        args.sizes = ["smoke"]
    elif torch.cuda.device_count() < 2:
        print("split_h200: needs two CUDA GPUs; nothing run")
        return 0
    os.environ.update(NVLS_OFF)  # Ray workers and vLLM's engine process inherit these
    import ray

    results: dict = {"command": " ".join(sys.argv),
                     "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                     "torch": torch.__version__, "sizes": []}
    root = Path(tempfile.mkdtemp(prefix="split_h200_"))
    try:
        for i, size in enumerate(args.sizes):
            run_size(size, root, args, results, compare_generation=(i == 0))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "split_h200.json").write_text(json.dumps(results, indent=1))
    print(f"{'size':>5} {'GB':>6} {'ceiling GB/s':>12} {'broadcast':>16} {'packed':>16}")
    for r in results["sizes"]:
        print(f"{r['size']:>5} {r['bytes'] / 1e9:6.2f} {r['ceiling_gbps']:12.1f} "
              f"{r['broadcast_gbps']:7.1f} ({r['broadcast_ratio']:.0%}) {r['broadcast_packed_gbps']:7.1f} "
              f"({r['broadcast_packed_ratio']:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
