"""A run killed with SIGKILL (the driver, its Ray cluster, its engines and trainer: the whole process
session) and started again with the same ``--load`` and the same disk-delta folder goes on: the folder
left by the killed run (a pointer at a version above the checkpoint's, maybe a half-written version)
does not stop the resumed run's first update, which starts a new segment with a full base, and every
update after it is checked bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "WARNING"}


def _loop(work: Path, *flags: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--work-dir", str(work), *flags]


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the run's session (Ray's own processes and actors included), as an
    out-of-memory killer or a lost node would: nothing gets to clean up."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        if not left:
            return
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def _checkpoint_state(ckpt: Path) -> dict:
    saved = json.loads((ckpt / "latest_checkpointed_iteration.txt").read_text())
    return json.loads((ckpt / f"iter_{saved:07d}" / "trainer_state.json").read_text())


def _folder_ahead_of_checkpoint(ckpt: Path, disk: Path) -> bool:
    if not (ckpt / "latest_checkpointed_iteration.txt").exists() or not (disk / "latest").exists():
        return False
    return json.loads((disk / "latest").read_text())["version"] > _checkpoint_state(ckpt)["weight_version"]


def test_a_run_killed_with_sigkill_resumes_from_the_same_load_and_disk_delta_folder(tmp_path):
    ckpt, disk = tmp_path / "ckpt", tmp_path / "weights"
    common = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(disk),
              "--check-weight-update-equal", "--save", str(ckpt), "--prompts-per-step", "2"]
    first = subprocess.Popen(_loop(tmp_path / "a", "--steps", "200", "--save-interval", "2", *common),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT,
                             start_new_session=True)
    seen = []
    try:
        for line in first.stdout:  # killed once a checkpoint is published and an update went past it
            seen.append(line)
            if line.startswith("step ") and _folder_ahead_of_checkpoint(ckpt, disk):
                break
        else:
            pytest.fail("the first run ended before an update went past a checkpoint:\n" + "".join(seen[-40:]))
    finally:
        _kill_session(first)
    killed_at = json.loads((disk / "latest").read_text())
    state = _checkpoint_state(ckpt)
    assert killed_at["version"] > state["weight_version"]  # the folder is ahead of the checkpoint

    resumed = subprocess.run(_loop(tmp_path / "b", "--steps", "2", "--load", str(ckpt), "--hf-checkpoint",
                                   str(tmp_path / "a" / "model"), *common),
                             capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    steps = [line for line in resumed.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("checked" in line for line in steps), steps
    pointer = json.loads((disk / "latest").read_text())
    assert pointer["run_id"] == killed_at["run_id"]  # the same run, resumed
    assert pointer["epoch"] == killed_at["epoch"] + 1  # a new segment of the folder
    assert pointer["version"] == state["weight_version"] + 2  # the checkpoint's version, then two updates
