"""The plain single-process HF model as the reference the backends are checked against.

Same loss (:func:`base.policy_gradient_loss`), same optimizer and clipping as
:meth:`TrainerBackend.train_step`, without any sharding: a backend is right when its streamed tensors
after a step equal these within fp32 tolerance.
"""

from __future__ import annotations

import math
import os

import torch

from rlplacement.backends.base import policy_gradient_loss, token_log_probs
from rlplacement.config import OptimConfig
from rlplacement.train_io import Batch


def load_hf(hf_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()


def hf_log_probs(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_log_probs(model(input_ids=input_ids, use_cache=False).logits, input_ids)


def hf_reference_step(model, rank_batches: list[Batch], optim: OptimConfig) -> dict[str, float]:
    """One step on data-parallel shares ``rank_batches``: the gradient is the mean of their losses' grads."""
    opt = optim.build(model.parameters())
    opt.zero_grad()
    loss = sum(policy_gradient_loss(token_log_probs(model(input_ids=b.input_ids, use_cache=False).logits,
                                                    b.input_ids), b) for b in rank_batches) / len(rank_batches)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    if optim.max_grad_norm and norm > optim.max_grad_norm:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(optim.max_grad_norm / (norm + 1e-6))
    opt.step()
    return {"loss": float(loss.detach()), "grad_norm": norm}


def random_batch(vocab_size: int, batch: int = 2, seq: int = 12, prompt: int = 4, seed: int = 0) -> Batch:
    """A deterministic batch: random tokens, responses after ``prompt`` tokens, the last row right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq)
    mask[:, prompt:] = 1.0
    mask[-1, seq - 3:] = 0.0  # padding at the end of the last sample
    adv = torch.randn(batch, generator=g)
    return Batch(ids, mask, adv)
