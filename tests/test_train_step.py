"""The train step a GRPO run uses, on the FSDP2 backend over real gloo processes (tiny models, CPU):
micro-batches and data-parallel ranks give the one-piece gradient, mixed precision keeps fp32 master
weights, recompute changes no gradient, a non-finite step is skipped, and a run resumed from a checkpoint
is bit for bit the run that never stopped."""

import json
from pathlib import Path

import pytest
import torch

from rlplacement.backends import launch, train_checkpoint
from rlplacement.backends.hf_reference import random_batch
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.train_io import Batch

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("hf") / "hf", SPEC))


def global_batch(n: int = 8, seq: int = 14, seed: int = 0) -> Batch:
    """Samples of different lengths (right-padded), so micro-batches trim and token packing has work."""
    batch = random_batch(SPEC.vocab_size, batch=n, seq=seq, prompt=3, seed=seed)
    lengths = torch.tensor([seq - (i * 3) % 7 for i in range(n)])
    mask = batch.loss_mask * (torch.arange(seq)[None, :] < lengths[:, None])
    return Batch(batch.input_ids, mask, batch.advantages, None, lengths)


def _backend(hf, train: TrainConfig, optim: OptimConfig = SGD, **options):
    from rlplacement.backends import make_backend

    return make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf), optim, train, **options)


def _share(batch: Batch, rank: int, world: int) -> Batch:
    per = len(batch) // world
    return batch.rows(slice(rank * per, (rank + 1) * per))


def _gradients(rank, world, hf, trains):
    """Full gradients (and the step's sums) of one optimizer step on this rank's share, per train config."""
    out = []
    for train in trains:
        backend = _backend(hf, train)
        backend.set_train(True)
        sums = backend.accumulate_gradients(_share(global_batch(), rank, world))
        grads = {n: p.grad.full_tensor() for n, p in backend.model.named_parameters()}
        out.append({"sums": sums, "grads": grads})
    return out


def _assert_same_gradients(got: dict, want: dict, rtol: float = 1e-6):
    assert set(got) == set(want)
    for name, g in got.items():
        scale = float(want[name].abs().max())
        torch.testing.assert_close(g, want[name], rtol=rtol, atol=rtol * scale, msg=name)


@pytest.mark.slow
def test_micro_batches_and_data_parallel_ranks_give_the_one_piece_gradient(hf):
    whole, static, dynamic = TrainConfig(), TrainConfig(micro_batch_size=3), \
        TrainConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=30)
    one = launch.spawn(_gradients, 1, hf, [whole, static, dynamic], timeout_s=300)[0]
    two = launch.spawn(_gradients, 2, hf, [whole, dynamic], timeout_s=300)
    reference = one[0]
    for got in (one[1], one[2], two[0][0], two[0][1]):
        _assert_same_gradients(got["grads"], reference["grads"])
        assert got["sums"]["tokens"] == reference["sums"]["tokens"]
        assert got["sums"]["loss"] == pytest.approx(reference["sums"]["loss"], rel=1e-6)
    assert two[0][1]["grads"].keys() == two[1][1]["grads"].keys()  # both ranks took part in every micro-batch


def _recompute_and_chunks(rank, world, hf):
    plain = _gradients(rank, world, hf, [TrainConfig(), TrainConfig(gradient_checkpointing=True),
                                         TrainConfig(log_probs_chunk_size=5)])
    return plain


@pytest.mark.slow
def test_recompute_and_log_prob_chunks_change_no_gradient(hf):
    plain, recompute, chunked = launch.spawn(_recompute_and_chunks, 1, hf, timeout_s=300)[0]
    _assert_same_gradients(recompute["grads"], plain["grads"])
    _assert_same_gradients(chunked["grads"], plain["grads"])


def _lr_1e6_step(rank, world, hf, bf16: bool, dtype):
    backend = _backend(hf, TrainConfig(bf16=bf16), OptimConfig(lr=1e-6), dtype=dtype)
    before = {n: p.to_local().detach().clone() for n, p in backend.model.named_parameters()}
    report = backend.train_step(global_batch())
    moved = sum(int((p.to_local().detach() != before[n]).sum()) for n, p in backend.model.named_parameters())
    total = sum(t.numel() for t in before.values())
    streamed = {n: t.dtype for n, t in backend.iter_hf_tensors()}
    return {"moved": moved / total, "param_dtypes": {str(t.dtype) for t in before.values()},
            "streamed": {str(d) for d in streamed.values()}, "loss": report["loss"]}


