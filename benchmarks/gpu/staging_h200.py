"""``--update-weight-staging full`` against ``bucket`` on one H200: what an update costs the engine worker
(update time, GPU memory, the staging it keeps, its process's resident peak) and whether both serve the
same bytes.

The engine is vLLM on GPU 0; the trainer's HF tensors are in host memory and go over gloo with
``broadcast_packed`` (a split layout on one GPU: NCCL cannot join two ranks on one GPU). So the staging
is host memory here and the GPU figure is the load path's own (vLLM's layerwise reload materialises a
layer at a time under ``bucket``); what this checks on the GPU is the bucketwise load itself on vLLM's
GPU build. In one job: the engine started for ``full``; the trainer's weights scaled once; then per
staging one checked update (checksums of every tensor on both sides), ``--repeats`` timed updates
(median), the worker's GPU peak over its resident memory before the update, the bytes its receiver
keeps, its process's resident peak over before (VmHWM, reset through /proc/self/clear_refs), and the
served parameters' checksums and greedy generation, compared between the two stagings (the same weights
sent twice).

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/staging_h200.py --size 8B --out $OUT --commit $(git rev-parse --short HEAD)
    python3 benchmarks/gpu/staging_h200.py --size smoke --repeats 1     # CPU: the plumbing only
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

BUCKET = 512 << 20


def host_trainer_class():
    from rlplacement.runtime.trainer_transfer import TrainerTransferMixin

    class HostTrainer(TrainerTransferMixin):
        """The model's HF tensors in host memory, sent as they are (a stand-in for a trainer's gathered stream)."""

        def __init__(self, model_dir: str):
            from safetensors.torch import load_file

            self.tensors = load_file(str(Path(model_dir) / "model.safetensors"))

        def hf_named_tensors(self):
            return iter(self.tensors.items())

        def scale(self, factor: float) -> None:
            for t in self.tensors.values():
                t.mul_(factor)

        def checksums(self) -> dict[str, str]:
            from rlplacement.transfer.base import tensor_checksum

            return {n: tensor_checksum(t) for n, t in self.tensors.items()}

        def nbytes(self) -> int:
            return sum(t.numel() * t.element_size() for t in self.tensors.values())

    return HostTrainer


def one_staging(staging: str, trainer, engine, version: int, args, row: dict) -> int:
    import ray

    from rlplacement.runtime import transfer_driver as driver

    ray.get(trainer.transfer_setup.remote("broadcast_packed", BUCKET, check_equal=True, timeout_s=600, device="cpu"))
    driver.connect(trainer, [engine], timeout_s=600, staging=staging)
    engine_rss = lambda: ray.get(engine.call_workers.remote("rlplacement_host_memory"))[0]  # noqa: E731
    ray.get(engine.gpu_memory.remote())  # resets the peak
    before, rss_before = ray.get(engine.gpu_memory.remote()), engine_rss()
    driver.run_update(trainer, [engine], version, timeout_s=900, check_equal=True)
    after, rss_after = ray.get(engine.gpu_memory.remote()), engine_rss()
    path = ray.get(engine.call_workers.remote("rlplacement_load_path"))[0]
    trainer_sums = ray.get(trainer.checksums.remote())
    row["checked_equal"] = ray.get(engine.received_checksums.remote()) == trainer_sums
    row["model_checksums"] = ray.get(engine.model_checksums.remote())
    row["greedy"] = common.greedy(engine, [[5, 6, 7, 8, 9], [11, 12, 13]])
    times = []
    for _ in range(args.repeats):
        ray.get(trainer.transfer_setup.remote("broadcast_packed", BUCKET, check_equal=False, timeout_s=600,
                                              device="cpu"))
        driver.connect(trainer, [engine], timeout_s=600, staging=staging)
        version += 1
        t0 = time.perf_counter()
        driver.run_update(trainer, [engine], version, timeout_s=900)
        times.append(time.perf_counter() - t0)
    row.update({"staging": staging, "path": path.get("path"), "receiver_staging_bytes": path.get("staging_bytes"),
                "copied_out": path.get("copied_out"), "update_seconds": times,
                "update_seconds_median": statistics.median(times) if times else None,
                "gpu_before": before, "gpu_after": after,
                "gpu_peak_over_resident_gb": (after.get("peak_gb", 0) - before.get("resident_gb", 0)) if after else None,
                "worker_rss_peak_over_before_mb": rss_after["peak_mb"] - rss_before["resident_mb"]})
    return version + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="8B", choices=sorted(common.SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--commit", default=os.environ.get("COMMIT", ""))
    args = parser.parse_args()
    common.export_path()
    import ray
    import torch

    from rlplacement.engines.ray_engines import create_engine_actor

    root = Path("/tmp/staging_models")
    model_dir = common.make_model(root, args.size, "bfloat16")
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=True)
    gpu = torch.cuda.is_available()
    trainer = ray.remote(host_trainer_class()).options(num_cpus=0).remote(str(model_dir))
    engine = create_engine_actor(0, str(model_dir), options={"num_gpus": 1 if gpu else 0, "num_cpus": 0},
                                 update_weight_staging="full", update_weight_buffer_size=BUCKET,
                                 engine_core_in_own_process=False if not gpu else None, enforce_eager=True)
    info = ray.get(engine.info.remote(), timeout=900)
    ray.get(trainer.scale.remote(1.0078125))  # one "optimizer step": every tensor changes
    results = {"command": " ".join(sys.argv), "commit": args.commit, "gpus": common.gpu_names() if gpu else [],
               "versions": common.versions(), "size": args.size, "bucket_bytes": BUCKET,
               "model_bytes": ray.get(trainer.nbytes.remote()), "engine": info, "rows": []}
    version = 1
    for staging in ("full", "bucket"):
        row: dict = {}
        try:
            version = one_staging(staging, trainer, engine, version, args, row)
        except Exception as exc:  # noqa: BLE001 - recorded in the results, then the next staging
            import traceback

            row.update({"staging": staging, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
            version += args.repeats + 1
        results["rows"].append(row)
    full, bucket = results["rows"]
    results["same_served_parameters"] = full.get("model_checksums") == bucket.get("model_checksums") is not None
    served = [[(g["token_ids"], g["logprobs"]) for g in r.get("greedy", [])] for r in (full, bucket)]
    results["same_greedy"] = bool(served[0]) and served[0] == served[1]  # tokens and log-probs, exactly
    for r in results["rows"]:
        r.pop("model_checksums", None)
        r["greedy_tokens"] = [g["token_ids"] for g in r.pop("greedy", [])]
    if full.get("update_seconds_median") and bucket.get("update_seconds_median"):
        results["bucket_over_full_time"] = bucket["update_seconds_median"] / full["update_seconds_median"]
    common.write(args.out, f"staging_h200{'_' + args.size if args.size != '8B' else ''}.json", results)
    print({k: v for k, v in results.items() if k not in ("engine",)})
    ray.shutdown()


if __name__ == "__main__":
    main()
