"""Megatron trains with megatron-core's own DDP, optimizer and schedules (``backends/megatron_train.py``),
in real gloo processes on the CPU shims: every layout of the same global batch (TP=2, PP=2, DP=2, with
and without the distributed optimizer, in micro-batches) ends two AdamW steps with the weights and
losses of one rank taking it in one piece; a step whose gradient is not finite is skipped, nothing applied."""

import math

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
ADAMW = OptimConfig(name="adamw", lr=1e-3, eps=1e-3, max_grad_norm=1.0)  # eps: a step not just sign(g)


def _batches():
    from rlplacement.backends.hf_reference import random_batch

    return [random_batch(SPEC.vocab_size, batch=4, seq=12, seed=10 + i) for i in range(2)]


def _worker(rank, world, hf, tp, pp, train, nan_step, steps, overlap):
    from megatron.core import parallel_state as ps

    from rlplacement.backends.megatron import MegatronBackend

    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf, tensor_model_parallel_size=tp,
                                                        pipeline_model_parallel_size=pp), ADAMW, train,
                                          overlap_grad_reduce=overlap)
    dp, dp_rank = backend.data_parallel_size, backend.data_parallel_rank
    initial = {n: t.clone() for n, t in backend.iter_hf_tensors()}  # HF names: no TP-dependent vocab padding
    metrics = []
    for i, batch in enumerate(_batches()[:steps]):
        share = len(batch) // dp
        mine = batch.rows(slice(dp_rank * share, (dp_rank + 1) * share))
        if i == nan_step and dp_rank == 0:  # one data-parallel rank's gradient goes NaN
            mine.advantages[:] = float("nan")
        metrics.append(backend.train_step(mine))
    full = {n: t.clone() for n, t in backend.iter_hf_tensors()}
    out = {"metrics": metrics, "params": full if rank == 0 else None, "initial": initial if rank == 0 else None,
           "skipped": backend.skipped_steps, "dp": dp, "stage": ps.get_pipeline_model_parallel_rank()}
    backend.close()
    return out


def _run(tmp_path, world, tp=1, pp=1, nan_step=None, steps=2, overlap=None, **train):
    hf = tmp_path / "hf"
    if not hf.exists():
        make_tiny_model(hf, SPEC)
    return launch.spawn(_worker, world, str(hf), tp, pp, TrainConfig(**train), nan_step, steps, overlap,
                        timeout_s=600)


@pytest.fixture(scope="module")
def one_piece(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, pp, train", [
    (2, 1, 1, {}), (2, 1, 1, {"use_distributed_optimizer": True}), (2, 2, 1, {}), (2, 1, 2, {"micro_batch_size": 1}),
    (1, 1, 1, {"micro_batch_size": 1}),
    (2, 1, 1, {"micro_batch_size": 1, "use_distributed_optimizer": True, "overlap": True}),
], ids=["dp2", "dp2-distributed-optimizer", "tp2", "pp2-micro-batches", "micro-batches",
        "dp2-distributed-optimizer-overlapped-reduce"])
def test_every_layout_takes_the_same_two_steps_as_one_rank_in_one_piece(tmp_path, one_piece, world, tp, pp, train):
    results = _run(tmp_path, world, tp, pp, **train)
    got, want = results[0], one_piece
    for step, (a, b) in enumerate(zip(got["metrics"], want["metrics"])):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), step
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), step
        assert a["optimizer_steps"] == 1
    assert set(got["params"]) == set(want["params"])
    for name, t in want["params"].items():
        torch.testing.assert_close(got["params"][name], t, atol=2e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(t, want["initial"][n]) for n, t in want["params"].items())  # the steps moved it


@pytest.mark.slow
def test_a_step_with_a_non_finite_gradient_is_skipped_on_every_rank(tmp_path):
    results = _run(tmp_path, 2, nan_step=1)  # DP=2: rank 0's share of the second step has NaN advantages
    assert [r["skipped"] for r in results] == [1, 1]
    assert results[0]["metrics"][1]["optimizer_steps"] == 0 and math.isinf(results[0]["metrics"][1]["grad_norm"])
    after_first = _run(tmp_path, 2, steps=1)[0]
    for name, t in after_first["params"].items():  # nothing of the second step was applied
        assert torch.equal(results[0]["params"][name], t), name
