"""A start that talks: one line per start-up stage with its seconds, the first before Ray starts; one
verbosity setting (``--verbose [quiet|normal|info]``); the step line and telemetry say when weights were
checked."""

import argparse
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.console import StartLog
from rlplacement.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]


@pytest.mark.parametrize("argv, level", [([], "normal"), (["--verbose"], "info"), (["--verbose", "quiet"], "quiet"),
                                         (["--verbose", "info"], "info")])
def test_one_verbosity_setting(argv, level):
    rollout = config_from_args(build_parser().parse_args([*BASE, *argv])).rollout
    assert rollout.verbosity == level and rollout.verbose == (level == "info")


def test_a_foreign_switch_and_a_bad_level(capsys):
    ns = argparse.Namespace(rollout_num_gpus=1, actor_num_gpus_per_node=1, verbose=True)  # a parser's own switch
    assert config_from_args(ns).rollout.verbosity == "info"
    with pytest.raises(ConfigError, match=r"--verbose 'loud' is unknown: use one of quiet, normal, info"):
        config_from_args(argparse.Namespace(rollout_num_gpus=1, actor_num_gpus_per_node=1, verbose="loud"))
    with pytest.raises(SystemExit):
        build_parser().parse_args([*BASE, "--verbose", "loud"])
    assert "invalid choice: 'loud'" in capsys.readouterr().err


def test_stage_lines_say_their_seconds_and_quiet_says_nothing():
    out = io.StringIO()
    log = StartLog("normal", out)
    log.say("starting")
    log.stage("Ray up")
    log.done("ready")
    lines = out.getvalue().splitlines()
    assert lines[0] == "rlplacement: starting"
    assert re.fullmatch(r"rlplacement: Ray up \(\d+\.\d s\)", lines[1])
    assert re.fullmatch(r"rlplacement: ready after \d+\.\d s", lines[2])
    quiet = io.StringIO()
    StartLog("quiet", quiet).stage("Ray up")
    assert quiet.getvalue() == ""


@pytest.mark.slow  # a whole run of the example loop
def test_a_run_says_each_stage_before_its_steps_and_which_updates_were_checked(tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--work-dir", str(tmp_path),
                           "--steps", "1", "--train-backend", "fsdp", *BASE, "--check-weight-update-equal",
                           "--telemetry", str(tmp_path / "steps.jsonl")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = [line for line in proc.stderr.splitlines() if line.startswith("rlplacement: ")]
    assert stages[0].startswith("rlplacement: starting Ray and placing 1 trainer GPU(s) and 1 engine(s)")
    assert proc.stderr.lstrip().startswith(stages[0])  # the first thing the run prints, before Ray's own start
    for said in ("Ray up, placement group placed", "trainer built: fsdp on 1 rank(s)", "engine(s) loaded",
                 "weight transfer ready: broadcast, every update checked bit for bit", "ready after"):
        assert any(said in line for line in stages), (said, stages)
    assert re.search(r"step 0: .*\(1\.1 MB, v1\) checked  logprob", proc.stdout)
    row = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[0])
    assert row["perf/update_weights_checked"] == 1


@pytest.mark.slow  # a conversion and an export, each in a process of its own
def test_convert_and_export_show_progress_and_no_library_notices(tmp_path):
    from rlplacement.models.tiny import make_tiny_model

    hf = make_tiny_model(tmp_path / "hf")
    for argv, bar in ((["convert", "--hf-checkpoint", str(hf), "--save", str(tmp_path / "tp1")], "convert: 100%"),
                      (["export-hf", "--load", str(tmp_path / "tp1"), "--save", str(tmp_path / "back")], "export: ")):
        proc = subprocess.run([sys.executable, "-m", "rlplacement.cli", *argv], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert bar in proc.stderr
        assert "Warning" not in proc.stderr, proc.stderr  # megatron's Apex/TE fallbacks, torch's DTensor notice
