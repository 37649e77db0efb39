"""How RLJob deals a batch to the trainer ranks (no processes: the facade's own arithmetic)."""

import pytest
import torch

from rlplacement.config import Config, PlacementConfig, TrainConfig, TransferConfig, BackendConfig
from rlplacement.errors import ConfigError
from rlplacement.job import RLJob
from rlplacement.train_io import Batch


def job(dp_ranks: list[int], dp: int, **train) -> RLJob:
    config = Config(placement=PlacementConfig(rollout_num_gpus=1), transfer=TransferConfig(mode="broadcast"),
                    backend=BackendConfig(name="fsdp"), train=TrainConfig(**train))
    return RLJob(config=config, placement=None, trainers=[], engines=[], hf_dir="", timeout_s=1.0,
                 data_parallel_ranks=dp_ranks, data_parallel_size=dp, handoff=None, updates=None, engine_info=[])


def batch(n: int, width: int = 6) -> Batch:
    ids = torch.arange(n)[:, None].repeat(1, width)  # row i holds i: which sample went where
    return Batch(ids, torch.ones(n, width), torch.zeros(n), None, torch.full((n,), width))


def test_each_optimizer_step_is_the_same_global_samples_whatever_the_ranks():
    """--global-batch-size 4 of 8 samples on 2 ranks: step 0 is samples 0-3, step 1 samples 4-7, and each
    rank's share is its half of each step, in step order; ranks of one TP group (same dp rank) share."""
    shares = job([0, 0, 1, 1], 2, global_batch_size=4)._shards(batch(8))
    assert [s.input_ids[:, 0].tolist() for s in shares] == [[0, 1, 4, 5], [0, 1, 4, 5], [2, 3, 6, 7], [2, 3, 6, 7]]
    assert [s.input_ids[:, 0].tolist() for s in job([0, 1], 2)._shards(batch(8))] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("n, train, message", [
    (6, {}, r"a batch of 6 samples does not split over 4 data-parallel trainer ranks: use a multiple of 4"),
    (12, {"global_batch_size": 8}, r"not a whole number of optimizer steps of --global-batch-size 8"),
    (8, {"global_batch_size": 8, "micro_batch_size": 3},
     r"--micro-batch-size 3 is larger than a rank's share of an optimizer step \(8 samples over 4 data-parallel "
     r"ranks = 2\)"),
    (8, {"use_dynamic_batch_size": True, "max_tokens_per_gpu": 5},
     r"--max-tokens-per-gpu 5 is below one sample's length \(6 tokens\): raise --max-tokens-per-gpu to 6"),
])
def test_a_batch_the_flags_cannot_train_is_refused_before_any_rank_starts(n, train, message):
    with pytest.raises(ConfigError, match=message):
        job([0, 1, 2, 3], 4, **train)._shards(batch(n))
