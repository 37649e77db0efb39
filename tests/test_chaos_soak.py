"""The chaos soak's short run (``benchmarks/chaos_soak.py``): every fault kind of disk-delta injected once
in 30 steps of real engines and a real trainer under --use-fault-tolerance, each recovered with every
invariant holding after every step (the soak exits non-zero naming the first violation)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def test_every_fault_kind_is_recovered_with_every_invariant_holding(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "chaos_soak.py"), "--steps", "30", "--faults", "7",
         "--warmup-steps", "2", "--update-weight-transfer-mode", "disk-delta", "--timeout", "12",
         "--rollout-health-check-timeout", "4", "--work-dir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "MC_LOG_LEVEL": "WARNING"})
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]  # the steps before, then the error
    result = json.loads(out.read_text())
    kinds = {row["kind"] for row in result["table"]}
    assert {"engine_killed_before_update", "engine_killed_during_update", "engine_killed_after_update",
            "receiver_stalled", "trainer_killed", "corrupted_delta_file"} <= kinds
    assert all(row["recovered"] == row["injected"] >= 1 for row in result["table"])
    assert len(result["rows"]) == 30 and sum(r["fault"] is not None for r in result["rows"]) == 7
    versions = [r["version"] for r in result["rows"]]
    assert versions == sorted(versions)
