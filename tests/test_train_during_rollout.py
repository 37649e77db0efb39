"""``--train-during-rollout``'s chunked step (``backends/chunked_step.py``) against the whole-batch step, in real
gloo processes on CPU, fp32: from the same weights, the groups of a batch trained in chunks in a fixed arrival
order end with the parameters of one step on the whole batch (rtol 1e-6), for fsdp and megatron (megatron also
under its distributed optimizer), at one and two data-parallel ranks; once plain (on-policy, one micro-batch,
the clip not binding, so a normaliser off by any factor moves the weights off: checked with a doubled step),
once with everything that changes the loss (micro-batches, KL, entropy, --use-tis, the ratio clip binding,
gradient-norm clipping binding). One spawn per data-parallel size and backend; each rank restores the starting
weights between the runs it compares."""

import dataclasses
import re

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.backends.hf_reference import random_batch
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.train_io import Batch

SPEC = TinySpec(family="qwen3", num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
LIMIT = 1.0
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=LIMIT)
ADAM = OptimConfig(name="adamw", lr=1e-3, eps=1e-3, max_grad_norm=LIMIT)  # megatron's distributed optimizer: Adam only
BUILT = TrainConfig(bf16=False, use_kl_loss=True, kl_loss_coef=0.5)  # the reference model exists for the KL case
CASES = {
    "plain": dataclasses.replace(BUILT, use_kl_loss=False, kl_loss_coef=0.0),
    "everything": dataclasses.replace(BUILT, micro_batch_size=1, entropy_coef=0.01, use_tis=True),
}
ADVANTAGE_SCALE = {"plain": 0.02, "everything": 20.0}  # the norm below LIMIT, then far above it
GROUP = 2
ARRIVAL = [[3], [0, 2], [1]]  # groups in the order they finish: the chunks


def _batch(case: str, old: torch.Tensor | None) -> Batch:
    n, seq = 8, 14
    base = random_batch(SPEC.vocab_size, batch=n, seq=seq, prompt=3, seed=0)
    lengths = torch.tensor([seq - (i * 3) % 7 for i in range(n)])
    mask = base.loss_mask * (torch.arange(seq)[None, :] < lengths[:, None])
    batch = Batch(base.input_ids, mask, base.advantages * ADVANTAGE_SCALE[case], None, lengths)
    if case == "plain":
        return batch
    g = torch.Generator().manual_seed(1)
    old_logprobs = (old + 0.4 * torch.randn(old.shape, generator=g)) * mask  # the ratio clip binds
    rollout = (old_logprobs + 0.2 * torch.randn(old.shape, generator=g)) * mask
    return dataclasses.replace(batch, old_logprobs=old_logprobs, rollout_logprobs=rollout)


def _share(batch: Batch, rows: list[int], rank: int, world: int) -> Batch:
    per = len(rows) // world
    return batch.rows(rows[rank * per:(rank + 1) * per])


def _build(name: str, hf: str, train: TrainConfig, optim: OptimConfig):
    from rlplacement.backends import make_backend

    return make_backend(BackendConfig(name=name, hf_checkpoint=hf), optim, train)


def _params(backend) -> list[torch.Tensor]:
    named = backend._named if hasattr(backend, "_named") else backend.model.named_parameters()
    return [p for _, p in named]


def _restore(backend, saved: list[torch.Tensor]) -> None:
    """The parameters back to ``saved`` and the optimizer to a fresh one's state (Adam's moments and step)."""
    with torch.no_grad():
        for p, s in zip(_params(backend), saved):
            p.copy_(s)
    reload = getattr(backend.optimizer, "reload_model_params", None)
    if reload is not None:  # megatron's main parameters follow the model's
        reload()
    for opt in getattr(backend.optimizer, "chained_optimizers", [backend.optimizer]):
        getattr(opt, "optimizer", opt).state.clear()


