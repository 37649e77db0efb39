"""The advisor's prediction of step time and staleness for sync, one-step-off and fully async
(``rlplacement.advisor.asynchrony``): the composition on made-up inputs whose answer is known, and the
prediction held against the CPU runs committed in ``benchmarks/results/fully_async_cpu``."""

from pathlib import Path

import pytest

from rlplacement.advisor import asynchrony as A
from rlplacement.cli import main as cli_main
from rlplacement.telemetry.jsonl import read_rows

RUNS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "fully_async_cpu"


def _inputs(sample_time: float, train: float, update: float, steps: int = 4) -> A.AsyncInputs:
    """Two prompts of four samples a step, every sample taking ``sample_time``."""
    return A.AsyncInputs(tuple((sample_time,) * 8 for _ in range(steps)), train, update, 4)


def test_sync_and_one_step_off_compose_the_phases():
    x = _inputs(1.0, 0.4, 0.1)
    assert A.predict(x, "sync").step_time == pytest.approx(1.5)
    off = A.predict(x, "one-step-off")
    assert off.step_time == pytest.approx(1.1) and off.max_staleness == 1 and off.train_wait_time == pytest.approx(0.6)


def test_training_during_rollout_trains_each_group_once_ready_and_the_trainer_is_free():
    """Two groups of four: one ready at 0.2 s, one at 1.0 s (the tail); training takes 0.4 s a step, 0.2 s a
    group. The first group trains 0.2-0.4 while the tail decodes, the second 1.0-1.2, the update to 1.3: a step
    of 1.3 s against sync's 1.5, with staleness 0. When every group ends together it is sync's step."""
    tail = A.AsyncInputs(tuple((0.1, 0.2, 0.2, 0.2, 0.5, 0.5, 0.5, 1.0) for _ in range(3)), 0.4, 0.1, 4)
    during = A.predict(tail, "train-during-rollout")
    assert during.step_time == pytest.approx(1.3) and during.train_wait_time == pytest.approx(0.8)
    assert (during.mean_staleness, during.max_staleness) == (0.0, 0)
    assert A.predict(tail, "sync").step_time == pytest.approx(1.5)
    assert A.timeline(tail, "train-during-rollout", steps=1)["trainer"] == [
        ("train", pytest.approx(0.2), pytest.approx(0.4)), ("train", 1.0, pytest.approx(1.2)),
        ("sync", pytest.approx(1.2), pytest.approx(1.3))]
    assert A.predict(_inputs(1.0, 0.4, 0.1), "train-during-rollout").step_time == pytest.approx(1.5)
    # on-policy (fully async at bound 0 recycles its stale groups, so it is left out here): it beats sync, and
    # one-step-off (1.1 s) is one version stale
    on_policy = [p for p in A.predict_modes(tail, max_staleness=0) if p.mode != "fully-async"]
    best, flags = A.recommend_mode(on_policy, 0)
    assert best.mode == "train-during-rollout" and flags == "--train-during-rollout"
    best, flags = A.recommend_mode(on_policy, 0, colocate=True)
    assert flags == "--train-during-rollout --no-offload-train --no-offload-rollout"
    fast_rollout = A.predict_modes(_inputs(1.0, 0.4, 0.1), max_staleness=2)  # fully async wins, one version stale
    assert A.recommend_mode(fast_rollout, 2, colocate=True) == (
        next(p for p in fast_rollout if p.mode == "fully-async"),
        "--fully-async --partial-rollout --use-tis --max-weight-staleness 2 --no-offload-train --no-offload-rollout")
    assert A.recommend_mode(A.predict_modes(_inputs(1.0, 0.4, 0.1)), 0)[0].mode == "sync"  # a tie goes to sync


def test_training_beside_generation_on_a_shared_gpu_delays_the_tail_by_the_overlap_slowdown():
    """The two-group step above on one GPU: the first group's 0.2 s of training runs while the tail decodes,
    so at slowdown s the tail is ready 0.2 s x s later and the step grows by as much (1.3 s at 0, 1.4 s at
    0.5, sync's 1.5 s at 1: a GPU that serves one side at a time gains nothing). The slowdown is read back
    from a pair of runs: rollout 1.1 s against sync's 1.0 s with 0.2 s of training inside it is 0.5."""
    tail = A.AsyncInputs(tuple((0.1, 0.2, 0.2, 0.2, 0.5, 0.5, 0.5, 1.0) for _ in range(3)), 0.4, 0.1, 4)
    steps = [A.predict(tail, "train-during-rollout", overlap_slowdown=s).step_time for s in (0.0, 0.5, 1.0)]
    assert steps == [pytest.approx(1.3), pytest.approx(1.4), pytest.approx(1.5)]
    sync = [{"step": k, "perf/rollout_time": 1.0} for k in range(4)]
    flag = [{"step": k, "perf/rollout_time": 1.1, "perf/train_overlap_time": 0.2} for k in range(4)]
    assert A.measured_overlap_slowdown(sync, flag) == pytest.approx(0.5)
    assert A.measured_overlap_slowdown(sync, [{**r, "perf/train_overlap_time": 0.0} for r in flag]) == 0.0


