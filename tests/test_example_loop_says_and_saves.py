"""The example loop as a new user runs it (Ray's default token authentication, started from the user's own
folder), colocated, with --use-tis, --save and --use-tensorboard, read by several tests:

- --use-tis works without --fully-async: the loop gives the batch the engine's log-probs (it failed after
  start-up, asking library callers to set Batch fields);
- --save without --save-interval saves once, after the last step (it never saved, and said nothing);
- --use-tensorboard says where its events go (they went to ./tensorboard_log unsaid);
- Ray's notice that token authentication is on, which the job keeps on, is not among its lines;
- cuda_ipc's bucket path for resident tensors (always so on CPU) is said once, and in every row's
  ``perf/update_weights_fallback``;
- `export-hf` writes the fsdp --save folder as a Hugging Face folder (it ended in a traceback).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2

pytestmark = pytest.mark.slow  # every test reads one run of the example loop (~35 s to start)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loop")
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # Ray's default, as `make run` has it
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--work-dir", str(folder / "work"),
                           "--steps", str(STEPS), "--colocate", "--use-tis", "--save", str(folder / "ckpt"),
                           "--use-tensorboard", "--tb-project-name", "proj", "--tb-experiment-name", "exp",
                           "--check-weight-update-equal", "--telemetry", str(folder / "rows.jsonl")],
                          capture_output=True, text=True, timeout=1500, cwd=folder,
                          env={**env, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
    return folder, proc, rows


def test_use_tis_trains_in_the_plain_loop(run):
    _, proc, rows = run
    assert len(rows) == STEPS and proc.stdout.count(" checked ") == STEPS
    assert all(row["perf/update_weights_checked"] == 1 for row in rows)


def test_save_without_an_interval_saves_after_the_last_step(run):
    folder, proc, _ = run
    ckpt = folder / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    state = json.loads((ckpt / f"iter_{STEPS:07d}" / "trainer_state.json").read_text())
    assert state["job_state"]["extra_state"]["step"] == STEPS
    assert f"tiny_grpo: saved the last step's checkpoint to {ckpt / f'iter_{STEPS:07d}'}" in proc.stdout


def test_tensorboard_says_where_its_events_go(run):
    folder, proc, _ = run
    events = folder / "tensorboard_log" / "proj" / "exp"
    assert proc.stderr.count(f"rlplacement: TensorBoard events go to {events}") == 1, proc.stderr[-3000:]
    assert any(p.name.startswith("events.out.tfevents") for p in events.iterdir())


def test_no_token_authentication_notice_among_the_lines(run):
    _, proc, _ = run
    assert "Token authentication is enabled" not in proc.stdout + proc.stderr


def test_the_bucket_path_of_resident_tensors_is_said_once_and_in_every_row(run):
    _, proc, rows = run
    said = [line for line in proc.stderr.splitlines()
            if "rlplacement cuda_ipc: weight updates go by buckets, not the direct path" in line]
    assert len(said) == 1 and "host memory" in said[0], proc.stderr[-3000:]
    assert [row["perf/update_weights_fallback"] for row in rows] == [1] * STEPS


def test_export_hf_writes_the_fsdp_save_folder_as_an_hf_folder(run, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    folder, _, _ = run
    model, out = folder / "work" / "model", tmp_path / "exported"
    proc = subprocess.run([sys.executable, "-m", "rlplacement.cli", "export-hf", "--load", str(folder / "ckpt"),
                           "--save", str(out), "--hf-config", str(model)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    exported, original = load_file(str(out / "model.safetensors")), load_file(str(model / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(exported[k].dtype == original[k].dtype and exported[k].shape == original[k].shape for k in original)
    saved = {f"model.lm.{k}": torch.empty(v.shape, dtype=torch.float32) for k, v in original.items()}
    dcp.load(saved, checkpoint_id=str(folder / "ckpt" / f"iter_{STEPS:07d}"), no_dist=True)
    assert all(torch.equal(exported[k], saved[f"model.lm.{k}"].to(original[k].dtype)) for k in original)
    assert any(not torch.equal(exported[k], original[k]) for k in original)  # the trained weights, not the start
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    missing = subprocess.run([sys.executable, "-m", "rlplacement.cli", "export-hf", "--load", str(folder / "ckpt"),
                              "--save", str(tmp_path / "other")], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "is a training run's --save folder, which keeps no model description: pass " \
                                       "--hf-config" in missing.stderr, missing.stderr[-2000:]
