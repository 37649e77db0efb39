"""The advisor on telemetry recorded from the example loop (tests/data/advisor_*.jsonl, CPU, 2 cores).

Recorded with, on this branch:

* ``advisor_split_gloo.jsonl``: ``python examples/tiny_grpo.py --steps 6 --telemetry ...`` (1:1 on a
  4-GPU logical node, broadcast over gloo: CPU tensors);
* ``advisor_one_step_off_gloo.jsonl``: the same with ``--one-step-off --rollout-max-response-len 48
  --prompts-per-step 4``;
* ``advisor_colocated_offload_train.jsonl``: ``--steps 5 --colocate --offload-train`` (colocated on 1; on
  CPU the hand-off is skipped, the flag is recorded as given).

Step 0 of each is the warm-up (model load, first compilation): ten times a later step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlplacement.cli import main as cli_main
from rlplacement.telemetry import read_rows

DATA = Path(__file__).parent / "data"
SPLIT = DATA / "advisor_split_gloo.jsonl"
ONE_STEP_OFF = DATA / "advisor_one_step_off_gloo.jsonl"
COLOCATED = DATA / "advisor_colocated_offload_train.jsonl"


def test_the_recorded_rows_say_which_transport_ran_and_which_placement_flags_were_given():
    """What the fixes below read: the loop writes the update's transport (from the sender) and the
    placement flags that refuse layouts (from the config) on every row."""
    split, one_step_off = read_rows(SPLIT), read_rows(ONE_STEP_OFF)
    assert {r["transfer_transport"] for r in split + one_step_off} == {"gloo"}
    assert {r["one_step_off"] for r in split} == {False} and {r["one_step_off"] for r in one_step_off} == {True}
    assert {(r["offload_train"], r["offload_rollout"], r["offload_rollout_keep_weights"]) for r in split} == \
        {(False, False, False)}


def test_each_sender_reports_what_carries_its_bytes(tmp_path):
    from rlplacement.transfer.base import UpdateReport
    from rlplacement.transfer.broadcast.sender import BroadcastSender
    from rlplacement.transfer.cuda_ipc.sender import IpcSender
    from rlplacement.transfer.disk_delta.sender import DiskDeltaSender

    assert BroadcastSender(1 << 20, device="cpu").transport == "gloo"
    ipc = IpcSender(1 << 20, device="cpu")
    try:
        assert ipc.transport == "shared memory"
    finally:
        ipc.close()
    assert DiskDeltaSender(1 << 20, disk_dir=tmp_path).transport == "file"
    assert UpdateReport(1, 1, 1, 8, 0.1, transport="nccl").metrics["transfer_transport"] == "nccl"
    assert "transfer_transport" not in UpdateReport(1, 1, 1, 8, 0.1).metrics  # a receiver's report says nothing


def test_the_layout_carries_the_placement_flags_as_given():
    from rlplacement.config import PlacementConfig
    from rlplacement.telemetry import RunLayout

    colocated = RunLayout.from_placement(PlacementConfig(colocate=True, actor_num_gpus_per_node=2, rollout_num_gpus=2,
                                                         offload_train=True, offload_rollout=None))
    assert (colocated.one_step_off, colocated.offload_train, colocated.offload_rollout) == (False, True, None)
    split = RunLayout.from_placement(PlacementConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1, one_step_off=True))
    assert split.one_step_off is True


def _warm_up_only(tmp_path) -> Path:
    """The recorded split run cut to its first row: what a run stopped after one step leaves."""
    path = tmp_path / "warm_up_only.jsonl"
    path.write_text(SPLIT.read_text().splitlines()[0] + "\n")
    return path


def test_a_file_of_warm_up_rows_only_is_advised_with_a_warning_that_names_the_flag(tmp_path, capsys):
    path = _warm_up_only(tmp_path)
    assert cli_main(["advise", "--metrics", str(path), "--json"]) == 0
    out = capsys.readouterr()
    advice = json.loads(out.out)
    [warning] = [w for w in advice["warnings"] if "warm-up" in w]
    assert "holds 1 row(s), all inside the warm-up (--skip-steps 1)" in warning and "--skip-steps 0" in warning
    assert f"rlplacement advise: warning: {warning}" in out.err  # said where a person reads, too
    assert advice["measured"]["steps"] == 1
    assert advice["measured_step_time"] == pytest.approx(read_rows(path)[0]["perf/step_time"])
    assert cli_main(["advise", "--metrics", str(path)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[1] == f"warning: {warning}"  # before the diagnosis, not after the recommendation


def test_the_whole_recorded_run_is_advised_without_a_warm_up_warning(capsys):
    assert cli_main(["advise", "--metrics", str(SPLIT), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert not [w for w in advice["warnings"] if "warm-up" in w]
    assert advice["measured"]["steps"] == len(read_rows(SPLIT)) - 1
    # the warm-up step was left out: the median step is a steady one, far below step 0's
    assert advice["measured_step_time"] < 0.2 * read_rows(SPLIT)[0]["perf/step_time"]


def test_a_run_whose_update_went_over_gloo_is_labelled_gloo_never_nvlink(capsys):
    """The recorded 1:1 split on CPU: its broadcast ran over gloo (host memory), and colocating would
    hand the weights over in shared memory; neither has an assumed rate, so every candidate keeps the
    measured sync and the transfer modes are not compared."""
    assert cli_main(["advise", "--metrics", str(SPLIT), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    paths = {(c["colocate"], c["trainer_gpus"]): c["sync_path"] for c in advice["candidates"]}
    assert paths[(False, 1)] == "gloo/broadcast"
    assert paths[(True, 2)] == "shared memory/cuda_ipc"
    assert not any(p.startswith(("nvlink", "network", "cuda ipc")) for p in paths.values())
    assert {c["sync_time"] for c in advice["candidates"]} == {advice["measured"]["sync_time"]}
    assert advice["recommended_transfer_mode"] == "broadcast" and advice["transfer_mode_saving_s"] == 0.0
    assert not [w for w in advice["warnings"] if "transport" in w]
    assert cli_main(["advise", "--metrics", str(SPLIT)]) == 0
    assert "transfer: keep broadcast (no rate is assumed for gloo, so no mode can be compared)" in \
        capsys.readouterr().out


def test_rows_that_do_not_say_their_transport_are_assumed_a_gpu_run_with_a_warning(tmp_path, capsys):
    """The same rows without transfer_transport (as recorded before it existed): the label is the
    layout's GPU assumption, and the output says that it is one."""
    path = tmp_path / "no_transport.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "transfer_transport"}) + "\n"
                            for r in read_rows(SPLIT)))
    assert cli_main(["advise", "--metrics", str(path), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    current = next(c for c in advice["candidates"] if not c["colocate"])
    assert current["sync_path"] == "nvlink/broadcast"
    [warning] = [w for w in advice["warnings"] if "transport" in w]
    assert "no transfer_transport" in warning and "assumed to be a GPU run's" in warning


def _advise_json(capsys, *argv) -> dict:
    assert cli_main(["advise", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _refused(advice: dict) -> dict[tuple[bool, int, int], str | None]:
    return {(c["colocate"], c["trainer_gpus"], c["rollout_gpus"]): c["refused"] for c in advice["candidates"]}


@pytest.mark.parametrize("num_gpus", [None, "4"])
def test_a_one_step_off_run_is_never_told_to_colocate(tmp_path, capsys, num_gpus):
    """--colocate refuses --one-step-off (rlplacement/args/placement.py): the colocated candidate is
    predicted and shown, marked with the flag, and never recommended; on 4 GPUs a split is."""
    what_if = ["--num-gpus", num_gpus] if num_gpus else []
    advice = _advise_json(capsys, "--metrics", str(ONE_STEP_OFF), *what_if)
    refused = _refused(advice)
    total = int(num_gpus or 2)
    why = refused[(True, total, total)]
    assert why.startswith("--colocate refuses --one-step-off, which this run used") and \
        "measure a run without --one-step-off" in why
    assert [k for k, v in refused.items() if v] == [(True, total, total)]  # the splits stay allowed
    assert advice["recommended"]["colocate"] is False
    assert advice["recommended"]["trainer_gpus"] + advice["recommended"]["rollout_gpus"] == total
    assert cli_main(["advise", "--metrics", str(ONE_STEP_OFF), *what_if]) == 0
    text = capsys.readouterr().out
    assert f"x colocated on {total}" in text and f"x (colocated on {total}): --colocate refuses --one-step-off" in text


def test_a_one_step_off_run_recorded_without_the_flag_is_known_by_its_overlap(tmp_path, capsys):
    """Rows recorded before one_step_off was written: rollout overlapping training in the timeline
    (and the loop's rollout/staleness) says the run was one-step-off."""
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "one_step_off"}) + "\n"
                            for r in read_rows(ONE_STEP_OFF)))
    advice = _advise_json(capsys, "--metrics", str(path))
    assert advice["measured"]["overlapped"] is True
    assert _refused(advice)[(True, 2, 2)].startswith("--colocate refuses --one-step-off")
    assert advice["recommended"]["colocate"] is False


