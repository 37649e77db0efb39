"""Step telemetry: phase times, waits derived from intervals in each loop shape, the JSONL row."""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing as mp
import time

import pytest

from rlplacement.telemetry import RunLayout, StepRecorder, quantile, read_rows, union_length
from rlplacement.telemetry import gpu_util

CONTRACT = ("step", "perf/step_time", "perf/rollout_time", "perf/update_weights_time", "perf/train_time",
            "perf/train_wait_time", "perf/rollout_wait_time", "rollout/response_lengths",
            "rollout/logprob_abs_diff", "rollout/sample_finish_times", "perf/trainer_gpu_util",
            "perf/rollout_gpu_util", "trainer_gpus", "rollout_gpus", "rollout_gpus_per_engine", "colocate")


def _rec(path=None, **kw):
    layout = dict(trainer_gpus=4, rollout_gpus=4, rollout_gpus_per_engine=2, colocate=False)
    layout.update(kw)
    return StepRecorder(path, **layout)


def test_union_length_counts_overlaps_once_and_clips():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(0, 2), (1, 3), (5, 6)], lo=1.5, hi=5.5) == 2.0
    assert union_length([]) == 0


def test_colocated_sequential_step():
    tel = _rec(colocate=True, rollout_gpus=4)
    tel.record_interval("rollout", 100.0, 103.0)
    tel.record_interval("sync", 103.0, 103.5)
    tel.record_interval("train", 103.5, 105.5)
    row = tel.end_step(0, end=105.5)
    assert row["perf/step_time"] == pytest.approx(5.5)
    assert row["perf/rollout_time"] == pytest.approx(3.0)
    assert row["perf/update_weights_time"] == pytest.approx(0.5)
    assert row["perf/train_time"] == pytest.approx(2.0)
    assert row["perf/train_wait_time"] == pytest.approx(3.0)   # trainer idle during rollout
    assert row["perf/rollout_wait_time"] == pytest.approx(2.0)  # engines idle during training
    # sync occupies both roles, so the trainer's timeline adds up to the step
    assert row["perf/train_time"] + row["perf/update_weights_time"] + row["perf/train_wait_time"] == \
        pytest.approx(row["perf/step_time"])
    assert row["timeline"]["intervals"][0] == ["rollout", "rollout", 0.0, 3.0]


def test_training_during_the_rollout_is_reported_as_overlap_and_none_in_a_sequential_step():
    """Chunks trained at 2-3 and 5-6 s while the rollout ran 0-10 s, the last chunk and the step after it:
    2 s of overlap, taken off the trainer's wait. A sequential step has none."""
    tel = _rec()
    tel.record_interval("rollout", 100.0, 110.0)
    for start, end in ((102.0, 103.0), (105.0, 106.0), (110.0, 111.0)):
        tel.record_interval("train", start, end)
    tel.record_interval("sync", 111.0, 111.5)
    row = tel.end_step(0, end=111.5)
    assert row["perf/train_overlap_time"] == pytest.approx(2.0)
    assert row["perf/train_wait_time"] == pytest.approx(111.5 - 100.0 - 3.0 - 0.5)
    tel.record_interval("rollout", 111.5, 114.0)
    tel.record_interval("train", 114.0, 115.0)
    assert tel.end_step(1, end=115.0)["perf/train_overlap_time"] == 0.0


def test_parallel_engines_count_rollout_wall_time_once():
    tel = _rec()
    tel.record_interval("rollout", 0.0, 2.0)
    tel.record_interval("rollout", 0.0, 3.0)
    tel.record_interval("train", 3.0, 4.0)
    row = tel.end_step(0, end=4.0)
    assert row["perf/rollout_time"] == 3.0
    assert row["perf/rollout_wait_time"] == 1.0


