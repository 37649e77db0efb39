"""Megatron's mixture-of-experts layer under expert parallelism (EP=2 on two gloo ranks) with each rank's share
holding a different number of tokens, as every real batch does (samples of different lengths, and here a
different number of samples too): for each token dispatcher the log-probs and one training step equal those
of the same shares at EP=1 (no expert parallelism: nothing crosses ranks inside a forward), and the log-probs
equal the HF model's sample by sample. Taken whole, in fixed-size micro-batches (the ranks then run
different numbers of them) and packed by tokens (the ranks agree on one count)."""

import pytest
import torch

from rlplacement.backends import launch
from rlplacement.config import BackendConfig, MoEConfig, OptimConfig, TrainConfig
from rlplacement.models.tiny import TinySpec, make_tiny_model
from rlplacement.train_io import Batch

SPEC = TinySpec(family="qwen3_moe", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                num_experts=6, num_experts_per_tok=2)
SGD = OptimConfig(name="sgd", lr=0.5, max_grad_norm=None)
AUX = 0.1  # the load-balancing loss trained: the tokens added to line the ranks up must not count in it
SHARE_LENGTHS = ([12, 11, 9], [7, 5])  # rank 0: 3 samples, 12 wide; rank 1: 2 samples, 7 wide
BATCHING = {"whole": TrainConfig(),
            "micro-batch-size": TrainConfig(micro_batch_size=1),  # 3 micro-batches on rank 0, 2 on rank 1
            "dynamic": TrainConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=24)}  # 2 packs and 1, agreed 2


def share_of(rank: int) -> Batch:
    """Rank ``rank``'s share: random tokens, each sample right-padded past its length, its response from
    position 3 to its end."""
    lengths = SHARE_LENGTHS[rank]
    width = max(lengths)
    g = torch.Generator().manual_seed(20 + rank)
    ids = torch.randint(0, SPEC.vocab_size, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        ids[i, n:] = 0
        mask[i, 3:n] = 1.0
    return Batch(ids, mask, torch.randn(len(lengths), generator=g), lengths=torch.tensor(lengths))


def _log_probs_and_step(rank, world, hf, dispatcher, ep, train):
    from rlplacement.backends.megatron.backend import MegatronBackend
    from rlplacement.transfer.spec import RANK0

    moe = MoEConfig(aux_loss_coeff=AUX, token_dispatcher_type=dispatcher, router_dtype="fp32")
    backend = MegatronBackend.from_config(BackendConfig(name="megatron", hf_checkpoint=hf, moe=moe,
                                                        expert_model_parallel_size=ep), SGD, train)
    share = share_of(rank)
    logp = backend.log_probs(share)
    metrics = backend.train_step(share)
    after = {n: t.clone() for n, t in backend.iter_update_tensors(RANK0)}
    logp_after = backend.log_probs(share)
    backend.close()
    return {"logp": logp, "metrics": metrics, "after": after if rank == 0 else None, "logp_after": logp_after}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "hf", SPEC)


_expert_parallel_free: dict[str, list] = {}


def expert_parallel_free(hf, batching: str) -> list:
    """The EP=1 run of ``batching`` (made once per batching): the reference every dispatcher is held to."""
    if batching not in _expert_parallel_free:
        _expert_parallel_free[batching] = launch.spawn(_log_probs_and_step, 2, str(hf), "alltoall", 1,
                                                       BATCHING[batching], timeout_s=300)
    return _expert_parallel_free[batching]


@pytest.mark.slow
@pytest.mark.parametrize("batching", list(BATCHING))
@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_ranks_with_uneven_shares_match_the_run_without(hf_dir, dispatcher, batching):
    from rlplacement.backends.hf_reference import hf_log_probs, load_hf

    results = launch.spawn(_log_probs_and_step, 2, str(hf_dir), dispatcher, 2, BATCHING[batching], timeout_s=300)
    reference = expert_parallel_free(hf_dir, batching)
    hf = load_hf(hf_dir)
    for rank, (res, ref) in enumerate(zip(results, reference)):
        share = share_of(rank)
        assert res["logp"].shape == share.input_ids.shape
        for i, n in enumerate(SHARE_LENGTHS[rank]):  # each sample alone through the HF model
            alone = hf_log_probs(hf, share.input_ids[i:i + 1, :n])[0]
            assert (res["logp"][i, :n] - alone).abs().max().item() <= 1e-5, (rank, i)
        assert (res["logp"] - ref["logp"]).abs().max().item() <= 1e-5
        assert (res["logp_after"] - ref["logp_after"]).abs().max().item() <= 1e-5
        for key in ("loss", "grad_norm", "mean_logprob", "num_tokens"):
            assert res["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    assert results[0]["metrics"]["optimizer_steps"] == 1
    from safetensors.torch import load_file

    before = {n: t for f in sorted(hf_dir.glob("*.safetensors")) for n, t in load_file(f).items()}
    moved = [n for n, t in reference[0]["after"].items() if not torch.equal(t, before[n])]
    assert any(".mlp.gate." in n for n in moved) and any(".experts." in n for n in moved)  # the step did train
    assert sorted(results[0]["after"]) == sorted(reference[0]["after"])
    worst = {n: (t - reference[0]["after"][n]).abs().max().item() for n, t in results[0]["after"].items()}
    assert max(worst.values()) <= 1e-5, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
def test_the_example_loop_trains_a_mixture_of_experts_model_at_ep2_with_the_default_dispatcher(tmp_path):
    """A new user's run: the example loop, megatron at --expert-model-parallel-size 2 with the default token
    dispatcher (allgather) and the load-balancing loss, samples of every length. Each step's update checked
    tensor by tensor, and the engine's log-probs of its samples equal the trainer's (the trainer's are computed
    on the lined-up micro-batches)."""
    import json

    from tests.test_tiny_grpo import run_loop

    telemetry = tmp_path / "tel.jsonl"
    proc = run_loop(tmp_path, "--steps", "2", "--tiny-model-family", "qwen3_moe", "--train-backend", "megatron",
                    "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2", "--moe-aux-loss-coeff",
                    "0.01", "--check-weight-update-equal", "--telemetry", str(telemetry), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in telemetry.read_text().splitlines()]
    assert len(rows) == 2 and all(row["perf/update_weights_checked"] == 1 for row in rows)
    assert max(row["rollout/logprob_abs_diff"] for row in rows) < 1e-5
