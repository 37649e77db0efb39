"""Every trainer rank sends its share of an update, through ``RLJob`` on a real vLLM CPU engine of two
workers (TP=2): an FSDP trainer of two ranks (gloo) whose ranks each send their own rows of every tensor
(``transfer.pieces``), ``--update-weight-staging bucket``, each split mode that spreads its senders, every
update checked piece by piece against the trainer's checksums.

One job for the module; the mode is switched per test with ``RLJob.set_transfer``. Full staging with two
senders runs in ``test_job_recovery`` (its trainer has two ranks too).
"""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.transfer.pieces import is_piece, parse_piece  # noqa: E402
from rlplacement.transfer.shards import parse_region_key  # noqa: E402
from tests.transfer_helpers.tiny_job import tiny_job, two_sample_batch  # noqa: E402

pytestmark = pytest.mark.slow

SPREAD_MODES = ["broadcast", "broadcast_packed", "p2p"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with tiny_job(tmp_path_factory, [
            "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "2",
            "--num-gpus-per-node", "4", "--train-backend", "fsdp", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--check-weight-update-equal", "--update-weight-staging", "bucket",
            "--update-weight-buffer-size", "2MiB"], timeout_s=180) as started:
        yield started


@pytest.mark.parametrize("mode", SPREAD_MODES)
def test_both_ranks_send_their_share_and_the_engine_serves_the_trainers_weights(job, mode):
    job.set_transfer(mode, check_equal=True)
    assert len(job.senders) == 2
    for seed in (1, 2):
        job.train(two_sample_batch(seed))
        result = job.update_weights()  # checked: every tensor equal to the trainer's, on both workers
        assert result.checked and job.served_versions() == [job.version]
        per_sender = result.trainer.bytes_per_sender
        assert len(per_sender) == 2 and min(per_sender) > 0 and sum(per_sender) == result.trainer.bytes
        # each rank sent its own rows of every tensor (FSDP2's dim-0 shards, as pieces), computed alike on both
        # ranks before any byte moved: no rank sent a byte it does not hold, and no tensor was gathered
        shares = ray.get([t.update_shares.remote() for t in job.trainers], timeout=60)
        assert shares[0] == shares[1]
        assert all(is_piece(name) for name, _, _ in shares[0])
        assert per_sender == tuple(sum(b for _, b, owner in shares[0] if owner == s) for s in range(2))
        held = _fsdp_rows(job)
        assert {(parse_piece(n)[0], parse_piece(n)[1], owner) for n, _, owner in shares[0]} == held
        assert max(per_sender) <= 1.1 * sum(per_sender) / 2  # rows split evenly: no largest-tensor owner
        received = ray.get(job.engines[0].received_checksums.remote(), timeout=60)  # pieces' parts, "piece[box]"
        assert {parse_region_key(key)[0] for key in received} <= {n for n, _, _ in shares[0]}
        assert any(parse_region_key(key)[1] is not None for key in received)  # a 2-wide engine: slices of pieces
        # each sender of pieces packs buckets of a quarter of the flag's size, at least 1 MiB: the tiny model's
        # shares fit one bucket each, and a worker keeps one buffer per sender of at most that
        paths = ray.get(job.engines[0].call_workers.remote("rlplacement_load_path"), timeout=60)
        assert [p["staging"] for p in paths] == ["bucket", "bucket"]
        assert all(0 < p["staging_bytes"] <= sum(per_sender) + 2 * 64 * len(shares[0]) for p in paths), paths
        assert result.trainer.metrics["perf/update_weights_senders"] == 2
        # the simulator's plan of this layout sends what ran, rank by rank
        assert _planned_bytes_per_sender(job, mode) == per_sender


def _model_tensors(job):
    import os

    from rlplacement.transfer.plan.tensors import ModelTensors

    return ModelTensors.from_hf_config(os.path.join(job.hf_dir, "config.json"))


def _fsdp_rows(job) -> set:
    """``(tensor, box, rank)`` of every rank's rows in the plan's FSDP holdings."""
    from rlplacement.transfer.plan.trainer_shards import fsdp_holdings

    held = fsdp_holdings(_model_tensors(job), len(job.trainers))
    return {(name, box, rank) for rank, boxes in enumerate(held) for name, box in boxes.items()}


def _planned_bytes_per_sender(job, mode) -> tuple[int, ...]:
    """Each trainer rank's bytes in the plan ``plan --simulate-transfer`` prices as running: the rows it holds
    of every tensor it routes (each of its pieces reaches some worker whole or in parts)."""
    from rlplacement.advisor.thresholds import ModelAssumptions
    from rlplacement.transfer.plan.boxes import volume
    from rlplacement.transfer.plan.for_layout import plans_for, trainer_holdings

    model = _model_tensors(job)
    layout = job.placement.layout
    pair = plans_for(model, layout, backend="fsdp", tp=1, pp=1, mode=mode, assumptions=ModelAssumptions())
    assert pair.runs == "spread" and pair.who == "shares"
    held = trainer_holdings(model, "fsdp", len(job.trainers))
    sent = [set() for _ in range(pair.spread.num_senders)]
    for route in pair.spread.routes:
        sent[route.sender].add(route.tensor)
    # the plan that runs sends each worker of the 2-wide engine its slices, not the model
    assert max(pair.spread.bytes_per_receiver().values()) < 0.6 * model.total_bytes
    assert pair.spread_sim is not None and pair.spread.summary()["max_sender_bytes"] <= \
        1.1 * pair.spread.summary()["mean_sender_bytes"]
    return tuple(sum(volume(held[rank][name]) * model.itemsize for name in names) for rank, names in enumerate(sent))


def test_the_engine_generates_after_spread_updates(job):
    job.set_transfer("broadcast", check_equal=True)
    job.train(two_sample_batch(3))
    job.update_weights()
    out = job.generate([[5, 6, 7, 8]], max_tokens=3, exact_lengths=True)
    assert len(out) == 2 and all(len(s.token_ids) == 3 and s.weight_version == job.version for s in out)
