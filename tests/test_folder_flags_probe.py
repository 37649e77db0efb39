"""Folder flags are checked by creating a file there, not by asking ``os.access``, which answers yes to root
(containers and CI run as root) for any folder: ``/proc`` takes no new file, whoever asks. Every folder
flag is refused at config time naming the flag: --save, --update-weight-disk-dir, `convert --save`, the
trackers' folders and the example's --telemetry."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.atomic_files import check_writable
from rlplacement.errors import ConfigError

BASE = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
UNWRITABLE = "/proc/rlplacement-probe"  # /proc exists and takes no new file, also for root
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_grpo.py"


def test_a_folder_that_takes_no_file_is_refused_whoever_asks():
    with pytest.raises(ConfigError, match=rf"--save {UNWRITABLE}: /proc is not writable by this user"):
        check_writable(UNWRITABLE, "--save")


def test_the_probe_leaves_nothing_behind_and_creates_no_folder(tmp_path):
    check_writable(str(tmp_path / "new" / "ckpt"), "--save")
    check_writable(str(tmp_path), "--save")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--save", UNWRITABLE], rf"--save {UNWRITABLE}: /proc is not writable"),
    (["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", UNWRITABLE],
     rf"--update-weight-disk-dir {UNWRITABLE}: /proc is not writable"),
    (["--use-wandb", "--wandb-mode", "offline", "--wandb-dir", UNWRITABLE],
     rf"--wandb-dir {UNWRITABLE}: /proc is not writable"),
])
def test_every_folder_flag_is_refused_at_config_time(argv, message):
    if "--use-wandb" in argv:
        pytest.importorskip("wandb")
    with pytest.raises(ConfigError, match=message):
        config_from_args(build_parser().parse_args([*BASE, *argv]))


def test_a_tensorboard_folder_that_takes_no_file_is_refused(monkeypatch):
    pytest.importorskip("tensorboardX")
    monkeypatch.setenv("TENSORBOARD_DIR", UNWRITABLE)
    with pytest.raises(ConfigError, match=rf"TENSORBOARD_DIR {UNWRITABLE}: /proc is not writable"):
        config_from_args(build_parser().parse_args([*BASE, "--use-tensorboard"]))


def test_convert_and_the_example_refuse_such_a_folder_before_starting(tmp_path):
    from rlplacement.models.tiny import make_tiny_model

    hf = make_tiny_model(tmp_path / "model")
    out = subprocess.run([sys.executable, "-m", "rlplacement.cli", "convert", "--hf-checkpoint", str(hf), "--save",
                          UNWRITABLE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--save {UNWRITABLE}: /proc is not writable" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, str(EXAMPLE), "--hf-checkpoint", str(hf), "--telemetry",
                          f"{UNWRITABLE}/rows.jsonl"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"--telemetry {UNWRITABLE}/rows.jsonl: its folder" in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "starting Ray" not in out.stderr
