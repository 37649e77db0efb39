"""A mixture-of-experts model colocated on one GPU: Qwen3-30B-A3B's layer at reduced depth (128 experts of
768, top-8, hidden 2048, the real vocabulary; ``common.SIZES["30B-A3B-L4"]``), an FSDP trainer (transformers'
MoE blocks) and a bf16 vLLM engine on GPU 0 under ``--colocate``. Our ``cuda_ipc`` update as the loop sees it
(one checked bit for bit against the trainer's checksums, then timed ones) against the ceiling of the same
run, one device-to-device copy of the same bytes; then greedy generation of the updated engine against a
fresh engine started from the trainer's saved weights (vLLM may prepare experts only at load: parameter
checksums alone would not see a kernel that reads them in another layout).

    source benchmarks/gpu/device_env.sh
    python3 benchmarks/gpu/moe_h200.py --out $OUT   # -> moe_h200.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from colocate_h200 import job_config  # noqa: E402


def run_size(size: str, root: Path, args, compare_generation: bool) -> dict:
    t0 = time.time()
    model_dir = common.make_model(root, size, "bfloat16")
    row: dict = {"size": size, "make_model_s": round(time.time() - t0, 1)}
    common.run_ours(job_config(args.buffer_size), ("cuda_ipc",), size, model_dir, root, args, row, compare_generation,
                    gpu_memory_utilization=args.gpu_memory_utilization)
    copies = common.device_copy_seconds(row["bytes"], args.repeats)
    return common.size_row(row, copies, "device-to-device copy (bytes moved once)", ("cuda_ipc",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["30B-A3B-L4"], choices=sorted(common.SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--buffer-size", type=int, default=512 * 1024 * 1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("moe_h200: needs a CUDA GPU; nothing run")
        return 0
    os.environ.update(common.NVLS_OFF)
    common.export_path()
    results: dict = {"command": " ".join(["python3", *sys.argv]), "gpus": common.gpu_names()[:1],
                     "versions": common.versions(), "sizes": []}
    common.run_sizes(args, results, "moe_h200.json", run_size, ("cuda_ipc",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
