"""Colocated layout on one GPU: FSDP trainer and a vLLM engine (engine core in its own process) on
GPU 0, placed by rlplacement with ``--colocate``. Per Qwen3 shape: our ``cuda_ipc`` path (whole
update as the loop sees it), the per-tensor-handle baseline (``per_tensor_ipc``: one CUDA IPC
handle per tensor into ``load_weights``) on the same GPU and model, and the ceiling: one
device-to-device copy of the same bytes on that GPU (CUDA events), all in the same run.

``--peers`` adds vLLM 0.26's own IPC weight-transfer engine, unpacked (``vllm_ipc``) and packed
(``vllm_ipc_packed``), in ``colocate_peers_h200.json``. vLLM fixes the weight-transfer backend when an
engine starts (ours is ``"rlplacement"``), so the peers get their own engine, started on the same GPU
once ours has closed, with the baseline's trainer (the same HF tensors in GPU memory); ``per_tensor_ipc``
runs on that engine too. Every peer row perturbs the trainer's tensors first and is checked on every
served parameter (``served_views``); ours is checked by its own checked update. Each peer row records
``vs_ours``: its whole update over ours (how many times ours is faster).

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/colocate_h200.py --sizes 4B 8B --out $OUT   # -> colocate_h200.json
    python3 benchmarks/gpu/colocate_h200.py --peers --sizes 8B 30B-A3B-L4 --skip-generation --eager \
        --commit C --out $OUT                                          # -> colocate_peers_h200.json
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


def peer_session(model_dir: Path, args, row: dict, utilization: float) -> None:
    """The peers' engine and trainer, after ours closed: ``per_tensor_ipc`` unless skipped, then with
    ``--peers`` vLLM's IPC engine unpacked and packed. A failed row is recorded as ``<mode>_error`` and the
    others still run."""
    import ray

    from peers import PeerEngine, PeerTrainer
    from rlplacement.placement import ray_groups
    from rlplacement.runtime.waits import get_all

    placement = ray_groups.place(job_config(args.buffer_size).placement)
    trainer = ray.remote(PeerTrainer).options(**placement.trainer_options(0)).remote(str(model_dir))
    engine = ray.remote(PeerEngine).options(**placement.engine_options(0)).remote(
        str(model_dir), "ipc" if args.peers else None, gpu_memory_utilization=utilization)
    try:
        layout = get_all([trainer.layout.remote()], 600, "peer trainer")[0]
        rows = []
        if not args.skip_baseline:
            def per_tensor() -> dict:
                handles = get_all([trainer.ipc_handles.remote()], 300, "handles")[0]
                return get_all([engine.ipc_update.remote(handles)], 600, "per-tensor IPC")[0]
            rows.append(("per_tensor_ipc", per_tensor, {}))
        if args.peers:
            from vllm.distributed.weight_transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES

            # vLLM's default buffer, or the largest tensor where that is larger (it refuses a tensor that
            # does not fit: the 8B shape's embedding is 1.24 GB), rounded up to 256 MiB
            step = 256 << 20
            buffer_bytes = max(DEFAULT_PACKED_BUFFER_SIZE_BYTES, -(-layout["max_tensor_bytes"] // step) * step)
            for packed in (False, True):
                def vllm_ipc(packed=packed) -> dict:
                    t0 = time.perf_counter()
                    get_all([engine.start_weight_update.remote()], 300, "start_weight_update")
                    t1 = time.perf_counter()
                    inside = get_all([trainer.vllm_ipc_send.remote(engine, packed, buffer_bytes)], 600, "vLLM IPC send")[0]
                    t2 = time.perf_counter()
                    get_all([engine.finish_weight_update.remote()], 300, "finish_weight_update")
                    return {"start": t1 - t0, "send": t2 - t1, "send_inside_trainer": inside,
                            "finish": time.perf_counter() - t2}
                rows.append(("vllm_ipc_packed" if packed else "vllm_ipc", vllm_ipc,
                             {"packed": packed, "packed_buffer_bytes": buffer_bytes if packed else None}))
        for mode, update, extra in rows:
            try:
                peer_row(mode, update, trainer, engine, layout, args, row, extra)
            except Exception as exc:  # noqa: BLE001 - one peer failing must not lose the other rows
                row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                print(f"[{row['size']}] {mode} failed: {row[f'{mode}_error']}", flush=True)
    finally:
        try:
            get_all([engine.shutdown.remote()], 120, "peer engine shutdown")
        except Exception as exc:  # noqa: BLE001 - killed below either way
            print(f"[{row['size']}] peer engine shutdown: {exc}", flush=True)
        for actor in (engine, trainer):
            ray.kill(actor)
        placement.remove()


def peer_row(mode: str, update, trainer, engine, layout: dict, args, row: dict, extra: dict) -> None:
    """One checked update (trainer perturbed first; every served parameter against what the trainer's
    tensors make), then ``args.repeats`` timed ones after a warm-up, as the driver sees them."""
    import served_views
    from rlplacement.runtime.waits import get_all

    expected = get_all([trainer.perturb_served.remote()], 600, "trainer's served checksums")[0]
    update()
    served = get_all([engine.served_checksums.remote()], 600, "engine's served checksums")[0]
    check = served_views.compare(expected, served, layout["names"])
    whole, phases = [], []
    for i in range(args.repeats + 1):
        t0 = time.perf_counter()
        parts = update()
        if i:
            whole.append(time.perf_counter() - t0)
            phases.append(parts)
    row[mode] = {"whole": whole, "wire": [None], "load": [p.get("load") for p in phases],
                 "bit_exact": check["bit_exact"], "check": check, "bytes": layout["bytes"],
                 "num_tensors": len(layout["names"]), "start": "trainer GPU memory (HF tensors, bf16)",
                 "bit_exact_scope": f"every served parameter ({check['checked']}) against the trainer's tensors "
                                    "fused as vLLM serves them (served_views)",
                 "phases_ms": {k: round(statistics.median(p[k] for p in phases) * 1e3, 3) for k in phases[0]}, **extra}
    print(f"[{row['size']}] {mode}: whole {statistics.median(whole) * 1e3:.1f} ms, check "
          f"{'bit-exact' if check['bit_exact'] else check}, phases {row[mode]['phases_ms']}", flush=True)


PEER_MODES = ("per_tensor_ipc", "vllm_ipc", "vllm_ipc_packed")


def run_size(size: str, root: Path, args, compare_generation: bool) -> dict:
    t0 = time.time()
    model_dir = common.make_model(root, size, "bfloat16")
    # the earlier runs' engine shares: 0.25 beside a mixture of experts' trainer, 0.3 beside a dense one
    utilization = args.gpu_memory_utilization or (0.25 if common.SIZES[size].get("family") == "qwen3_moe" else 0.3)
    row: dict = {"size": size, "make_model_s": round(time.time() - t0, 1), "gpu_memory_utilization": utilization}
    common.run_ours(job_config(args.buffer_size), ("cuda_ipc",), size, model_dir, root, args, row, compare_generation,
                    gpu_memory_utilization=utilization, enforce_eager=args.eager)
    if not args.skip_baseline or args.peers:
        t0 = time.time()
        try:
            peer_session(model_dir, args, row, utilization)
        except Exception as exc:  # noqa: BLE001 - the peers failing must not lose our numbers
            row["peers_error"] = f"{type(exc).__name__}: {exc}"[:2000]
            print(f"[{size}] peers failed: {row['peers_error']}", flush=True)
        row["peers_s"] = round(time.time() - t0, 1)
    copies = common.device_copy_seconds(row["bytes"], args.repeats)
    out = common.size_row(row, copies, "device-to-device copy (bytes moved once)", ("cuda_ipc", *PEER_MODES))
    for mode in PEER_MODES:
        if mode in out and "cuda_ipc" in out:
            out[mode]["vs_ours"] = round(out[mode]["whole_seconds"] / out["cuda_ipc"]["whole_seconds"], 2)
    return out


def main(description: str = __doc__.splitlines()[0], sizes: tuple[str, ...] = ("4B", "8B"),
         gpu_memory_utilization: float | None = None, file_name: str = "colocate_h200.json", baseline: bool = True) -> int:
    """The colocated run (``moe_h200.py`` runs it with its own shape, file and defaults); ``baseline`` False:
    no per-tensor-handle baseline at all."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", nargs="+", default=list(sizes), choices=sorted(common.SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-size", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=gpu_memory_utilization,
                        help="the engines' share of the GPU (default: 0.25 beside a mixture of experts, else 0.3)")
    parser.add_argument("--eager", action="store_true",
                        help="our engine without CUDA graphs, as the peers' engines run")
    parser.add_argument("--commit", default=None, help="the commit measured (the device's copy has no .git)")
    if baseline:
        parser.add_argument("--peers", action="store_true",
                            help="add vLLM's own IPC engine, unpacked and packed (-> colocate_peers_h200.json)")
    parser.add_argument("--out", type=str, default=None)
    if baseline:
        parser.add_argument("--skip-baseline", action="store_true",
                            help="leave out the per-tensor-handle baseline (a profiling run of our path only)")
    parser.add_argument("--skip-generation", action="store_true",
                        help="leave out greedy generation against a fresh engine (another call ran it)")
    args = parser.parse_args()
    args.skip_baseline = getattr(args, "skip_baseline", False) or not baseline
    args.peers = getattr(args, "peers", False)
    if args.peers and file_name == "colocate_h200.json":
        file_name = "colocate_peers_h200.json"
    import torch

    if not torch.cuda.is_available():
        print(f"{file_name.removesuffix('.json')}: needs a CUDA GPU; nothing run")
        return 0
    os.environ.update(common.NVLS_OFF)
    common.export_path()

    results: dict = {"command": " ".join(["python3", *sys.argv]), "commit": args.commit, "gpus": common.gpu_names()[:1],
                     "versions": common.versions(), "sizes": []}
    modes = ("cuda_ipc",) + (() if args.skip_baseline else ("per_tensor_ipc",)) \
        + (("vllm_ipc", "vllm_ipc_packed") if args.peers else ())
    common.run_sizes(args, results, file_name, run_size, modes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
