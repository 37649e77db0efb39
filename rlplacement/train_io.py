"""What a train call takes and gives back, between an RL loop, the job and every trainer rank.

:class:`Batch` goes in (tensors, never Python lists: a step of 512 x 4k tokens as nested lists costs
seconds to pickle and ~10x the bytes); :class:`TrainStepReport` comes back from each rank.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Batch:
    """A training batch, right-padded: the whole step's on the driver, one rank's share on a trainer rank.

    ``advantages`` is per sample (GRPO: the group-normalised reward)."""

    input_ids: torch.Tensor
    """``[B, T]`` int64 prompt + response token ids, right-padded."""
    loss_mask: torch.Tensor
    """``[B, T]`` 1 on the response tokens whose log-prob counts, 0 on prompt and padding."""
    advantages: torch.Tensor
    """``[B]`` one advantage per sample."""
    old_logprobs: torch.Tensor | None = None
    """``[B, T]`` the behaviour policy's log-probs (the engine's, at the positions of the tokens it sampled):
    given when samples may be stale (one-step-off), so the loss weighs them by a clipped importance ratio."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.dtype != torch.int64:
            raise ValueError(f"Batch.input_ids must be [B, T] int64, got {tuple(self.input_ids.shape)} "
                             f"{self.input_ids.dtype}")
        if tuple(self.loss_mask.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"Batch.loss_mask shape {tuple(self.loss_mask.shape)} must equal input_ids "
                             f"shape {tuple(self.input_ids.shape)}")
        if tuple(self.advantages.shape) != (self.input_ids.shape[0],):
            raise ValueError(f"Batch.advantages must be [B] = [{self.input_ids.shape[0]}], got "
                             f"{tuple(self.advantages.shape)}")
        if self.old_logprobs is not None and tuple(self.old_logprobs.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"Batch.old_logprobs shape {tuple(self.old_logprobs.shape)} must equal input_ids "
                             f"shape {tuple(self.input_ids.shape)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def rows(self, start: int, stop: int) -> "Batch":
        """Samples ``start .. stop - 1`` (views, no copy)."""
        old = None if self.old_logprobs is None else self.old_logprobs[start:stop]
        return Batch(self.input_ids[start:stop], self.loss_mask[start:stop], self.advantages[start:stop], old)

    def to(self, device: torch.device | str) -> "Batch":
        old = None if self.old_logprobs is None else self.old_logprobs.to(device)
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.advantages.to(device), old)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainStepReport:
    """One trainer rank's account of one optimizer step."""

    rank: int
    """Global trainer rank."""
    loss: float
    """The policy-gradient loss of this rank's share (token mean over its response tokens)."""
    grad_norm: float
    """Global L2 norm of the gradient before clipping (the same on every rank)."""
    lr: float
    """Learning rate of this step."""
    num_tokens: float
    """Response tokens in this rank's share (the loss mask's sum)."""
    mean_logprob: float
    """Mean log-prob of those tokens under the weights before the step."""
    start: float
    """Wall-clock time the step started on this rank (``time.time()``)."""
    end: float
    """Wall-clock time it ended; telemetry records the trainer's own busy time from these, not the driver's wait."""
