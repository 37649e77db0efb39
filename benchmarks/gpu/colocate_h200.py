"""Colocated layout on one GPU: FSDP trainer and a vLLM engine (engine core in its own process) on
GPU 0, placed by rlplacement with ``--colocate``. Per Qwen3 shape: our ``cuda_ipc`` path (whole
update as the loop sees it), the per-tensor-handle baseline (``per_tensor_ipc``: one CUDA IPC
handle per tensor into ``load_weights``) on the same GPU and model, and the ceiling: one
device-to-device copy of the same bytes on that GPU (CUDA events), all in the same run.

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/colocate_h200.py --sizes 4B 8B --out $OUT   # -> colocate_h200.json
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


def job_config(bucket_bytes: int):
    from rlplacement.args import build_parser, config_from_args

    return config_from_args(build_parser().parse_args([
        "--colocate", "--actor-num-gpus-per-node", "1", "--num-gpus-per-node", "1",
        "--update-weight-buffer-size", str(bucket_bytes), "--train-backend", "fsdp"]))


def per_tensor_ipc(model_dir: Path, args, row: dict) -> None:
    import ray

    from peers import PeerEngine, PeerTrainer
    from rlplacement.placement import ray_groups
    from rlplacement.runtime.waits import get_all

    placement = ray_groups.place(job_config(args.buffer_size).placement)
    trainer = ray.remote(PeerTrainer).options(**placement.trainer_options(0)).remote(str(model_dir))
    engine = ray.remote(PeerEngine).options(**placement.engine_options(0)).remote(
        str(model_dir), None, gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        expected = get_all([trainer.perturb.remote()], 600, "peer trainer")[0]
        handles = get_all([trainer.ipc_handles.remote()], 300, "handles")[0]
        get_all([engine.ipc_update.remote(handles)], 600, "per-tensor IPC")
        got = get_all([engine.unfused_checksums.remote()], 300, "engine checksums")[0]
        whole, load = [], []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            handles = get_all([trainer.ipc_handles.remote()], 300, "handles")[0]
            timing = get_all([engine.ipc_update.remote(handles)], 600, "per-tensor IPC")[0]
            if i:
                whole.append(time.perf_counter() - t0)
                load.append(timing["load"])
        row["per_tensor_ipc"] = {"whole": whole, "wire": [None], "load": load,
                                 "bit_exact": all(got.get(n) == c for n, c in expected.items()),
                                 "bit_exact_scope": f"{len(expected)} unfused tensors (embedding, norm, down_proj)"}
        print(f"[{row['size']}] per_tensor_ipc: whole {statistics.median(whole) * 1e3:.1f} ms", flush=True)
    finally:
        for actor in (engine, trainer):
            ray.kill(actor)
        placement.remove()


def run_size(size: str, root: Path, args, compare_generation: bool) -> dict:
    t0 = time.time()
    model_dir = common.make_model(root, size, "bfloat16")
    row: dict = {"size": size, "make_model_s": round(time.time() - t0, 1)}
    common.run_ours(job_config(args.buffer_size), ("cuda_ipc",), size, model_dir, root, args, row, compare_generation,
                    gpu_memory_utilization=args.gpu_memory_utilization)
    try:
        if not args.skip_baseline:
            per_tensor_ipc(model_dir, args, row)
    except Exception as exc:  # noqa: BLE001 - the baseline failing must not lose our numbers
        row["per_tensor_ipc_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"[{size}] per_tensor_ipc failed: {row['per_tensor_ipc_error']}", flush=True)
    copies = common.device_copy_seconds(row["bytes"], args.repeats)
    return common.size_row(row, copies, "device-to-device copy (bytes moved once)", ("cuda_ipc", "per_tensor_ipc"))


def main(description: str = __doc__.splitlines()[0], sizes: tuple[str, ...] = ("4B", "8B"),
         gpu_memory_utilization: float = 0.3, file_name: str = "colocate_h200.json", baseline: bool = True) -> int:
    """The colocated run (``moe_h200.py`` runs it with its own shape, file and defaults); ``baseline`` False:
    no per-tensor-handle baseline at all."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", nargs="+", default=list(sizes), choices=sorted(common.SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-size", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=gpu_memory_utilization)
    parser.add_argument("--out", type=str, default=None)
    if baseline:
        parser.add_argument("--skip-baseline", action="store_true",
                            help="leave out the per-tensor-handle baseline (a profiling run of our path only)")
    parser.add_argument("--skip-generation", action="store_true",
                        help="leave out greedy generation against a fresh engine (another call ran it)")
    args = parser.parse_args()
    args.skip_baseline = getattr(args, "skip_baseline", False) or not baseline
    import torch

    if not torch.cuda.is_available():
        print(f"{file_name.removesuffix('.json')}: needs a CUDA GPU; nothing run")
        return 0
    os.environ.update(common.NVLS_OFF)
    common.export_path()

    results: dict = {"command": " ".join(["python3", *sys.argv]), "gpus": common.gpu_names()[:1],
                     "versions": common.versions(), "sizes": []}
    modes = ("cuda_ipc", "per_tensor_ipc") if baseline else ("cuda_ipc",)
    common.run_sizes(args, results, file_name, run_size, modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
