"""The README's main job: the tiny GRPO loop end to end on real parts (local Ray with logical
GPUs, CPU vLLM engines, FSDP or Megatron trainer ranks on gloo, a real transfer group)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlplacement.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_KEYS = {"step", "perf/step_time", "perf/rollout_time", "perf/update_weights_time", "perf/train_time",
                 "perf/train_wait_time", "perf/rollout_wait_time", "rollout/response_lengths",
                 "rollout/logprob_abs_diff", "trainer_gpus", "rollout_gpus", "rollout_gpus_per_engine", "colocate"}


def step_lines(stdout: str) -> list[str]:
    """The loop's step lines wherever they sit: Ray's log thread shares the driver's stdout, so a
    worker's line without its newline yet can precede a step line on the same physical line."""
    return re.findall(r"(step \d+: .*)", stdout)


def run_loop(tmp_path, *flags, timeout=900):
    """The example loop in a process of its own, joined to the test process's shared cluster."""
    from tests import shared_ray

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": shared_ray.address()}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--work-dir", str(tmp_path),
                           *flags], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return proc


@pytest.mark.slow
def test_megatron_tp2_two_engines_packed(tmp_path):
    """Bucket staging: each engine's worker assembles the two ranks' pieces as their buckets arrive, and checks
    every piece as it arrives (the engine hashes nothing twice)."""
    proc = run_loop(tmp_path, "--steps", "2", "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                    "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--update-weight-staging", "bucket",
                    "--update-weight-transfer-mode", "broadcast_packed", "--check-weight-update-equal",
                    "--telemetry", str(tmp_path / "steps.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1:" in proc.stdout and "v2)" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    # both TP ranks send the parts of the HF tensors their shards are (pieces): nothing is gathered, so no
    # collective in the TP group, and none forwards to rank 0
    assert [r["perf/update_collectives"] for r in rows] == [0, 0]
    assert [r["perf/update_weights_senders"] for r in rows] == [2, 2]
    assert all(r["perf/update_weights_max_sender_bytes"] < r["perf/update_weights_bytes"] for r in rows)
    assert all(r["perf/update_weights_checked"] == 1 for r in rows)


@pytest.mark.slow
def test_megatron_tp2_pieces_reach_a_two_worker_engine_as_its_slices(tmp_path):
    """Megatron TP=2 on two ranks into one engine of two workers under p2p: each rank writes what its TP shards are
    of the HF tensors (pieces), each worker gets only its slices of them, every update checked bit for bit."""
    proc = run_loop(tmp_path, "--steps", "2", "--train-backend", "megatron", "--tensor-model-parallel-size", "2",
                    "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
                    "--update-weight-transfer-mode", "p2p", "--check-weight-update-equal",
                    "--telemetry", str(tmp_path / "steps.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["perf/update_weights_checked"] == 1 for r in rows)
    assert [r["perf/update_collectives"] for r in rows] == [0, 0]
    assert [r["perf/update_weights_senders"] for r in rows] == [2, 2]
    # the two TP ranks send about halves of the model: rows or columns of every split tensor, norms by rows;
    # rank 0 holds more of the vocabulary's real rows (Megatron pads 300 to 512: rank 1 holds 44 real ones)
    assert all(r["perf/update_weights_max_sender_bytes"] < 0.65 * r["perf/update_weights_bytes"] for r in rows)


@pytest.mark.slow
def test_megatron_colocated_updates_from_its_parameters_bit_exact(tmp_path):
    """One Megatron rank under --colocate updates from views of its parameters (q/k/v as its fused QKV's
    row groups; on a GPU read in place, here packed in their HF shapes), checked bit for bit; no
    collective in a TP or PP group."""
    proc = run_loop(tmp_path, "--steps", "2", "--train-backend", "megatron", "--colocate",
                    "--check-weight-update-equal", "--telemetry", str(tmp_path / "steps.jsonl"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "v2)" in step_lines(proc.stdout)[-1]
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [r["perf/update_collectives"] for r in rows] == [0, 0] and all(r["colocate"] for r in rows)


def test_bad_flags_fail_before_any_process_starts(tmp_path):
    proc = run_loop(tmp_path, "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2", timeout=120)
    assert proc.returncode == 2
    assert "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2" in proc.stderr
    assert not (tmp_path / "model").exists()


@pytest.mark.parametrize("flags,message", [
    (["--long-tail-min", "50"], "--long-tail-min shape --long-tail's lengths: add --long-tail, or drop them"),
    (["--long-tail", "--long-tail-alpha", "0"], "--long-tail-alpha 0.0 must be > 0"),
    (["--long-tail", "--long-tail-min", "40"], "--long-tail-min 40 from 1 to 16"),
], ids=["without-long-tail", "alpha-0", "min-over-the-cap"])
def test_a_long_tail_shape_the_loop_cannot_draw_is_refused_before_anything_starts(tmp_path, capsys, flags, message):
    from examples import tiny_grpo

    assert tiny_grpo.main(["--work-dir", str(tmp_path), *flags]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "model").exists()


def test_the_long_tail_at_alpha_2_has_the_published_p99_over_p50():
    """Pareto(alpha): p99/p50 = 50^(1/alpha), about 7 at alpha 2 (published RL workloads: 5-10), each step's
    straggler at the cap."""
    import statistics

    from examples import tiny_grpo

    steps = [tiny_grpo.long_tail_lengths(32, 1024, seed, alpha=2.0, minimum=100) for seed in range(50)]
    q = statistics.quantiles([n for step in steps for n in step], n=100)
    assert 5 <= q[98] / q[49] <= 10 and all(max(step) == 1024 and min(step) >= 100 for step in steps)


def test_model_the_backend_cannot_shard_fails_before_any_process_starts(tmp_path):
    # the loop's tiny model has 2 KV heads: TP=4 cannot split them; preflight says so before Ray starts
    proc = run_loop(tmp_path, "--train-backend", "megatron", "--tensor-model-parallel-size", "4",
                    "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "1", "--num-gpus-per-node", "8",
                    "--verbose", timeout=300)  # --verbose: Ray would say it started
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--tensor-model-parallel-size 4" in proc.stderr and "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stderr + proc.stdout


SPLIT_MODE_FLAGS = {  # every split mode as loop flags ({tmp}: the test's folder)
    "broadcast": ["--update-weight-transfer-mode", "broadcast"],
    "broadcast_packed": ["--update-weight-transfer-mode", "broadcast_packed"],
    "p2p": ["--update-weight-transfer-mode", "p2p", "--p2p-protocol", "tcp"],
    "disk-delta": ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "{tmp}/weights"],
}
ALL_MODE_FLAGS = {**SPLIT_MODE_FLAGS, "cuda_ipc": ["--colocate"]}  # cuda_ipc: /dev/shm here


# split modes whose hundred updates run with --one-step-off: each update then lands while the next
# batch generates, and that run also checks one-step-off's staleness (one loop start fewer per mode);
# broadcast (whose run feeds the advisor) and cuda_ipc (refused with it) run the plain loop
ONE_STEP_OFF_MODES = ("broadcast_packed", "p2p", "disk-delta")

# the layouts whose learning test_the_example_loop_keeps_learning checks on the first 40 steps of the
# plain hundred-update runs (one loop start fewer per layout; the learning rate is constant and the
# rollout seeded per step, so those steps are the ones a 40-step run takes)
LEARNING_LAYOUTS = {
    "broadcast": ["--micro-batch-size", "2", "--global-batch-size", "4"],  # split: two optimizer steps of two micro-batches
    "cuda_ipc": ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"],  # colocated (--colocate)
}


@pytest.fixture(scope="module")
def hundred_update_run(tmp_path_factory):
    """``run(mode)``: the loop's hundred updates in ``mode``, started once for the module (the update
    test and the learning test read the same run): ``(tmp_path, proc, telemetry rows)``."""
    runs = {}

    def run(mode):
        if mode not in runs:
            tmp_path = tmp_path_factory.mktemp(f"hundred-{mode}")
            telemetry = tmp_path / "tel.jsonl"
            flags = [] if mode == "broadcast" else ALL_MODE_FLAGS[mode]  # broadcast is the loop's default
            proc = run_loop(tmp_path, "--steps", "100", "--check-weight-update-equal", "--telemetry", str(telemetry),
                            *[f.format(tmp=tmp_path) for f in flags], *LEARNING_LAYOUTS.get(mode, []),
                            *(["--one-step-off"] if mode in ONE_STEP_OFF_MODES else []), timeout=600)
            rows = [json.loads(l) for l in telemetry.read_text().splitlines()] if telemetry.exists() else []
            runs[mode] = (tmp_path, proc, rows)
        return runs[mode]

    return run


def _one_run(modes):
    """``modes`` as parameters that share the hundred-update run of their mode (one xdist worker each)."""
    return [pytest.param(m, marks=pytest.mark.xdist_group(f"hundred-update-run-{m}")) for m in modes]


@pytest.mark.slow
@pytest.mark.parametrize("mode", _one_run(ALL_MODE_FLAGS))
def test_a_hundred_consecutive_updates_stay_bit_exact(hundred_update_run, mode, capsys):
    """Every step's update is checked tensor by tensor (--check-weight-update-equal exits non-zero
    naming the tensor on any difference), and each mode's own outputs are checked on the same run
    (one loop start per mode: a start costs ~35 s of CI on 2 cores, 100 steps ~25 s)."""
    tmp_path, proc, rows = hundred_update_run(mode)
    one_step_off = mode in ONE_STEP_OFF_MODES
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = step_lines(proc.stdout)
    assert [s.split(":")[0] for s in steps] == [f"step {i}" for i in range(100)] and "v100)" in steps[-1]
    assert [r["step"] for r in rows] == list(range(100))
    assert {r["transfer_mode"] for r in rows} == {mode}
    for row in rows:
        assert CONTRACT_KEYS <= set(row), CONTRACT_KEYS - set(row)
        assert row["perf/update_weights_time"] > 0 and row["perf/rollout_time"] > 0
        assert row["trainer_gpus"] == 1 and row["rollout_gpus"] == 1 and row["colocate"] is (mode == "cuda_ipc")
        assert len(row["rollout/response_lengths"]) == 8
    # fp32 trainer and engine on the same weights: the sampled tokens' log-probs agree closely (with
    # one-step-off only the first step's samples come from the weights the trainer holds)
    for row in rows[:1] if one_step_off else rows:
        assert row["rollout/logprob_abs_diff"] < 1e-4
    if one_step_off:  # every batch after the first was generated while the previous step trained
        assert [r["rollout/staleness"] for r in rows] == [0] + [1] * 99
    MODE_CHECKS[mode](tmp_path, proc, rows, capsys)


def _default_run_feeds_the_advisor(tmp_path, proc, rows, capsys):
    png = tmp_path / "steps.png"
    assert cli_main(["advise", "--metrics", str(tmp_path / "tel.jsonl"), "--json", "--plot", str(png)]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["current"] == {"colocate": False, "trainer_gpus": 1, "rollout_gpus": 1}
    assert advice["diagnosis"] in ("rollout-bound", "train-bound", "sync-bound", "long-tail", "balanced")
    rec = advice["recommended"]
    assert rec["colocate"] or rec["trainer_gpus"] + rec["rollout_gpus"] == 2
    assert advice["measured"]["steps"] == 99 and advice["measured"]["rollout_time"] > 0  # step 0 is warm-up
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _disk_delta_run_published_every_version(tmp_path, proc, rows, capsys):
    weights = tmp_path / "weights"
    pointer = json.loads((weights / "latest").read_text())
    assert (pointer["version"], pointer["folder"], pointer["epoch"]) == (100, "weight_v000100", 0)
    index = json.loads((weights / "weight_v000100" / "model.safetensors.index.json").read_text())
    assert index["version"] == 100 and index["base_version"] == 99 and index["delta_encoding"] == "xor"
    # step 0 may change nothing if every group's rewards tie; from then on AdamW's momentum moves bytes
    assert all(0 <= r["perf/update_weights_density"] <= 1 for r in rows)
    assert all(r["perf/update_weights_density"] > 0 for r in rows[1:])


def _colocated_run_used_ipc_and_said_the_handoff_is_skipped(tmp_path, proc, rows, capsys):
    from rlplacement.transfer.cuda_ipc.buckets import orphaned_shm_files

    assert not orphaned_shm_files()  # the run's processes are gone: none of their bucket files is left
    # --offload-train/--offload-rollout are on by default under --colocate; on CPU there is nothing to free
    skipped = "--offload-train and --offload-rollout: the trainer runs on cpu, so there is no GPU memory to hand off"
    assert proc.stderr.count(skipped) == 1
    assert not any(k.startswith("perf/handoff") for r in rows for k in r)


MODE_CHECKS = {
    "broadcast": _default_run_feeds_the_advisor,
    "broadcast_packed": lambda *_: None,
    "p2p": lambda *_: None,  # over Mooncake TCP: the transfer_mode rows above
    "disk-delta": _disk_delta_run_published_every_version,
    "cuda_ipc": _colocated_run_used_ipc_and_said_the_handoff_is_skipped,
}


LONG_TAIL_FLAGS = ("--steps", "3", "--long-tail", "--max-response-len", "64", "--prompts-per-step", "4",
                   "--check-weight-update-equal")


@pytest.fixture(scope="module")
def long_tail_run(tmp_path_factory):
    """``run(during)``: the loop on a long-tailed workload, synchronous or with ``--train-during-rollout``,
    started once for the module: ``(proc, telemetry rows)``."""
    runs = {}

    def run(during: bool):
        if during not in runs:
            tmp_path = tmp_path_factory.mktemp("long-tail-during" if during else "long-tail")
            telemetry = tmp_path / "tel.jsonl"
            proc = run_loop(tmp_path, *LONG_TAIL_FLAGS, "--telemetry", str(telemetry),
                            *(["--train-during-rollout"] if during else []))
            rows = [json.loads(l) for l in telemetry.read_text().splitlines()] if telemetry.exists() else []
            runs[during] = (proc, rows)
        return runs[during]

    return run


@pytest.mark.slow
@pytest.mark.xdist_group("long-tail-runs")
def test_long_tail_run_is_diagnosed_and_gets_no_more_rollout_gpus(long_tail_run, tmp_path, capsys):
    """A real run whose response lengths have a long tail: per-sample finish times from the engine
    (more distinct times than engines), p99/p50 >= 4, and the advisor diagnoses long-tail without
    adding rollout GPUs."""
    proc, rows = long_tail_run(False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    telemetry = tmp_path / "tel.jsonl"
    telemetry.write_text("".join(json.dumps(row) + "\n" for row in rows))
    for row in rows:
        assert len(set(row["rollout/sample_finish_times"])) > row["rollout_gpus"] // row["rollout_gpus_per_engine"]
    assert cli_main(["advise", "--metrics", str(telemetry), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    measured = advice["measured"]  # over the steps after warm-up, as the advisor reads them
    assert measured["sample_finish_p99"] >= 4 * measured["sample_finish_p50"], measured
    assert advice["diagnosis"] == "long-tail"
    assert advice["recommended"]["colocate"] or advice["recommended"]["rollout_gpus"] <= advice["current"]["rollout_gpus"]


@pytest.mark.slow
@pytest.mark.xdist_group("long-tail-runs")
def test_training_during_rollout_takes_the_sync_loops_steps_on_the_same_samples(long_tail_run):
    """``--train-during-rollout`` on the long-tailed workload against the synchronous run of the same seeds: the
    first rollout is the same (no step has run), and each step on the same samples has the sync step's loss and
    gradient norm (the chunked step equals the whole-batch step up to float rounding; which groups share a chunk
    depends on timing, so a step whose rollout drew other tokens, after a rounding flipped one, is not
    compared: the test reports the first). Training ran while the tail decoded, every update checked."""
    (sync, sync_rows), (during, rows) = long_tail_run(False), long_tail_run(True)
    assert sync.returncode == 0 and during.returncode == 0, (sync.stderr + during.stderr)[-3000:]
    assert [r["step"] for r in rows] == [r["step"] for r in sync_rows] == [0, 1, 2]
    assert rows[0]["reward"] == sync_rows[0]["reward"]
    for mine, theirs in zip(rows, sync_rows):
        if mine["reward"] != theirs["reward"]:
            print(f"the rollouts first differ at step {mine['step']}")
            break
        for key in ("train/loss", "train/grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (mine["step"], key)
    assert all(r["perf/train_overlap_time"] > 0 and r["perf/update_weights_checked"] == 1 for r in rows)
    assert all(r["rollout/dropped_groups"] == 0 == r["rollout/generated_again"] for r in rows)
    assert len(step_lines(during.stdout)) == 3 and "overlap" in during.stdout


@pytest.mark.slow
@pytest.mark.parametrize("mode", _one_run(LEARNING_LAYOUTS), ids=["split-micro-batches", "colocated-dynamic-batches"])
def test_the_example_loop_keeps_learning(hundred_update_run, mode):
    """The loop's reward (the fraction of digit tokens in a response) rises from chance to nearly all
    digits in 40 steps with the micro-batched step, in the split and the colocated layout (read on the
    hundred-update run of that layout: ``LEARNING_LAYOUTS``)."""
    _, proc, rows = hundred_update_run(mode)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rows) == 100
    rewards = [row["reward"] for row in rows[:40]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2 and last > 0.8, (first, last, rewards)
    # a quiet log: the loop's step lines and at most a dozen others (a 3-step `make run` prints <= 15
    # lines), none per update
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if l.strip()]
    others = [l for l in lines if not re.search(r"step \d+: ", l)]
    assert len(lines) - len(others) == 100 and len(others) <= 12, others
    assert not any("RotaryEmbedding" in l or "prefix cache" in l for l in lines), others


MOE_LAYOUTS = {
    # megatron's MoE layer with expert parallelism on two ranks (each sends its own experts), its all-to-all
    # dispatcher and load-balancing loss, p2p, micro-batches
    "megatron-ep2-p2p": ["--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
                         "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                         "--update-weight-transfer-mode", "p2p", "--moe-aux-loss-coeff", "0.01",
                         "--micro-batch-size", "2", "--global-batch-size", "8"],
    # transformers' MoE blocks under FSDP, colocated (cuda_ipc's direct path: the engine reads the trainer's views)
    "fsdp-colocated": ["--colocate"],
    # megatron at EP=2 colocated: each rank all-gathers the other rank's experts for the engine on its GPU
    "megatron-ep2-colocated": ["--colocate", "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
                               "--rollout-num-gpus", "2",
                               "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_the_example_loop_learns_a_mixture_of_experts_model(tmp_path, layout):
    """``--tiny-model-family qwen3_moe`` (4 experts, top-2, every layer sparse): the reward rises from chance
    to nearly all digits in 40 steps, every update checked tensor by tensor, and the engine's log-probs
    of its samples stay within 1e-5 of the trainer's (``rollout/logprob_abs_diff``: the experts it serves
    are the trainer's, in the layout its kernel reads)."""
    telemetry = tmp_path / "tel.jsonl"
    proc = run_loop(tmp_path, "--steps", "40", "--tiny-model-family", "qwen3_moe", "--check-weight-update-equal",
                    "--telemetry", str(telemetry), *MOE_LAYOUTS[layout], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in telemetry.read_text().splitlines()]
    rewards = [row["reward"] for row in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert len(rows) == 40 and first < 0.2 and last > 0.8, (first, last, rewards)
    assert max(row["rollout/logprob_abs_diff"] for row in rows) < 1e-5


@pytest.mark.slow
def test_a_loop_resumed_from_its_checkpoint_goes_on_as_if_never_stopped(tmp_path):
    """The loop saves after its second train call (of three); a second loop started with --load sends the
    engines the checkpoint's weights (checked bit for bit) as version 2 before its first step, whose update
    is then version 3. That step is the stopped run's step 2 again: the same prompts (the sampler's
    position, kept in the checkpoint), the same rollout seeds (the job's generate calls, kept too), the
    same weights, so the same samples, rewards and loss. Both run at --rollout-temperature 0.7: the
    engine's processed log-probs and the trainer's temperature-scaled ones are the same quantity."""
    ckpt, tel, tel_resumed = tmp_path / "ckpt", tmp_path / "first.jsonl", tmp_path / "resumed.jsonl"
    common = ["--check-weight-update-equal", "--rollout-temperature", "0.7", "--prompts-per-step", "3"]
    first = run_loop(tmp_path / "a", "--steps", "3", "--save", str(ckpt), "--save-interval", "2",
                     "--telemetry", str(tel), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    saved = json.loads((ckpt / "iter_0000002" / "trainer_state.json").read_text())["job_state"]
    assert saved["generate_calls"] == 2 and saved["epoch"] == 0
    assert saved["extra_state"] == {"step": 2, "prompt_position": 6}
    rows = [json.loads(line) for line in tel.read_text().splitlines()]
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in rows), [r["rollout/logprob_abs_diff"] for r in rows]
    resumed = run_loop(tmp_path / "b", "--steps", "1", "--load", str(ckpt), "--telemetry", str(tel_resumed),
                       "--hf-checkpoint", str(tmp_path / "a" / "model"), *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    line = step_lines(resumed.stdout)[0]
    assert line.startswith("step 2:") and "v3)" in line, line
    (again,) = [json.loads(line) for line in tel_resumed.read_text().splitlines()]
    uninterrupted = rows[2]
    assert again["step"] == uninterrupted["step"] == 2
    assert again["rollout/response_lengths"] == uninterrupted["rollout/response_lengths"]
    assert (again["reward"], again["train/loss"]) == (uninterrupted["reward"], uninterrupted["train/loss"])


def _lora_rows(tmp_path, *flags, steps):
    telemetry = tmp_path / "tel.jsonl"
    proc = run_loop(tmp_path, "--steps", str(steps), "--lora-rank", "8", "--check-weight-update-equal",
                    "--telemetry", str(telemetry), *flags, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" checked ") == steps
    rows = [json.loads(line) for line in telemetry.read_text().splitlines()]
    assert len(rows) == steps
    # the engine's log-probs of its own samples are the trainer's: it serves this step's adapters (a stale
    # adapter, one update behind, was seen to differ by 2e-2)
    assert max(row["rollout/logprob_abs_diff"] for row in rows) < 1e-5, [r["rollout/logprob_abs_diff"] for r in rows]
    return rows, step_lines(proc.stdout)


def _assert_learns(rows) -> None:
    """The learning bar of the example loop: the first 5 steps' mean reward under 0.2, the last 5's over 0.8."""
    rewards = [row["reward"] for row in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.2 and last > 0.8, (first, last, rewards)


def _adapter_folder(out: Path) -> Path:
    """A rank-8 PEFT adapter folder on every decoder linear layer of the example loop's tiny model."""
    import importlib.util

    from rlplacement.config import LORA_MODULES
    from rlplacement.models.tiny import TinySpec, make_tiny_model
    from tests.reference_checks import write_adapter_folder

    spec = importlib.util.spec_from_file_location("tiny_grpo", ROOT / "examples" / "tiny_grpo.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model = make_tiny_model(out.parent / "shapes", TinySpec(**example.TINY_MODEL))
    write_adapter_folder(out, model, 8, 16.0, LORA_MODULES, seed=3)
    return out


def _adapter_bytes(model_dir: Path) -> int:
    from rlplacement.config import LORA_MODULES
    from rlplacement.lora_format import adapter_shapes

    shapes = adapter_shapes(json.loads((model_dir / "config.json").read_text()), 8, LORA_MODULES)
    return 4 * sum(a * b for a, b in shapes.values())  # float32, the tiny model's dtype


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--actor-num-gpus-per-node", "2", "--update-weight-transfer-mode", "p2p"],
                                    ["--colocate"]], ids=["fsdp2-p2p", "colocated"])
def test_the_example_loop_serves_lora_adapters_live_and_merged_alike(tmp_path, layout):
    """``--lora-rank 8`` under fsdp (two ranks over p2p, and colocated), every update checked tensor by tensor:
    adapter-only updates (the default) move the adapters' bytes alone, a tenth of the model's, into a live
    vLLM adapter, and the loop learns in 40 steps; ``--lora-merge-for-rollout`` moves the merged model whole.
    Both serve what the trainer computes (log-probs within 1e-5), so the same seed gives the same samples,
    rewards and losses."""
    live, _ = _lora_rows(tmp_path / "live", *layout, steps=40)
    _assert_learns(live)
    merged, _ = _lora_rows(tmp_path / "merged", "--lora-merge-for-rollout", *layout, steps=6)
    early = live[:6]  # once every sample earns 1 the advantages, and so the gradients, are zero
    assert len({row["train/grad_norm"] for row in early}) == 6 and all(row["train/grad_norm"] > 0 for row in early)
    adapter = _adapter_bytes(tmp_path / "live" / "model")
    assert {row["perf/update_weights_bytes"] for row in live} == {adapter}
    (full,) = {row["perf/update_weights_bytes"] for row in merged}
    assert adapter < 0.12 * full, (adapter, full)  # rank 8 of a 128-wide model: a tenth of its bytes
    for a, b in zip(live, merged):
        assert a["rollout/response_lengths"] == b["rollout/response_lengths"] and a["reward"] == b["reward"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout,steps", [
    (["--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2", "--update-weight-transfer-mode",
      "broadcast_packed"], 3),
    (["--actor-num-gpus-per-node", "2", "--update-weight-transfer-mode", "disk-delta"], 3),
    (["--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
      "--update-weight-transfer-mode", "broadcast_packed"], 40),
    (["--train-backend", "megatron", "--colocate"], 3)], ids=["tp2-engine", "disk-delta", "megatron-tp2",
                                                               "megatron-colocated-from-a-peft-folder"])
def test_live_lora_adapters_reach_every_worker_in_every_mode(tmp_path, layout, steps):
    """Adapter-only updates into an engine of two tensor-parallel workers (vLLM's LoRA layers cut each
    worker's part of the whole adapter), through disk deltas, and from megatron's TP-split adapters (which
    learn in 40 steps) and colocated: checked, served, the adapters' bytes. The colocated run starts from a
    PEFT adapter folder (``--lora-adapter-path``): the job sends it before the first step, so the first
    rollout already runs the adapters (log-probs within 1e-5 of the trainer's from step 0)."""
    if "disk-delta" in layout:
        layout = [*layout, "--update-weight-disk-dir", str(tmp_path / "deltas")]
    if "--colocate" in layout:
        layout = [*layout, "--lora-adapter-path", str(_adapter_folder(tmp_path / "adapter"))]
    rows, lines = _lora_rows(tmp_path, *layout, steps=steps)
    if "--colocate" in layout:  # version 1 is the folder's adapters, sent at start; step 0's update is version 2
        assert "v2)" in lines[0], lines[0]
    assert {row["perf/update_weights_bytes"] for row in rows} == {_adapter_bytes(tmp_path / "model")}
    if steps == 40:
        _assert_learns(rows)
