"""The real tiny GRPO loop (examples/tiny_grpo.py) writes telemetry; the advisor reads it.

One run of the default layout (1 trainer GPU, 1 engine). If CI time is short, the same three
asserts can move into tests/test_tiny_grpo.py's run and this file can go.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlplacement.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_grpo.py"


@pytest.mark.slow
@pytest.mark.skipif(not TINY.exists(), reason="examples/tiny_grpo.py is not in this checkout")
def test_tiny_loop_telemetry_is_advisable(tmp_path, capsys):
    telemetry = tmp_path / "tel.jsonl"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(TINY), "--work-dir", str(tmp_path), "--steps", "2",
                           "--telemetry", str(telemetry)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = tmp_path / "tiny.png"
    assert cli_main(["advise", "--metrics", str(telemetry), "--json", "--plot", str(png)]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["current"] == {"colocate": False, "trainer_gpus": 1, "rollout_gpus": 1}
    assert advice["diagnosis"] in ("rollout-bound", "train-bound", "sync-bound", "long-tail", "balanced")
    rec = advice["recommended"]
    assert rec["colocate"] or rec["trainer_gpus"] + rec["rollout_gpus"] == 2
    assert advice["measured"]["steps"] == 1 and advice["measured"]["rollout_time"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