def _gathered(backend) -> dict[str, torch.Tensor]:
    """The whole parameters under HF names on rank 0 ({} elsewhere; collective)."""
    return {n: t.clone() for n, t in backend.iter_hf_tensors()}


def _cases(backend, rank: int, world: int) -> dict:
    whole_rows = list(range(8))
    backend.train_config = CASES["plain"]  # a step first: the policy leaves its reference, so KL has a gradient
    backend.train_step(_share(_batch("plain", None), whole_rows, rank, world))
    start = [p.detach().clone() for p in _params(backend)]
    old = backend.log_probs(_batch("plain", None)).cpu()
    out = {}
    for case, train in CASES.items():
        backend.train_config = train
        batch = _batch(case, old)

        _restore(backend, start)
        whole_report = backend.train_step(_share(batch, whole_rows, rank, world))
        whole = _gathered(backend)
        _restore(backend, start)
        for groups in ARRIVAL:
            backend.train_chunk(_share(batch, [g * GROUP + k for g in groups for k in range(GROUP)], rank, world))
        if case == "plain":
            out["refused_mid_step"] = _refused_while_chunks_are_held(backend, rank, world, batch)
        chunked_report = backend.finish_chunked_step()
        chunked = _gathered(backend)
        doubled = None
        if case == "plain":  # a step twice as long: what a normaliser off by 2 would give
            _restore(backend, start)
            optim = backend.optim_config
            backend.optim_config = dataclasses.replace(optim, lr=2 * optim.lr)
            backend.train_step(_share(batch, whole_rows, rank, world))
            backend.optim_config = optim
            doubled = _gathered(backend)
        out[case] = {"whole": whole, "chunked": chunked, "doubled": doubled, "reports": (whole_report, chunked_report)}
    _restore(backend, start)
    out["start"] = _gathered(backend)
    return out if rank == 0 else {"reports": {c: out[c]["reports"] for c in CASES},
                                  "refused_mid_step": out["refused_mid_step"]}


def _refused_while_chunks_are_held(backend, rank: int, world: int, batch: Batch) -> list[str]:
    """What a trainer rank answers to the calls that would zero, drop or lose the held gradients (each refused
    on the rank before any collective)."""
    from tests.transfer_helpers.trainer_refusals import trainer_rank_answers

    return trainer_rank_answers(backend, rank, world, [lambda w: w.train_step(batch.rows(slice(0, 2))),
                                                       lambda w: w.save_checkpoint("/nowhere", 1),
                                                       lambda w: w.offload_to_host()])


def _worker(rank, world, name, hf, builds):
    results = []
    for build, optim in builds:
        backend = _build(name, hf, dataclasses.replace(BUILT, **build), optim)
        results.append(_cases(backend, rank, world))
        backend.close()
    return results


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("hf") / "hf", SPEC))


def _close(got: dict, want: dict, rtol: float = 1e-6) -> list[str]:
    """Names of the tensors of ``got`` not within ``rtol`` of ``want`` (atol: rtol x the tensor's largest value)."""
    off = []
    for name, w in want.items():
        if not torch.allclose(got[name], w, rtol=rtol, atol=rtol * float(w.abs().max())):
            off.append(name)
    return off


def _check_refusals(result: dict) -> None:
    for what, answer in zip(("a train step", "saving a checkpoint", "offloading to host"), result["refused_mid_step"]):
        assert re.search(rf"{what}.* while a step of --train-during-rollout holds its chunks' gradients .*"
                         r"call RLJob.finish_train_during_rollout\(\) first", answer), answer


