"""Experiment trackers: Miles' flags parse into TrackingConfig and bad ones are refused naming the flag; a real
offline W&B run and a real TensorBoard event file, both read back, hold every scalar of each row at its step;
the offline run reaches no host."""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.config import TrackingConfig
from rlplacement.errors import ConfigError
from rlplacement.telemetry import StepRecorder
from rlplacement.telemetry.trackers import Trackers, build_trackers, scalars

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ["--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4"]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args([*SPLIT, *argv])


def tracking(*argv: str, this_host: bool = True) -> TrackingConfig:
    return config_from_args(parse(*argv), this_host=this_host).tracking


def recorded_rows(trackers, steps: int = 3) -> list[dict]:
    """Rows of a split loop with a fake clock, made by a StepRecorder that was given ``trackers``."""
    now = [1000.0]
    tel = StepRecorder(None, trainer_gpus=4, rollout_gpus=4, rollout_gpus_per_engine=2, transfer_mode="broadcast",
                       max_response_len=64, group_size=4, clock=lambda: now[0], trackers=trackers)
    rows = []
    for step in range(steps):
        t = now[0]
        tel.record_interval("rollout", t, t + 2.0 + step)
        tel.record_samples([10 + step, 30, 50 + 2 * step], [1.0, 1.5 + step, 2.0 + step])
        tel.record_interval("train", t + 2.0 + step, t + 3.5 + step)
        tel.record_interval("sync", t + 3.5 + step, t + 3.75 + step)
        tel.record_logprobs([-1.0, -2.0], [-1.0 + 1e-3 * (step + 1), -2.0])
        now[0] = t + 4.0 + step
        rows.append(tel.end_step(step, reward=0.25 * step, transfer_transport="gloo",
                                 **{"perf/update_weights_bytes": 1_000_000 + step}))
    return rows


# ---- what a row becomes ----------------------------------------------------------------------------------
def test_every_scalar_is_kept_lists_are_summarised_and_the_rest_skipped():
    row = recorded_rows([], steps=1)[0]
    got = scalars(row)
    assert got["perf/step_time"] == pytest.approx(4.0) and got["perf/train_time"] == pytest.approx(1.5)
    assert got["reward"] == 0.0 and got["perf/update_weights_bytes"] == 1_000_000
    assert got["colocate"] == 0.0 and got["trainer_gpus"] == 4.0  # a bool as 0/1, the layout's numbers as they are
    assert (got["rollout/response_lengths/mean"], got["rollout/response_lengths/min"],
            got["rollout/response_lengths/max"]) == (30.0, 10.0, 50.0)
    assert got["rollout/sample_finish_times/max"] == 2.0
    skipped = {"step", "timeline", "transfer_mode", "transfer_transport", "rollout/response_lengths",
               "rollout/sample_finish_times", "perf/trainer_gpu_util", "perf/rollout_gpu_util",  # None on CPU
               "kv_cache_tokens", "max_num_seqs", "prompt_len", "offload_train", "offload_rollout"}  # not given: None
    summaries = {f"{k}/{s}" for k in ("rollout/response_lengths", "rollout/sample_finish_times")
                 for s in ("mean", "min", "max")}
    assert set(got) == (set(row) - skipped) | summaries


def test_lists_of_anything_but_numbers_and_empty_lists_are_skipped():
    got = scalars({"step": 3, "a": [], "b": [1, "x"], "c": [[1, 2], [3]], "d": {"e": 1}, "f": float("inf")})
    assert got == {"c/mean": 2.0, "c/min": 1.0, "c/max": 3.0, "f": float("inf")}


# ---- flags -----------------------------------------------------------------------------------------------
def test_no_tracker_by_default():
    assert tracking() == TrackingConfig()
    with build_trackers(TrackingConfig()) as trackers:
        assert len(trackers) == 0
        trackers.log(0, {"a": 1.0})  # nothing to log to, no error


