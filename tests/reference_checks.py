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