def test_fully_async_with_slow_rollout_runs_two_steps_of_generation_at_once():
    """Rollout-bound: two steps' samples generate at once (the default bound), so a step takes half a
    rollout, and the trainer's idle is that minus its own work."""
    p = A.predict(_inputs(1.0, 0.1, 0.05), "fully-async")
    assert p.step_time == pytest.approx(0.5, rel=0.02)
    assert p.train_wait_time == pytest.approx(0.35, rel=0.05)


def test_fully_async_with_fast_rollout_is_train_bound_and_two_versions_stale():
    """Train-bound: a step is the train and update time; the groups trained were started two updates before
    (generation runs ahead by the two steps it may hold), so a bound of 1 recycles every one of them."""
    p = A.predict(_inputs(0.01, 0.4, 0.1), "fully-async")
    assert p.step_time == pytest.approx(0.5, rel=0.01) and p.train_wait_time == pytest.approx(0.0, abs=1e-9)
    assert (p.mean_staleness, p.max_staleness) == (2.0, 2)
    assert A.predict(_inputs(0.01, 0.4, 0.1), "fully-async", max_concurrent=8).max_staleness == 1
    bounded = A.predict(_inputs(0.01, 0.4, 0.1), "fully-async", max_staleness=1)
    assert bounded.max_staleness <= 1 and bounded.stale_groups_filtered_per_step > 0


def test_the_fastest_mode_within_the_bound_is_recommended_with_its_flags():
    table = A.predict_modes(_inputs(1.0, 0.4, 0.1), max_staleness=2)
    best, flags = A.recommend_mode(table, 2)
    assert best.mode == "fully-async" and "--fully-async" in flags and "--max-weight-staleness 2" in flags
    best, flags = A.recommend_mode(table, 0)
    assert best.mode == "sync" and flags == ""


def test_prediction_against_the_committed_cpu_runs():
    """From the sync run alone: its own step is reproduced; one-step-off's step within 20% and its staleness
    exactly; fully async's staleness bound held (its step time is not within 20% on this 2-core host: the
    docs say which terms are off)."""
    rows = read_rows(RUNS / "sync.jsonl")
    x = A.inputs_from_rows(rows)
    other = A.measured(rows)["step_time"] - A.predict(x, "sync").step_time  # driver time, as `advise --modes`
    table = {p.mode: p for p in A.predict_modes(x, other=other)}
    for mode, name, rel in (("sync", "sync", 0.05), ("one-step-off", "one_step_off", 0.2)):
        predicted, measured = table[mode], A.measured(read_rows(RUNS / f"{name}.jsonl"))
        assert predicted.step_time == pytest.approx(measured["step_time"], rel=rel), (mode, predicted, measured)
        assert predicted.max_staleness == measured["max_staleness"]
    fully = A.predict(x, "fully-async", max_staleness=2)
    assert fully.max_staleness == A.measured(read_rows(RUNS / "fully_async.jsonl"))["max_staleness"] == 2


def test_advise_modes_prints_each_mode_and_refuses_rows_without_finish_times(capsys):
    assert cli_main(["advise", "--metrics", str(RUNS / "sync.jsonl"), "--modes"]) == 0
    out = capsys.readouterr().out
    assert "fully-async" in out and "recommended mode: fully-async" in out
    assert cli_main(["advise", "--metrics", str(RUNS / "fully_async.jsonl"), "--modes"]) != 0
    assert "--modes: the rows have no rollout/sample_finish_times" in capsys.readouterr().err


def test_predicted_timelines_show_each_modes_bubbles(tmp_path, capsys):
    """Sync alternates (rollout, then train and update); one-step-off trains while the next batch generates;
    fully async trains back to back when generation keeps up. ``advise --modes --plot`` draws them."""
    x = _inputs(1.0, 0.4, 0.1)
    sync = A.timeline(x, "sync", steps=2)
    assert sync["rollout"] == [("rollout", 0.0, 1.0), ("rollout", 1.5, 2.5)]
    assert sync["trainer"][:2] == [("train", 1.0, 1.4), ("sync", 1.4, pytest.approx(1.5))]
    off = A.timeline(x, "one-step-off", steps=2)
    assert off["trainer"][0] == ("train", 1.0, 1.4) and off["rollout"][1] == ("rollout", 1.0, 2.0)
    fast = A.timeline(_inputs(0.01, 0.4, 0.1), "fully-async", steps=3)
    trains = [(s, e) for phase, s, e in fast["trainer"] if phase == "train"]
    assert len(trains) == 3 and all(b[0] == pytest.approx(a[1] + 0.1) for a, b in zip(trains, trains[1:]))
    assert cli_main(["advise", "--metrics", str(RUNS / "sync.jsonl"), "--modes", "--plot",
                     str(tmp_path / "advice.png")]) == 0
    assert (tmp_path / "advice_modes.png").stat().st_size > 10_000