def test_one_step_off_async_waits_and_attribution():
    """Rollout k+1 runs during train k; open intervals straddle step boundaries."""
    tel = _rec()
    h = tel.open("rollout", start=0.0)
    # step 0: wait for rollout 0 (4 s), sync 1 s, rollout 1 starts and runs 5 s, training 3 s
    tel.close(h, end=4.0)
    tel.record_interval("sync", 4.0, 5.0)
    h = tel.open("rollout", start=5.0)
    tel.record_interval("train", 5.0, 8.0)
    r0 = tel.end_step(0, end=8.0)
    assert r0["perf/step_time"] == 8.0
    assert r0["perf/rollout_time"] == 4.0
    assert r0["perf/train_wait_time"] == 4.0        # waited for the first batch
    assert r0["perf/rollout_wait_time"] == 0.0      # rollout 1 still running at step end
    # step 1: rollout 1 ends at 10 (trainer idle 8..10), sync 10..11, rollout 2 from 11 to 13, train 11..14
    tel.close(h, end=10.0)
    tel.record_interval("sync", 10.0, 11.0)
    h = tel.open("rollout", start=11.0)
    tel.record_interval("train", 11.0, 14.0)
    tel.close(h, end=13.0)  # a short rollout: engines idle 13..14
    r1 = tel.end_step(1, end=14.0)
    assert r1["perf/step_time"] == 6.0
    assert r1["perf/rollout_time"] == pytest.approx(5.0 + 2.0)  # rollout 1 whole (5 s) + rollout 2 (2 s)
    assert r1["perf/train_wait_time"] == 2.0
    assert r1["perf/rollout_wait_time"] == 1.0
    assert r1["perf/train_time"] == 3.0
    assert r1["timeline"]["step_start"] == 8.0


def test_split_synchronous_both_roles_wait():
    tel = _rec()
    tel.record_interval("rollout", 0.0, 2.0)
    tel.record_interval("sync", 2.0, 2.5)
    tel.record_interval("train", 2.5, 5.5)
    row = tel.end_step(0, end=5.5)
    assert (row["perf/train_wait_time"], row["perf/rollout_wait_time"]) == (2.0, 3.0)


def test_row_written_equals_returned_and_has_contract_names(tmp_path):
    path = tmp_path / "t.jsonl"
    tel = _rec(path, num_gpus_per_node=8, transfer_mode="broadcast", max_response_len=64, group_size=4)
    for step in range(2):
        with tel.phase("rollout"):
            time.sleep(0.01)
        tel.record_samples([3, 5, 7], [0.1, 0.2, 0.3])
        with tel.phase("sync"):
            pass
        with tel.phase("train"):
            time.sleep(0.02)
        tel.record_logprobs([[-1.0, -2.0], [-0.5]], [[-1.25, -2.0], [-0.75]])
        row = tel.end_step(step, reward=0.5)
    rows = read_rows(path)
    assert len(rows) == 2
    assert rows[-1] == json.loads(json.dumps(row))
    assert set(CONTRACT) <= set(row)
    assert row["rollout/response_lengths"] == [3, 5, 7]
    assert row["rollout/sample_finish_times"] == [0.1, 0.2, 0.3]
    assert row["rollout/logprob_abs_diff"] == pytest.approx(0.5 / 3)
    assert row["rollout/logprob_abs_diff_max"] == 0.25
    assert row["reward"] == 0.5 and row["transfer_mode"] == "broadcast" and row["group_size"] == 4
    assert row["perf/train_time"] >= 0.02 and row["perf/rollout_time"] >= 0.01
    # per-step state was reset
    assert rows[0]["rollout/response_lengths"] == [3, 5, 7]


def test_logprobs_accept_tensors():
    torch = pytest.importorskip("torch")
    tel = _rec()
    tel.record_logprobs(torch.tensor([-1.0, -3.0]), torch.tensor([-1.5, -3.0]))
    row = tel.end_step(0, end=0.0)
    assert row["rollout/logprob_abs_diff"] == 0.25 and row["rollout/logprob_abs_diff_max"] == 0.5


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_has_cuda(), reason="checks the CPU path: a GPU is present")
def test_gpu_util_absent_on_cpu_and_weighted_when_reported():
    assert not gpu_util.nvml_available()  # no NVML library/driver here
    tel = _rec(gpu_devices={"trainer": [0]})
    with tel.phase("train"):
        pass
    tel.record_interval("rollout", 0.0, 1.0, gpu_util=90.0)
    tel.record_interval("rollout", 1.0, 4.0, gpu_util=10.0)
    row = tel.end_step(0)
    assert row["perf/trainer_gpu_util"] is None
    assert row["perf/rollout_gpu_util"] == pytest.approx((90 + 30) / 4)


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU")
def test_gpu_util_sampled_inside_the_phase_on_a_gpu():
    """Busy inside the train phase, idle inside the rollout phase: per-phase sampling tells them apart."""
    import torch

    assert gpu_util.nvml_available()
    tel = _rec(gpu_devices={"trainer": [0], "rollout": [0]})
    x = torch.randn(8192, 8192, device="cuda:0")
    with tel.phase("train"):
        t = time.time()
        while time.time() - t < 1.0:
            for _ in range(20):
                x @ x
            torch.cuda.synchronize()
    with tel.phase("rollout"):
        time.sleep(1.0)
    row = tel.end_step(0)
    assert row["perf/trainer_gpu_util"] > 50, row["perf/trainer_gpu_util"]
    # NVML's reading covers the driver's last sample period, so the idle phase's first samples still see
    # the busy phase's tail: 20-22% on an H200 (twice), never near the busy phase's
    assert row["perf/rollout_gpu_util"] < 35, row["perf/rollout_gpu_util"]
    assert row["perf/trainer_gpu_util"] - row["perf/rollout_gpu_util"] > 40, row


