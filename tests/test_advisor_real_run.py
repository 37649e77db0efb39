"""A real short run (the stub loop: two processes, real matmuls, a real gloo broadcast) read by the advisor.

The stub stands in for examples/tiny_grpo.py until that exists; see benchmarks/stub_loop.py.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.stub_loop import StubConfig, run
from rlplacement.cli import main as cli_main
from rlplacement.telemetry import read_rows

CONTRACT = ("step", "perf/step_time", "perf/rollout_time", "perf/update_weights_time", "perf/train_time",
            "perf/train_wait_time", "perf/rollout_wait_time", "rollout/response_lengths",
            "rollout/logprob_abs_diff", "rollout/sample_finish_times", "trainer_gpus", "rollout_gpus",
            "rollout_gpus_per_engine", "colocate")


@pytest.mark.slow  # ~10 s idle, ~30 s on a loaded 2-core machine (process spawn, torch import, gloo)
def test_stub_run_one_step_off_then_advise(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    cfg = StubConfig(4, 4, steps=3, samples=16, mean_len=12, max_len=48, sync_mb=4, rows_per_token=16,
                     overhead_rows=64, train_rows_per_token=48)
    rows = run(cfg, path)
    assert read_rows(path) == json.loads(json.dumps(rows))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert set(CONTRACT) <= set(row)
        assert row["perf/update_weights_time"] > 0 and row["perf/train_time"] > 0
        assert len(row["rollout/sample_finish_times"]) == len(row["rollout/response_lengths"]) > 0
        assert row["perf/trainer_gpu_util"] is None  # CPU: absent, not zero
        # the trainer's phases never overlap each other, so its timeline adds up exactly
        assert row["perf/train_time"] + row["perf/update_weights_time"] + row["perf/train_wait_time"] == \
            pytest.approx(row["perf/step_time"], abs=1e-6)
    png = tmp_path / "p.png"
    assert cli_main(["advise", "--metrics", str(path), "--json", "--plot", str(png)]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["measured"]["overlapped"] is True  # one-step-off seen in the timeline
    rec = advice["recommended"]
    assert rec["colocate"] or (rec["trainer_gpus"] + rec["rollout_gpus"] == 8 and rec["rollout_gpus"] % 2 == 0)
    # the recommendation is the current layout or the candidate the advisor's model predicts fastest
    best = min(advice["candidates"], key=lambda c: c["predicted_step_time"])
    recommended = {k: rec[k] for k in ("colocate", "trainer_gpus", "rollout_gpus")}
    assert recommended in ({k: best[k] for k in recommended}, advice["current"])
    assert advice["predicted_step_time"]["recommended"] <= advice["predicted_step_time"]["current"] + 1e-9
    assert png.stat().st_size > 10_000