def test_a_colocated_run_given_offload_train_is_never_told_to_split(capsys):
    """A split refuses --offload-train: the recorded colocated run, asked about 2 GPUs, may colocate on
    both but not split 1:1, however fast the split is predicted."""
    advice = _advise_json(capsys, "--metrics", str(COLOCATED), "--num-gpus", "2")
    refused = _refused(advice)
    assert refused[(False, 1, 1)].startswith("a split layout refuses --offload-train, which this run was given")
    assert refused[(True, 2, 2)] is None
    assert advice["recommended"] == {"colocate": True, "trainer_gpus": 2, "rollout_gpus": 2}


def test_a_split_run_whose_transfer_mode_colocating_refuses_is_not_told_to_colocate(tmp_path):
    """--colocate refuses --update-weight-transfer-mode disk-delta (and p2p): rows written by the
    recorder for a rollout-bound disk-delta split, where colocating would otherwise win."""
    from tests.test_advisor import advise, synth

    advice = advise(synth(tmp_path / "d.jsonl", trainer=1, rollout=1, gpe=1, gpn=4, R=10.0, T=1.0, S=0.1,
                          overlapped=False, mode="disk-delta", transport="file"))
    colocated = next(c for c in advice.candidates if c.placement.colocate)
    assert colocated.step_time < advice.current.step_time  # predicted faster, and still not recommended
    assert advice.refused[colocated.placement].startswith("--colocate refuses --update-weight-transfer-mode disk-delta")
    assert not advice.recommended.placement.colocate


