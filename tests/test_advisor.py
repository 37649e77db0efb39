"""The advisor on synthetic telemetry written by the real recorder: diagnosis, recommendation, what-if, CLI, plot."""

from __future__ import annotations

import json
import random
import struct

import pytest

from rlplacement.advisor.measure import cumulative_tokens
from rlplacement.advisor import (ModelAssumptions, Placement, Thresholds, Workload, candidate_placements, measure,
                                 recommend)
from rlplacement.advisor.model import fit
from rlplacement.cli import main as cli_main
from rlplacement.placement.layout import feasible_splits
from rlplacement.telemetry import StepRecorder, read_rows


def exp_lengths(n: int = 64, mean: float = 40.0, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [8 + int(rng.expovariate(1 / mean)) for _ in range(n)]


def long_tail_lengths() -> list[int]:
    """90 short answers and 10 that run on: the tail."""
    return [10 + i % 40 for i in range(90)] + [100 + 15 * i for i in range(10)]


def decode_finish(lengths: list[int], rollout: float, latency_share: float) -> list[float]:
    """Finish times of a decode whose step costs a fixed part plus one per running sequence,
    scaled so the last sample ends at ``rollout`` and ``latency_share`` of it is the fixed part."""
    cum = cumulative_tokens(lengths)
    return [rollout * (latency_share * n / max(lengths) + (1 - latency_share) * c / max(cum))
            for n, c in zip(lengths, cum)]


def synth(path, *, trainer=4, rollout=4, gpe=2, colocate=False, gpn=8, R=5.0, S=0.2, T=5.0, steps=4,
          lengths=None, latency_share=0.1, overlapped=True, mode="broadcast", nbytes=None, max_len=256, group=8,
          handoff=None, transport="gpu"):
    """Write telemetry of a loop with these phase times through StepRecorder; return its rows.

    Colocated or synchronous: rollout, sync, train in sequence. One-step-off: rollout k+1 starts
    after sync k and overlaps train k. ``handoff``: colocated seconds per step handing the GPU over,
    outside the phases (as the loop times it), recorded half each way. ``transport``: what the
    sender reports (``"gpu"``: a GPU run's, CUDA IPC colocated and NCCL split; None: not recorded).
    """
    tel = StepRecorder(path, trainer_gpus=trainer, rollout_gpus=rollout, rollout_gpus_per_engine=gpe,
                       colocate=colocate, num_gpus_per_node=gpn, transfer_mode=mode, max_response_len=max_len,
                       group_size=group)
    lengths = lengths or exp_lengths()
    finish = decode_finish(lengths, R, latency_share)
    t = 1000.0
    rollout_start = t
    handle = tel.open("rollout", start=t) if not (colocate or not overlapped) else None
    for step in range(steps):
        if colocate or not overlapped:
            tel.record_interval("rollout", t, t + R)
            tel.record_interval("sync", t + R, t + R + S)
            tel.record_interval("train", t + R + S, t + R + S + T)
            t = t + R + S + T + (handoff or 0.0)
        else:
            done = rollout_start + R
            tel.close(handle, end=done)  # the loop opened it at dispatch, as the recorder asks
            w = max(t, done)
            tel.record_interval("sync", w, w + S)
            rollout_start = w + S
            handle = tel.open("rollout", start=rollout_start)
            tel.record_interval("train", w + S, w + S + T)
            t = w + S + T
        tel.record_samples(lengths, finish)
        extra = {"perf/update_weights_bytes": nbytes} if nbytes else {}
        if transport:
            extra["transfer_transport"] = ("cuda ipc" if colocate else "nccl") if transport == "gpu" else transport
        if handoff is not None:
            extra.update({"perf/handoff_to_train_time": handoff / 2, "perf/handoff_to_rollout_time": handoff / 2})
        tel.end_step(step, end=t, **extra)
    return read_rows(path)


def advise(rows, **kw):
    thresholds = kw.pop("thresholds", Thresholds())
    m = measure(rows, thresholds.skip_steps, thresholds.bulk_quantile)
    return recommend(m, thresholds=thresholds, **kw)


def assert_valid(advice, total=8, gpn=8, gpe=2, trainer_min=1):
    rec = advice.recommended.placement
    if rec.colocate:
        assert rec.trainer_gpus == rec.rollout_gpus == total
    else:
        assert rec.trainer_gpus + rec.rollout_gpus == total
        assert rec.rollout_gpus % gpe == 0 and rec.trainer_gpus >= trainer_min
        splits = {(s.trainer_gpus, s.rollout_gpus) for s in feasible_splits(total, gpn, gpe, trainer_min)}
        assert (rec.trainer_gpus, rec.rollout_gpus) in splits
    assert advice.recommended.step_time <= advice.current.step_time + 1e-9


def test_candidates_on_one_8_gpu_node_with_2_gpu_engines():
    assert candidate_placements(8, 8, 2) == [Placement(False, 6, 2), Placement(False, 4, 4), Placement(False, 2, 6),
                                             Placement(True, 8, 8)]
    assert candidate_placements(8, 8, 2, trainer_min_gpus=4) == [Placement(False, 6, 2), Placement(False, 4, 4),
                                                                 Placement(True, 8, 8)]


def test_decode_fit_recovers_latency_and_throughput_costs():
    from rlplacement.advisor.measure import _decode_fit

    lengths = exp_lengths(100, seed=3)
    cum = cumulative_tokens(lengths)
    assert cum[lengths.index(max(lengths))] == sum(lengths)
    a, c = _decode_fit(lengths, [0.002 * n + 1e-4 * k for n, k in zip(lengths, cum)])
    assert (a, c) == (pytest.approx(0.002), pytest.approx(1e-4))
    a, c = _decode_fit(lengths, [0.002 * n for n in lengths])  # pure latency: nothing divides over engines
    assert c == pytest.approx(0.0, abs=1e-12) and a == pytest.approx(0.002)
    assert _decode_fit([16] * 8, [1.0] * 8) is None  # every sample hit the cap: no way to tell, fall back


def test_rollout_bound_moves_gpus_to_rollout(tmp_path):
    rows = synth(tmp_path / "r.jsonl", R=10.0, T=3.0)
    advice = advise(rows)
    assert advice.diagnosis.label == "rollout-bound"
    assert advice.recommended.placement.rollout_gpus > 4
    assert advice.current.step_time == pytest.approx(10.2, rel=1e-6)  # measured: max(R, T) + S
    assert advice.recommended.step_time < 0.8 * advice.current.step_time
    assert_valid(advice)
    assert "rollout-bound" in advice.reason and "predicted" in advice.reason


def test_train_bound_moves_gpus_to_trainer(tmp_path):
    rows = synth(tmp_path / "t.jsonl", R=3.0, T=10.0)
    advice = advise(rows)
    assert advice.diagnosis.label == "train-bound"
    assert advice.recommended.placement.trainer_gpus > 4
    assert_valid(advice)


def test_trainer_memory_floor_is_respected(tmp_path):
    rows = synth(tmp_path / "r.jsonl", R=10.0, T=3.0)
    advice = advise(rows, trainer_min_gpus=4)
    assert advice.recommended.placement.trainer_gpus >= 4
    assert all(c.placement.trainer_gpus >= 4 for c in advice.candidates)
    assert_valid(advice, trainer_min=4)


def test_sync_bound(tmp_path):
    rows = synth(tmp_path / "s.jsonl", R=3.0, T=3.0, S=4.0, nbytes=16e9)
    advice = advise(rows)
    assert advice.diagnosis.label == "sync-bound"
    assert advice.recommended.sync_time <= advice.current.sync_time
    assert_valid(advice)


def test_long_tail_never_adds_rollout_gpus(tmp_path):
    # a few long answers decode alone while the batch has drained; training is 3 s
    rows = synth(tmp_path / "l.jsonl", R=10.0, T=3.0, lengths=long_tail_lengths(), latency_share=0.6)
    advice = advise(rows)
    assert advice.diagnosis.label == "long-tail"
    assert advice.recommended.placement.rollout_gpus <= 4
    assert all(c.placement.rollout_gpus <= 4 for c in advice.candidates)
    assert_valid(advice)
    # the model agrees: the decode fit finds the 60% latency-bound share, which engines do not divide
    m = advice.measurement
    assert m.rollout_fit == "decode-fit" and m.rollout_scalable == pytest.approx(4.0, rel=1e-3)


def test_balanced_keeps_the_layout(tmp_path):
    rows = synth(tmp_path / "b.jsonl", R=5.0, T=5.0)
    advice = advise(rows)
    assert advice.diagnosis.label == "balanced"
    assert advice.recommended.placement == Placement(False, 4, 4)
    assert "keep 4:4" in advice.reason


def test_colocate_recommended_when_no_split_beats_it(tmp_path):
    # colocated run, no tail, rollout and train balanced: a split idles half the GPUs in each phase
    rows = synth(tmp_path / "c.jsonl", trainer=8, rollout=8, colocate=True, R=4.0, T=4.0, S=0.1)
    advice = advise(rows)
    assert advice.recommended.placement == Placement(True, 8, 8)
    assert_valid(advice)


def test_split_across_nodes_pays_the_link(tmp_path):
    """A colocated 8-GPU run asked about 16 GPUs: cross-node splits pay bytes over --link-gbps."""
    rows = synth(tmp_path / "c.jsonl", trainer=8, rollout=8, colocate=True, R=6.0, T=4.0, S=0.1, nbytes=64e9)
    m = measure(rows)
    fast = recommend(m, num_gpus=16, assumptions=ModelAssumptions(link_gbps=400))
    slow = recommend(m, num_gpus=16, assumptions=ModelAssumptions(link_gbps=50))
    split = {c.placement: c for c in fast.candidates if not c.placement.colocate}
    split_slow = {c.placement: c for c in slow.candidates if not c.placement.colocate}
    some = next(iter(split))
    assert split[some].sync_path.startswith("network/") and split_slow[some].sync_time > 7 * split[some].sync_time
    # 64 GB at 400 Gb/s x 0.2 (broadcast) is 6.4 s on the wire
    assert split[some].sync_time == pytest.approx(6.4 + 0.1 - 64e9 * 8 / (16800e9 * 0.5), rel=1e-3)
    for advice in (fast, slow):
        rec = advice.recommended.placement
        assert rec.total_gpus == 16 and (rec.colocate or rec.rollout_gpus % 2 == 0)


def _best_split(advice):
    return min((c for c in advice.candidates if not c.placement.colocate), key=lambda c: c.step_time)


def test_what_if_longer_responses_shift_gpus_to_rollout(tmp_path):
    rows = synth(tmp_path / "w.jsonl", trainer=8, rollout=8, gpe=1, gpn=8, R=6.0, T=6.0,
                 latency_share=0.3, max_len=256, group=8)
    m = measure(rows)
    series = [recommend(m, workload=Workload(max_response_len=L)) for L in (128, 256, 512, 1024)]
    rollout = [_best_split(a).placement.rollout_gpus for a in series]
    steps = [a.current.step_time for a in series]
    assert rollout == sorted(rollout) and rollout[-1] > rollout[0], rollout
    assert steps == sorted(steps) and steps[-1] > steps[0]
    assert all(a.recommended.placement.total_gpus == 16 for a in series)


def test_what_if_group_size(tmp_path):
    """Larger groups lengthen every phase; the best split does not move to rollout in this model,
    because throughput-bound rollout and training both grow linearly in samples while the
    latency-bound part (set by the longest of n samples) grows only ~log n. The issue expected a
    shift to rollout: see the model docstring."""
    rows = synth(tmp_path / "w.jsonl", trainer=8, rollout=8, gpe=1, gpn=8, R=6.0, T=6.0,
                 latency_share=0.3, max_len=256, group=8)
    m = measure(rows)
    series = [recommend(m, workload=Workload(group_size=g)) for g in (4, 8, 16, 64)]
    steps = [a.current.step_time for a in series]
    fixed = [a.current.rollout_time - m.rollout_scalable * g / 8 for a, g in zip(series, (4, 8, 16, 64))]
    assert steps == sorted(steps) and steps[-1] > 6 * steps[0]
    assert fixed == sorted(fixed) and fixed[-1] < 2 * fixed[1]  # the latency-bound part grows, sub-linearly
    rollout = [_best_split(a).placement.rollout_gpus for a in series]
    assert rollout == sorted(rollout, reverse=True), rollout


def test_what_if_more_gpus(tmp_path):
    rows = synth(tmp_path / "w.jsonl", trainer=8, rollout=8, gpe=1, gpn=8, R=6.0, T=6.0)
    m = measure(rows)
    more = recommend(m, num_gpus=32)
    assert more.recommended.step_time < recommend(m).recommended.step_time
    assert more.recommended.placement.total_gpus == 32


def test_measurement_refuses_rows_without_layout(tmp_path):
    with pytest.raises(ValueError, match=r"lacks the layout field\(s\) \['trainer_gpus'"):
        measure([{"perf/step_time": 1.0}], source="x.jsonl")
    with pytest.raises(ValueError, match="mixes layouts"):
        rows = synth(tmp_path / "a.jsonl", steps=2)
        measure(rows + [dict(rows[0], trainer_gpus=6)])
    with pytest.raises(ValueError, match="--n-samples-per-prompt needs the run's own samples per prompt"):
        m = measure(synth(tmp_path / "g.jsonl", group=None, steps=2))
        recommend(m, workload=Workload(group_size=16))


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_cli_json_contract_and_plot(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    synth(path, R=10.0, T=3.0)
    png = tmp_path / "p.png"
    assert cli_main(["advise", "--metrics", str(path), "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["diagnosis"] in ("rollout-bound", "train-bound", "sync-bound", "long-tail", "balanced")
    assert set(out["recommended"]) == {"colocate", "trainer_gpus", "rollout_gpus"}
    assert set(out["predicted_step_time"]) == {"current", "recommended"}
    assert isinstance(out["reason"], str) and out["reason"].endswith(".")
    assert _png_size(png) == (1200, 800) and png.stat().st_size > 10_000
    assert cli_main(["advise", "--metrics", str(path)]) == 0
    text = capsys.readouterr().out
    assert "diagnosis: rollout-bound" in text and "current 4:4: measured" in text


def test_cli_threshold_override_changes_the_diagnosis(tmp_path, capsys):
    path = tmp_path / "r.jsonl"
    synth(path, R=6.0, T=5.0)
    assert cli_main(["advise", "--metrics", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["diagnosis"] == "balanced"
    assert cli_main(["advise", "--metrics", str(path), "--json", "--imbalance", "1.1"]) == 0
    assert json.loads(capsys.readouterr().out)["diagnosis"] == "rollout-bound"


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert cli_main(["advise", "--metrics", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl does not exist" in capsys.readouterr().err
    path = tmp_path / "r.jsonl"
    synth(path, steps=2)
    assert cli_main(["advise", "--metrics", str(path), "--imbalance", "0.5"]) == 2
    assert "--imbalance 0.5 is out of range" in capsys.readouterr().err
    assert cli_main(["advise", "--metrics", str(path), "--trainer-min-gpus", "9"]) == 2
    assert "no layout of 8 GPUs" in capsys.readouterr().err


def test_what_if_group_size_shifts_gpus_to_rollout_once_the_kv_cache_is_full(tmp_path):
    """The same run, now with the engines' KV-cache capacity recorded: while every engine holds all
    its sequences the group does not move GPUs to rollout (as above); once the sequences in flight
    exceed what the cache holds, decoding runs in waves and the best split keeps more GPUs on
    rollout than with a cache that holds everything."""
    import dataclasses

    rows = synth(tmp_path / "w.jsonl", trainer=8, rollout=8, gpe=1, gpn=8, R=6.0, T=6.0,
                 latency_share=0.3, max_len=256, group=8)
    m = measure(rows)
    roomy = dataclasses.replace(m, kv_cache_tokens=10**9, prompt_len=64.0)
    tight = dataclasses.replace(m, kv_cache_tokens=int(m.samples_per_step / 8 * 320), prompt_len=64.0)  # just fits
    groups = (8, 16, 32, 64)
    roomy_split = [_best_split(recommend(roomy, workload=Workload(group_size=g))).placement.rollout_gpus for g in groups]
    tight_split = [_best_split(recommend(tight, workload=Workload(group_size=g))).placement.rollout_gpus for g in groups]
    assert roomy_split == sorted(roomy_split, reverse=True), roomy_split  # as without capacity: no shift to rollout
    assert all(t >= r for t, r in zip(tight_split, roomy_split)) and tight_split[-1] > roomy_split[-1], \
        (tight_split, roomy_split)
    model = fit(tight)
    assert model.waves(m.placement) == 1 and model.waves(m.placement, group=64 / 8) == 8
