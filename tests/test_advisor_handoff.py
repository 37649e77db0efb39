"""The advisor counts the colocated hand-off (--offload-*) as part of a colocated step, and only there."""

import pytest

from rlplacement.advisor import ModelAssumptions, Placement, measure
from rlplacement.advisor.model import fit
from tests.test_advisor import synth


def test_a_measured_hand_off_stays_with_colocated_layouts_and_leaves_split_ones(tmp_path):
    rows = synth(tmp_path / "c.jsonl", trainer=8, rollout=8, colocate=True, R=4.0, S=0.1, T=4.0, handoff=2.0)
    m = measure(rows)
    assert m.handoff_time == pytest.approx(2.0)
    model = fit(m)
    assert model.other_time == pytest.approx(0.0, abs=1e-6)  # the hand-off is modelled, not left in "other"
    same = model.predict(Placement(True, 8, 8))
    assert same.handoff_time == pytest.approx(2.0) and same.step_time == pytest.approx(m.step_time)
    split = model.predict(Placement(False, 4, 4))
    assert split.handoff_time == 0.0
    assert split.to_json()["handoff_time"] == 0.0


def test_a_split_run_estimates_the_hand_off_of_colocating_from_the_weight_bytes(tmp_path):
    nbytes = 16e9  # an 8B model in bf16
    rows = synth(tmp_path / "s.jsonl", trainer=4, rollout=4, R=4.0, S=0.5, T=4.0, nbytes=nbytes)
    assert measure(rows).handoff_time is None
    a = ModelAssumptions()
    colocated = fit(measure(rows), a).predict(Placement(True, 8, 8))
    want = a.handoff_bytes_ratio * nbytes * 8 / (a.host_gbps * 1e9) / 8
    assert colocated.handoff_time == pytest.approx(want)  # 12 x 16 GB over ~54 GB/s, on each of 8 GPUs: 0.45 s
    slower_host = fit(measure(rows), ModelAssumptions(host_gbps=a.host_gbps / 4)).predict(Placement(True, 8, 8))
    assert slower_host.step_time - colocated.step_time == pytest.approx(3 * want)



def test_a_colocated_run_with_byte_counts_scales_only_the_moving_part_at_its_own_rate(tmp_path):
    """2 s of hand-off per step, of which 1.5 s moved 60 GB (40 GB/s): on twice the GPUs each moves half
    the bytes at the same rate, and the rest (sleep, wake, frees) stays: 0.5 + 0.75 s, not 2 / 2."""
    rows = synth(tmp_path / "c.jsonl", trainer=4, rollout=4, colocate=True, R=4.0, S=0.1, T=4.0, handoff=2.0)
    for r in rows:
        if "perf/handoff_to_train_time" in r:
            r.update({"perf/handoff_bytes_to_host": 30e9, "perf/handoff_bytes_to_device": 30e9,
                      "perf/handoff_trainer_offload_copy_time": 0.75, "perf/handoff_trainer_reload_time": 0.75,
                      "perf/handoff_engine_weight_bytes": 0.0})
    m = measure(rows)
    assert (m.handoff_bytes, m.handoff_move_time) == (pytest.approx(60e9), pytest.approx(1.5))
    model = fit(m)
    assert model.predict(Placement(True, 4, 4)).handoff_time == pytest.approx(2.0)  # the run itself
    assert model.predict(Placement(True, 8, 8)).handoff_time == pytest.approx(0.5 + 0.75)
    assert model.predict(Placement(True, 2, 2)).handoff_time == pytest.approx(0.5 + 3.0)


def test_a_colocated_run_that_needed_no_hand_off_predicts_none(tmp_path):
    """--no-offload-* (or a model that fits twice): the run measured colocated steps without a hand-off,
    so colocated candidates carry none either, whatever the weight bytes."""
    rows = synth(tmp_path / "c.jsonl", trainer=8, rollout=8, colocate=True, R=4.0, S=0.1, T=4.0, nbytes=16e9)
    m = measure(rows)
    assert m.handoff_time is None
    model = fit(m)
    assert model.predict(Placement(True, 4, 4)).handoff_time == 0.0
    assert model.predict(Placement(True, 8, 8)).step_time == pytest.approx(m.step_time)