def test_colocating_across_nodes_is_a_candidate_only_where_every_engine_fits_in_a_node():
    """As the flags allow: on two 8-GPU nodes engines of 2 colocate (each inside a node), engines of 16 do not,
    nor engines of 3 on 12 GPUs of 8-GPU nodes (one would straddle)."""
    import argparse

    from rlplacement.advisor import candidate_placements
    from rlplacement.args import add_arguments, config_from_args

    assert any(p.colocate for p in candidate_placements(16, 8, 2))
    assert any(p.colocate for p in candidate_placements(8, 8, 2))
    assert not any(p.colocate for p in candidate_placements(16, 8, 16))
    assert not any(p.colocate for p in candidate_placements(12, 8, 3))
    flags = ["--colocate", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8", "--rollout-num-gpus-per-engine", "2"]
    assert config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(flags)).placement.num_engines == 8


@pytest.mark.parametrize("path", [SPLIT, ONE_STEP_OFF, COLOCATED])
def test_the_model_reproduces_the_measured_step_of_each_recorded_run(capsys, path):
    """The current layout's prediction is the measured step, so the table and the gain agree with it."""
    advice = _advise_json(capsys, "--metrics", str(path))
    assert advice["predicted_step_time"]["current"] == pytest.approx(advice["measured_step_time"], rel=1e-9)


@pytest.mark.parametrize("path, num_gpus", [(SPLIT, None), (ONE_STEP_OFF, "4")])
def test_the_gain_is_stated_against_the_measured_step(capsys, path, num_gpus):
    what_if = ["--num-gpus", num_gpus] if num_gpus else []
    advice = _advise_json(capsys, "--metrics", str(path), *what_if)
    measured, recommended = advice["measured_step_time"], advice["predicted_step_time"]["recommended"]
    assert advice["recommended"] != advice["current"]
    assert advice["predicted_change_against"] == "measured_step_time"
    assert advice["predicted_change"] == pytest.approx(recommended / measured - 1)
    change = recommended / measured - 1
    assert f"from the measured {measured:.3g} s to {recommended:.3g} s ({change:+.0%})" in advice["reason"]


