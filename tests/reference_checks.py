"""Assertions the backend tests share: what a backend streamed after one step against the plain HF
model after the same step."""

import torch


def assert_streamed_match_reference(streamed_path, ref: torch.nn.Module, atol: float = 2e-6, rtol: float = 1e-5):
    """Every HF parameter was streamed, under its HF name, and is close to the reference's."""
    streamed = torch.load(streamed_path)
    expected = dict(ref.named_parameters())
    assert set(streamed) == set(expected)
    for name, tensor in streamed.items():
        torch.testing.assert_close(tensor, expected[name].detach(), atol=atol, rtol=rtol, msg=name)


def step_and_share_stream(backend, batch, streamed_path, rank: int):
    """One rank's part of a multi-rank backend check: log-probs, one step, then the streamed tensors,
    which only rank 0 yields and saves, loaded back on every rank. Returns (logp, metrics, streamed)."""
    import torch.distributed as dist

    logp = backend.log_probs(batch)
    metrics = backend.train_step(batch)
    streamed = dict(backend.iter_hf_tensors())
    assert (len(streamed) > 0) == (rank == 0), "only rank 0 yields"
    if rank == 0:
        torch.save(streamed, streamed_path)
    dist.barrier()
    return logp, metrics, torch.load(streamed_path)