def test_miles_flags_parse_into_the_config(monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    cfg = tracking("--use-wandb", "--wandb-mode", "offline", "--wandb-dir", "/runs/wb", "--wandb-project", "proj",
                   "--wandb-group", "grp", "--use-tensorboard", "--tb-project-name", "tbp",
                   "--tb-experiment-name", "e1")
    assert cfg == TrackingConfig(use_wandb=True, wandb_mode="offline", wandb_dir="/runs/wb", wandb_project="proj",
                                 wandb_group="grp", use_tensorboard=True, tb_project_name="tbp",
                                 tb_experiment_name="e1", tb_log_dir="tensorboard_log/tbp/e1")


def test_tensorboard_folder_is_picked_as_miles_picks_it(monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    before = datetime.datetime.now().replace(microsecond=0)
    cfg = tracking("--use-tensorboard", "--tb-project-name", "p")
    stamp = datetime.datetime.strptime(cfg.tb_experiment_name, "%Y%m%d_%H%M%S")  # unset: the time, recorded once
    assert before <= stamp <= datetime.datetime.now()
    assert cfg.tb_log_dir == f"tensorboard_log/p/{cfg.tb_experiment_name}"
    monkeypatch.setenv("TENSORBOARD_DIR", "/env/tb")  # Miles: TENSORBOARD_DIR, when set, is the folder
    assert tracking("--use-tensorboard").tb_log_dir == "/env/tb"
    assert tracking("--use-tensorboard", "--tb-project-name", "p", "--tb-experiment-name", "e").tb_log_dir == "/env/tb"


@pytest.mark.parametrize("argv, message", [
    (["--wandb-mode", "offline"], r"--wandb-mode offline configures a tracker that is off: add --use-wandb, or drop "
                                  r"--wandb-mode\."),
    (["--wandb-project", "p", "--wandb-group", "g"],
     r"--wandb-project p, --wandb-group g configure a tracker that is off: add --use-wandb, or drop --wandb-project "
     r"and --wandb-group"),
    (["--wandb-dir", "/x"], r"--wandb-dir /x configures .* add --use-wandb"),
    (["--tb-project-name", "p"], r"--tb-project-name p configures a tracker that is off: add --use-tensorboard"),
    (["--tb-experiment-name", "e"], r"--tb-experiment-name e configures .* add --use-tensorboard"),
    (["--use-tensorboard"], r"--use-tensorboard needs --tb-project-name .* or TENSORBOARD_DIR"),
])
def test_tracker_flags_that_cannot_take_effect_are_refused(argv, message, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with pytest.raises(ConfigError, match=message):
        tracking(*argv)


def test_a_wandb_mode_wandb_does_not_know_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse("--use-wandb", "--wandb-mode", "dryrun")
    assert "invalid choice: 'dryrun'" in capsys.readouterr().err
    foreign = argparse.Namespace(rollout_num_gpus=4, use_wandb=True, wandb_mode="dryrun")  # no argparse check
    with pytest.raises(ConfigError, match=r"--wandb-mode 'dryrun' is unknown: use one of online, offline, disabled"):
        config_from_args(foreign)


def test_use_wandb_without_wandb_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an import sees when the package is absent
    with pytest.raises(ConfigError, match=r"--use-wandb needs the wandb package, which is not installed: "
                                          r"pip install 'rlplacement\[trackers\]', or drop --use-wandb"):
        tracking("--use-wandb")
    with pytest.raises(ConfigError, match=r"rlplacement\[trackers\]"):  # a config built by hand: refused when built
        build_trackers(TrackingConfig(use_wandb=True))
    assert tracking("--use-wandb", this_host=False).use_wandb  # a plan made elsewhere does not read this machine


def test_use_tensorboard_without_a_writer_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"--use-tensorboard needs a TensorBoard writer and neither tensorboardX nor "
                                          r"tensorboard .* pip install 'rlplacement\[trackers\]' \(tensorboardX\)"):
        tracking("--use-tensorboard", "--tb-project-name", "p")
    monkeypatch.delitem(sys.modules, "tensorboard")  # torch's writer is enough
    assert tracking("--use-tensorboard", "--tb-project-name", "p").use_tensorboard


def test_a_hand_built_config_needs_the_tensorboard_folder():
    with pytest.raises(ConfigError, match="use_tensorboard needs tb_log_dir"):
        TrackingConfig(use_tensorboard=True)


# ---- trackers --------------------------------------------------------------------------------------------
class _Fake:
    def __init__(self, fail_close=False):
        self.logged, self.closed, self.fail_close = [], False, fail_close

    def log(self, step, row):
        self.logged.append((step, row))

    def close(self):
        self.closed = True
        if self.fail_close:
            raise RuntimeError("close failed")


def test_step_recorder_gives_every_row_to_every_tracker():
    a, b = _Fake(), _Fake()
    rows = recorded_rows(Trackers([a, b]))
    assert a.logged == b.logged == [(i, row) for i, row in enumerate(rows)]


def test_trackers_close_each_though_one_fails():
    a, b = _Fake(fail_close=True), _Fake()
    with pytest.raises(RuntimeError, match="close failed"):
        with Trackers([a, b]):
            pass
    assert a.closed and b.closed


def _read_wandb_history(path) -> tuple[dict[int, dict], list]:
    """The history rows of a ``.wandb`` file by step, and its run records, read with wandb's own record schema.

    The file is wandb's transaction log (what ``wandb sync`` uploads): a header (``:W&B``, magic 0xBEE1,
    version 0), then LevelDB-log records in 32 KiB blocks (crc32c, length, type: full, first, middle,
    last), each a serialized ``wandb_internal_pb2.Record``. wandb 0.31 reads it only in its Go core."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, whole, part = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            whole.append(chunk)
        elif kind in (2, 3):
            part = (b"" if kind == 2 else part) + chunk
        elif kind == 4:
            whole.append(part + chunk)
    history, runs = {}, []
    for raw in whole:
        record = wandb_internal_pb2.Record.FromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif record.WhichOneof("record_type") == "run":
            runs.append(record.run)
    return history, runs


# A run in its own process, so that what wandb does at exit counts too (its usage telemetry was sent then): the
# process records every host name it resolves (wandb-core talks to it over a Unix socket, so an offline run
# resolves none), builds the trackers from the flags given after the folder, and writes the rows it logged.
RUN = r"""
import json, socket, sys
out, real = sys.argv[1], socket.getaddrinfo

def spy(host, *args, **kwargs):
    with open(out + "/lookups.txt", "a") as f:  # at once: a lookup at exit is written too
        f.write(f"{host}\n")
    return real(host, *args, **kwargs)

socket.getaddrinfo = spy
from rlplacement.args import build_parser, config_from_args
from rlplacement.telemetry.trackers import build_trackers
from tests.test_trackers import SPLIT, recorded_rows

cfg = config_from_args(build_parser().parse_args([*SPLIT, *sys.argv[2:]])).tracking
with build_trackers(cfg, run_config={"tracking": cfg, "steps": 3}) as trackers:
    rows = recorded_rows(trackers)
with open(out + "/rows.json", "w") as f:
    json.dump(rows, f)
"""


def run_alone(tmp_path, *argv: str) -> list[dict]:
    """Run RUN with ``argv`` as flags and no W&B credentials or settings of this machine's (a run that tried to
    log in would fail); the rows it logged. Fails if the process resolved any host name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), *argv], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lookups = tmp_path / "lookups.txt"
    assert not lookups.exists(), f"resolved {lookups.read_text().split()}"  # wandb 0.31's telemetry, before the fix
    return json.loads((tmp_path / "rows.json").read_text())