def test_the_min_gain_threshold_is_against_the_measured_step(capsys):
    """The recorded split's best layout is predicted to cut the measured step by ``gain``: a threshold
    just above it keeps the layout, just below it recommends the change."""
    advice = _advise_json(capsys, "--metrics", str(SPLIT))
    gain = 1 - advice["predicted_step_time"]["recommended"] / advice["measured_step_time"]
    assert gain > 0.05
    above = _advise_json(capsys, "--metrics", str(SPLIT), "--min-gain", f"{gain + 0.01:.4f}")
    assert above["recommended"] == above["current"] and above["predicted_change"] == pytest.approx(0.0)
    assert f"keep 1:1 (the measured {above['measured_step_time']:.3g} s)" in above["reason"]
    below = _advise_json(capsys, "--metrics", str(SPLIT), "--min-gain", f"{gain - 0.01:.4f}")
    assert below["recommended"] == advice["recommended"] != below["current"]


def test_under_a_workload_what_if_the_gain_is_against_the_current_layouts_prediction(capsys):
    """Longer responses change the job: its measured step is no baseline, the current layout's
    prediction for the changed job is, and the output says so."""
    advice = _advise_json(capsys, "--metrics", str(SPLIT), "--rollout-max-response-len", "64")
    current, recommended = advice["predicted_step_time"]["current"], advice["predicted_step_time"]["recommended"]
    assert advice["predicted_change_against"] == "predicted_step_time.current"
    assert current > advice["measured_step_time"]
    assert advice["predicted_change"] == pytest.approx(recommended / current - 1)
    assert "(predicted for 1:1 under the what-if)" in advice["reason"]