def test_bad_input_is_refused_with_clear_messages():
    tel = _rec()
    with pytest.raises(ValueError, match="2 finish times for 3 response lengths"):
        tel.record_samples([1, 2, 3], [0.1, 0.2])
    with pytest.raises(ValueError, match="2 trainer log-probs vs 1 engine"):
        tel.record_logprobs([0.0, 0.0], [0.0])
    h = tel.open("rollout")
    tel.close(h)
    with pytest.raises(ValueError, match="not open"):
        tel.close(h)
    with pytest.raises(ValueError, match="role 'critic' is unknown"):
        tel.record_interval("train", 0, 1, role="critic")
    with pytest.raises(ValueError, match="ends .* before it starts"):
        tel.record_interval("train", 2, 1)
    with pytest.raises(ValueError, match="would overwrite"):
        tel.end_step(0, **{"perf/step_time": 1.0})
    with pytest.raises(ValueError, match="not a multiple of rollout_gpus_per_engine"):
        RunLayout(trainer_gpus=2, rollout_gpus=3, rollout_gpus_per_engine=2)


def test_read_rows_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 is not JSON"):
        read_rows(p)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")


def test_quantile():
    assert quantile([1, 2, 3, 4, 5], 0.5) == 3
    assert quantile([0, 10], 0.99) == pytest.approx(9.9)


def _busy_work(seconds: float) -> tuple[float, float]:
    """Real CPU work in another process; returns its own time.time() stamps."""
    start = time.time()
    x = 0
    while time.time() - start < seconds:
        x += sum(range(1000))
    return start, time.time()


def test_async_loop_with_a_real_worker_process(tmp_path):
    """One-step-off loop: rollout in a separate process overlaps training in this one.

    Each step the trainer works 0.3 s and rollout 0.15 s, so the trainer never waits after the
    first batch and rollout idles ~0.15 s per step; every row must add up on the trainer side.
    """
    path = tmp_path / "async.jsonl"
    tel = _rec(path)
    with cf.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        pool.submit(_busy_work, 0.0).result()  # start the worker before timing
        h, fut = tel.open("rollout"), pool.submit(_busy_work, 0.15)
        rows = []
        for step in range(3):
            _, last_token = fut.result()
            tel.close(h, end=last_token)  # the driver learns of it later; the worker's stamp is exact
            with tel.phase("sync"):
                time.sleep(0.02)
            h, fut = tel.open("rollout"), pool.submit(_busy_work, 0.15)
            with tel.phase("train"):
                _busy_work(0.3)
            rows.append(tel.end_step(step))
        fut.result()
    for row in rows[1:]:
        assert row["perf/train_time"] + row["perf/update_weights_time"] + row["perf/train_wait_time"] == \
            pytest.approx(row["perf/step_time"], abs=1e-6)
        assert row["perf/train_wait_time"] < 0.1
        assert 0.05 < row["perf/rollout_wait_time"] < 0.3
        assert row["perf/step_time"] == pytest.approx(0.32, abs=0.1)
    assert rows[0]["perf/train_wait_time"] > 0.1  # the first batch had to be generated first
    assert [r["step"] for r in read_rows(path)] == [0, 1, 2]


def test_late_end_stamp_credits_idle_to_the_closing_step():
    """A rollout counted busy to the end of step 0 really ended earlier: its idle shows in step 1."""
    tel = _rec()
    tel.record_interval("train", 0.0, 8.0)
    h = tel.open("rollout", start=5.0)
    r0 = tel.end_step(0, end=8.0)
    assert r0["perf/rollout_wait_time"] == 5.0    # 0..5, then assumed busy to 8
    tel.close(h, end=7.0)                          # it finished at 7: 7..8 was idle too
    tel.record_interval("train", 8.0, 10.0)
    r1 = tel.end_step(1, end=10.0)
    assert r1["perf/rollout_wait_time"] == 1.0 + 2.0
    assert r0["perf/rollout_wait_time"] + r1["perf/rollout_wait_time"] == 10.0 - 2.0
    assert r1["perf/rollout_time"] == 2.0