def test_offline_wandb_run_holds_every_scalar_per_step_and_reaches_no_host(tmp_path):
    rows = run_alone(tmp_path, "--use-wandb", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path / "wb"),
                     "--wandb-project", "rlp-test", "--wandb-group", "trackers")
    (path,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    history, runs = _read_wandb_history(path)
    assert sorted(history) == [0, 1, 2]
    for step, row in enumerate(rows):
        want = scalars(row)
        assert set(history[step]) == set(want), step
        assert history[step] == pytest.approx(want), step
    assert history[2]["perf/step_time"] == pytest.approx(6.0) and history[1]["rollout/response_lengths/max"] == 52
    assert runs and runs[0].project == "rlp-test" and runs[0].run_group == "trackers"
    stored = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert stored["steps"] == 3 and stored["tracking"]["wandb_mode"] == "offline"  # the config, dataclasses as dicts


def test_disabled_wandb_writes_nothing_and_reaches_no_host(tmp_path):
    rows = run_alone(tmp_path, "--use-wandb", "--wandb-mode", "disabled", "--wandb-dir", str(tmp_path / "wb"))
    assert len(rows) == 3 and not glob.glob(str(tmp_path / "wb" / "**" / "*.wandb"), recursive=True)


@pytest.mark.parametrize("writer", ["tensorboardX", "torch"])
def test_tensorboard_event_file_holds_every_scalar_per_step(tmp_path, monkeypatch, writer):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlplacement.telemetry.trackers import TensorBoardTracker

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = tracking("--use-tensorboard")
    with Trackers([TensorBoardTracker(cfg.tb_log_dir, writer=writer)]) as trackers:
        rows = recorded_rows(trackers)
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    want = [scalars(row) for row in rows]
    assert set(events.Tags()["scalars"]) == set(want[0])
    for tag in want[0]:
        logged = events.Scalars(tag)
        assert [e.step for e in logged] == [0, 1, 2], tag
        assert [e.value for e in logged] == pytest.approx([w[tag] for w in want], rel=1e-6), tag  # float32 on disk


def test_tensorboard_tracker_from_the_config_writes_where_the_config_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    cfg = tracking("--use-tensorboard", "--tb-project-name", "p", "--tb-experiment-name", "e")
    with build_trackers(cfg) as trackers:
        recorded_rows(trackers, steps=1)
    assert glob.glob(str(tmp_path / "tensorboard_log" / "p" / "e" / "events.out.tfevents.*"))
