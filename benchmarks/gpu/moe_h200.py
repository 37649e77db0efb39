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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from colocate_h200 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(__doc__.splitlines()[0], sizes=("30B-A3B-L4",), gpu_memory_utilization=0.25,
                  file_name="moe_h200.json", baseline=False))