def _check(result: dict) -> None:
    start = result["start"]
    for case in CASES:
        got = result[case]
        whole_report, chunked_report = got["reports"]
        assert _close(got["chunked"], got["whole"]) == [], case
        assert _close(got["whole"], start), f"{case}: the step moved no parameter"
        for key in ("loss", "kl", "entropy", "clip_fraction", "mean_logprob", "grad_norm"):
            assert chunked_report[key] == pytest.approx(whole_report[key], rel=1e-5, abs=1e-9), (case, key)
        assert chunked_report["optimizer_steps"] == whole_report["optimizer_steps"] == 1
    _check_refusals(result)
    plain, everything = result["plain"], result["everything"]
    assert plain["reports"][0]["grad_norm"] < LIMIT < everything["reports"][0]["grad_norm"]
    assert everything["reports"][0]["clip_fraction"] > 0 and everything["reports"][0]["kl"] != 0
    # the comparison sees a normaliser off by 2: the doubled step is not within the tolerance
    assert _close(plain["doubled"], plain["whole"]), "a doubled step passed as equal"


@pytest.mark.slow
@pytest.mark.parametrize("name, world, builds", [
    ("fsdp", 1, [({}, SGD)]), ("fsdp", 2, [({}, SGD)]),
    ("megatron", 1, [({}, SGD)]), ("megatron", 2, [({}, SGD), ({"use_distributed_optimizer": True}, ADAM)]),
], ids=["fsdp-dp1", "fsdp-dp2", "megatron-dp1", "megatron-dp2-and-distributed-optimizer"])
def test_chunks_in_arrival_order_end_on_the_whole_batch_steps_parameters(hf, name, world, builds):
    results = launch.spawn(_worker, world, name, hf, builds, timeout_s=300)
    for rank_results in results:
        for result in rank_results:
            if "start" in result:
                _check(result)
            else:
                _check_refusals(result)
    if world > 1:  # every rank reports the same step
        for mine, theirs in zip(results[0], results[1]):
            for case in CASES:
                assert theirs["reports"][case][1]["loss"] == pytest.approx(mine[case]["reports"][1]["loss"])


FLAGS = ("--actor-num-gpus-per-node", "4", "--hf-checkpoint", "/m", "--train-during-rollout")
SPLIT = FLAGS + ("--rollout-num-gpus", "4")


@pytest.mark.parametrize("argv, pattern", [
    (("--global-batch-size", "8"), r"--global-batch-size 8 asks for a step every 8 samples.*drop --global-batch-size"),
    (("--train-backend", "torchtitan"), r"the torchtitan backend's chunked step .*use --train-backend fsdp or megatron"),
    (("--one-step-off",), r"--one-step-off trains on samples of older weights.*keep one"),
    (("--fully-async",), r"--fully-async trains on samples of older weights.*keep one"),
    (("--colocate",), r"under --colocate .* add --no-offload-train --no-offload-rollout"),
    (("--colocate", "--no-offload-train"), r"add --no-offload-rollout \(both resident"),
    (("--colocate", "--offload-rollout", "--no-offload-train"), r"add --no-offload-rollout"),
])
def test_what_cannot_equal_the_whole_batch_step_is_refused_by_flag(argv, pattern):
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.errors import ConfigError

    argv = list(FLAGS if "--colocate" in argv else SPLIT) + list(argv)
    with pytest.raises(ConfigError, match=pattern):
        config_from_args(build_parser().parse_args(argv), this_host=False)


def test_split_and_resident_colocated_layouts_are_accepted():
    from rlplacement.args import build_parser, config_from_args
    from rlplacement.config.train import refuse_steps_within_batch
    from rlplacement.errors import ConfigError

    split = config_from_args(build_parser().parse_args(list(SPLIT)), this_host=False)
    assert split.train.train_during_rollout and split.train.global_batch_size is None
    colocated = config_from_args(build_parser().parse_args(
        [*FLAGS, "--colocate", "--no-offload-train", "--no-offload-rollout"]), this_host=False)
    assert colocated.train.train_during_rollout
    refuse_steps_within_batch(split.train, 16)
    with pytest.raises(ConfigError, match=r"--global-batch-size 8 is below this batch's 16 samples"):
        refuse_steps_within_batch(dataclasses.replace(split.train, global_batch_size=8), 16)