@pytest.mark.slow
def test_mixed_precision_keeps_an_rl_learning_rate_step_that_pure_bf16_rounds_away(hf):
    """AdamW at lr 1e-6: every update is ~1e-6, below one bf16 ulp of all but the weights nearest 0
    (~6e-5 at 1e-2): fp32 master weights take nearly every element's step, bf16 weights a few percent."""
    mixed = launch.spawn(_lr_1e6_step, 1, hf, True, torch.float32, timeout_s=300)[0]
    pure = launch.spawn(_lr_1e6_step, 1, hf, True, torch.bfloat16, timeout_s=300)[0]
    assert mixed["param_dtypes"] == {"torch.float32"} and mixed["streamed"] == {"torch.bfloat16"}
    assert mixed["moved"] > 0.9, mixed  # fp32 master weights take the step
    assert pure["param_dtypes"] == {"torch.bfloat16"} and pure["moved"] < 0.05, pure  # bf16 weights round it away


def _skip_and_kl(rank, world, hf):
    backend = _backend(hf, TrainConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01), OptimConfig(lr=1e-3))
    batch = global_batch()
    first = backend.train_step(batch)  # policy == reference: the KL term is 0
    before = [p.to_local().detach().clone() for p in backend.model.parameters()]
    bad = Batch(batch.input_ids, batch.loss_mask, torch.full_like(batch.advantages, float("inf")), None,
                batch.lengths)
    skipped = backend.train_step(bad)
    unchanged = all(torch.equal(p.to_local(), b) for p, b in zip(backend.model.parameters(), before))
    after = backend.train_step(batch)
    return {"first_kl": first["kl"], "entropy": first["entropy"], "skipped": skipped, "unchanged": unchanged,
            "after_kl": after["kl"], "after": after}


@pytest.mark.slow
def test_kl_is_zero_at_the_start_and_a_non_finite_step_is_skipped_and_counted(hf):
    for got in launch.spawn(_skip_and_kl, 2, hf, timeout_s=300):
        assert got["first_kl"] == 0.0 and got["entropy"] > 0
        assert got["skipped"]["optimizer_steps"] == 0 and got["skipped"]["skipped_steps"] == 1 and got["unchanged"]
        assert got["after"]["optimizer_steps"] == 1 and got["after"]["skipped_steps"] == 1
        assert got["after_kl"] > 0  # the policy moved away from the reference


TRAIN = TrainConfig(global_batch_size=4, micro_batch_size=1, bf16=False)
ADAMW = OptimConfig(lr=1e-3, lr_decay_style="cosine", lr_decay_iters=10, lr_warmup_iters=2)


def _run(rank, world, hf, save: str | None, load: str | None, calls: range):
    """Train calls ``calls`` (each batch seeded by its call number), saving after the first two when asked;
    returns the weights at the end, gathered."""
    from rlplacement.backends import make_backend

    backend = make_backend(BackendConfig(name="fsdp", hf_checkpoint=hf, load=load), ADAMW, TRAIN)
    for call in calls:
        backend.train_step(_share(global_batch(seed=call), rank, world))
        if save and call == 1:
            backend.save_checkpoint(save, weight_version=call + 1)
            return {"saved": True}
    return {n: p.full_tensor() for n, p in backend.model.named_parameters()} | {
        "_state": {"calls": backend.train_calls, "step": backend.step}}


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_and_resumed_is_bit_exact(hf, tmp_path):
    """Two optimizer steps per call (--global-batch-size 4 of 8 samples), cosine schedule with warmup,
    AdamW: the state saved after call 2 (then the run stops) and loaded by a new set of processes gives
    the weights after call 4 of a run that never stopped, bit for bit."""
    ckpt = str(tmp_path / "ckpt")
    straight = launch.spawn(_run, 2, hf, None, None, range(4), timeout_s=300)[0]
    launch.spawn(_run, 2, hf, ckpt, None, range(4), timeout_s=300)
    assert (Path(ckpt) / train_checkpoint.MARKER).read_text() == "2"
    state = json.loads((Path(ckpt) / "iter_0000002" / train_checkpoint.STATE).read_text())
    assert state == {"train_calls": 2, "step": 4, "skipped_steps": 0, "weight_version": 2, "manifest": True,
                     "job_state": {}}
    resumed = launch.spawn(_run, 2, hf, None, ckpt, range(2, 4), timeout_s=300)[0]
    assert resumed.pop("_state") == straight.pop("_state") == {"calls": 4, "step": 8}
    assert straight.keys() == resumed.keys()
    differing = [n for n in straight if not torch.equal(straight[n], resumed[n])]
    assert differing == []


def test_a_checkpoint_cut_short_is_refused_by_name(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(ConfigError, match=r"no latest_checkpointed_iteration.txt, so it holds no finished"):
        train_checkpoint.latest(root)
    (root / "iter_0000003").mkdir(parents=True)
    (root / "iter_0000003" / train_checkpoint.STATE).write_text("{}")
    (root / train_checkpoint.MARKER).write_text("3")
    with pytest.raises(ConfigError, match=r"iter_0000003/\.metadata is missing, so iteration 3 was cut short"):
        train_checkpoint.latest(root)
    (root / "iter_0000003" / train_checkpoint.DCP_METADATA).write_bytes(b"")
    assert train_checkpoint.latest(root) == root / "iter_0000003"