def test_a_one_step_off_sync_is_measured_without_its_wait_for_the_engines_batch(capsys):
    """In the recorded one-step-off run each update waits for the batch the engine is generating
    (dispatched before training): ~0.13 s of its timed ~0.17 s is that rollout. Measured without it,
    the run is rollout-bound, not sync-bound, and max(rollout, train) + sync nearly is the step."""
    from rlplacement.advisor import fit, measure

    rows = read_rows(ONE_STEP_OFF)
    syncs = [[(s, e) for role, ph, s, e in r["timeline"]["intervals"] if ph == "sync" and role == "trainer"]
             for r in rows]
    rollouts = [(s, e) for r in rows for _, ph, s, e in r["timeline"]["intervals"] if ph == "rollout"]
    outside = sorted(e - s - sum(max(0.0, min(e, re) - max(s, rs)) for rs, re in rollouts)
                     for [(s, e)] in syncs[1:])  # step 0 is the warm-up; one sync per step
    m = measure(rows)
    assert m.sync_time == pytest.approx(outside[len(outside) // 2])
    assert m.update_weights_time > 3 * m.sync_time  # what the loop timed, wait included
    advice = _advise_json(capsys, "--metrics", str(ONE_STEP_OFF))
    assert advice["diagnosis"] == "rollout-bound"
    assert advice["measured"]["update_weights_time"] == pytest.approx(m.update_weights_time)
    assert abs(fit(m).other_time) < 0.05 * m.step_time  # the composition accounts for the step


def test_a_synchronous_sync_is_measured_as_the_loop_timed_it():
    """Without overlap (the recorded synchronous split) nothing is taken off the timed update."""
    from rlplacement.advisor import measure

    m = measure(read_rows(SPLIT))
    assert m.sync_time == pytest.approx(m.update_weights_time, rel=1e-6)


LIBRARY_NAMED = ("--rollout-max-response-len", "--n-samples-per-prompt", "--update-weight-transfer-mode",
                 "--num-gpus-per-node")


def test_the_what_if_flags_are_the_librarys_own_names(capsys):
    """Each flag of advise that says what a library flag says is that flag's name in the library's
    parser; the advisor's older names are aliases, and the help says so."""
    import argparse

    import rlplacement

    library = argparse.ArgumentParser()
    rlplacement.add_arguments(library)
    assert set(LIBRARY_NAMED) <= set(library._option_string_actions)
    with pytest.raises(SystemExit):
        cli_main(["advise", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in LIBRARY_NAMED:
        assert name in help_text
    for old in ("--max-response-len", "--group-size", "--transfer-mode"):
        assert f"({old}: the advisor's older name, kept as an alias)" in help_text


@pytest.mark.parametrize("new, old, value", [("--rollout-max-response-len", "--max-response-len", "64"),
                                             ("--n-samples-per-prompt", "--group-size", "16")])
def test_a_what_if_by_the_librarys_name_and_by_the_alias_is_the_same_what_if(capsys, new, old, value):
    measured = _advise_json(capsys, "--metrics", str(SPLIT))
    by_new = _advise_json(capsys, "--metrics", str(SPLIT), new, value)
    assert by_new == _advise_json(capsys, "--metrics", str(SPLIT), old, value)
    assert by_new["predicted_step_time"]["current"] > 1.5 * measured["measured_step_time"]  # the what-if took


def test_a_colocated_runs_split_mode_is_assumed_by_the_librarys_flag_name(capsys):
    packed = _advise_json(capsys, "--metrics", str(COLOCATED), "--num-gpus", "2",
                          "--update-weight-transfer-mode", "broadcast_packed")
    split = next(c for c in packed["candidates"] if not c["colocate"])
    assert split["sync_path"] == "gloo/broadcast_packed"
    assert _advise_json(capsys, "--metrics", str(COLOCATED), "--num-gpus", "2", "--transfer-mode",
                        "broadcast_packed") == packed
    assert cli_main(["advise", "--metrics", str(COLOCATED), "--update-weight-transfer-mode", "nope"]) == 2
    assert "--update-weight-transfer-mode 'nope' is unknown" in capsys.readouterr().err


def _gantt_span(rows, skip_steps):
    import matplotlib.pyplot as plt

    from rlplacement.advisor.plot import figure

    fig = figure(rows, skip_steps=skip_steps)
    try:
        gantt, hist = fig.axes
        return gantt.get_xlim(), gantt.get_title(loc="left"), hist.get_title()
    finally:
        plt.close(fig)


@pytest.mark.parametrize("path", [SPLIT, ONE_STEP_OFF])
def test_the_plot_leaves_the_warm_up_step_out_by_default(path):
    """In the recorded runs step 0 takes most of the run's time; the plot's axis starts where step 1
    began and ends where the last step ended, and the histogram counts the same steps."""
    rows = read_rows(path)
    start, end = rows[1]["timeline"]["step_start"], rows[-1]["timeline"]["step_end"]
    assert rows[0]["timeline"]["step_end"] > 0.6 * end  # the warm-up takes most of the whole axis
    (left, right), gantt_title, hist_title = _gantt_span(rows, skip_steps=1)
    assert (left, right) == (0.0, pytest.approx(end - start))
    assert "1 warm-up step(s) left out, --plot-warmup draws them" in gantt_title
    samples = sum(len(r["rollout/response_lengths"]) for r in rows[1:])
    assert hist_title == f"response lengths over {len(rows) - 1} step(s), {samples} samples"
    (left, right), gantt_title, _ = _gantt_span(rows, skip_steps=0)
    assert (left, right) == (0.0, pytest.approx(end)) and "left out" not in gantt_title


def test_the_plot_of_warm_up_rows_only_draws_them(tmp_path):
    rows = read_rows(_warm_up_only(tmp_path))
    (left, right), gantt_title, _ = _gantt_span(rows, skip_steps=1)
    assert (left, right) == (0.0, pytest.approx(rows[0]["timeline"]["step_end"])) and "left out" not in gantt_title


def test_advise_plots_without_the_warm_up_unless_asked(tmp_path, monkeypatch):
    import rlplacement.advisor.plot as plot_module

    drawn = []
    real = plot_module.plot
    monkeypatch.setattr(plot_module, "plot", lambda rows, path, title="", skip_steps=1: (
        drawn.append(skip_steps), real(rows, path, title, skip_steps)))
    png = tmp_path / "p.png"
    assert cli_main(["advise", "--metrics", str(SPLIT), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli_main(["advise", "--metrics", str(SPLIT), "--plot", str(png), "--plot-warmup"]) == 0
    assert cli_main(["advise", "--metrics", str(SPLIT), "--plot", str(png), "--skip-steps", "2"]) == 0
    assert drawn == [1, 0, 2]


def test_the_example_in_docs_advisor_md_is_what_advise_prints(capsys, monkeypatch):
    root = Path(__file__).parent.parent
    monkeypatch.chdir(root)  # the example's path is the repository's
    doc = (root / "docs" / "advisor.md").read_text()
    block = doc.split("```\n$ rlplacement advise ", 1)[1].split("```\n", 1)[0]
    command, printed = block.split("\n", 1)
    assert cli_main(["advise", *command.split()]) == 0
    assert capsys.readouterr().out == printed
