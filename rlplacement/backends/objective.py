"""The GRPO/PPO objective every backend trains with, and the output layer in token chunks.

Per response token (``loss_mask`` 1): the clipped policy-gradient surrogate, plus ``kl_loss_coef`` x a
KL estimate against a frozen reference, minus ``entropy_coef`` x the policy's entropy. The loss of an
optimizer step is the sum over every response token of every micro-batch and data-parallel rank divided
by the step's total response tokens (a global token mean), so its gradient equals that of the whole
step's batch in one piece however it is cut.

Log-probs are of the sampling distribution: logits divided by ``--rollout-temperature`` first, which is
what the engines report with ``logprobs_mode="processed_logprobs"``. Top-p/top-k truncation is not
applied here: the engine samples from the truncated distribution, whose log-probs are higher than these
on the kept tokens, so the importance ratio of a truncated rollout is biased low by the kept mass.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from rlplacement.config import TrainConfig
from rlplacement.train_io import Batch


class TokenStats(NamedTuple):
    """``[B, T]`` float32 per-token log-probs (``logp[:, 0] = 0``) and, where asked, entropies; for a
    mixture-of-experts model whose ``config.json`` asks for it (``output_router_logits``), the forward's
    router load-balancing loss times ``router_aux_loss_coef`` (a 0-dim tensor)."""

    logp: torch.Tensor
    entropy: torch.Tensor | None = None
    router_loss: torch.Tensor | None = None


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T]`` log-probs of ``input_ids`` under full-vocabulary ``logits`` ``[B, T, V]`` (float32).
    Materialises the whole fp32 log-softmax: the unchunked reference :func:`chunked_token_stats` is
    checked against."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([logp.new_zeros(logp.shape[0], 1), logp], dim=1)


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                 temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, logp.new_zeros(())
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def chunked_token_stats(hidden: torch.Tensor, input_ids: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                        *, temperature: float, chunk_tokens: int, with_entropy: bool = False) -> TokenStats:
    """Per-token log-probs (and entropies) from the last hidden states ``[B, T, H]`` through ``head`` (the
    output layer), ``chunk_tokens`` positions at a time.

    Invariant: no fp32 ``[tokens, vocab]`` tensor larger than one chunk exists at once, forward or backward.
    With gradients on, each chunk runs under activation checkpointing: its logits are dropped after the
    chunk and recomputed in the backward pass, so only the chunk's hidden states and per-token results
    stay alive.
    """
    b, t, h = hidden.shape
    flat = hidden[:, :-1].reshape(-1, h)
    targets = input_ids[:, 1:].reshape(-1)
    logps, entropies = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, flat.shape[0], chunk_tokens):
        piece = (flat[start:start + chunk_tokens], targets[start:start + chunk_tokens])
        if grad:
            logp, ent = checkpoint(_chunk_stats, *piece, head, temperature, with_entropy, use_reentrant=False)
        else:
            logp, ent = _chunk_stats(*piece, head, temperature, with_entropy)
        logps.append(logp)
        entropies.append(ent)
    zeros = hidden.new_zeros(b, 1, dtype=torch.float32)
    logp = torch.cat([zeros, torch.cat(logps).reshape(b, t - 1)], dim=1) if t > 1 else zeros
    entropy = None
    if with_entropy:
        entropy = torch.cat([zeros, torch.cat(entropies).reshape(b, t - 1)], dim=1) if t > 1 else zeros
    return TokenStats(logp, entropy)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from the sampled tokens' log-probs (Schulman's k1, k2, k3);
    ``low_var_kl`` is k3 clamped to [-10, 10], as verl does, so one outlier token cannot dominate."""
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        return (torch.exp(-log_ratio) + log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


class LossParts(NamedTuple):
    """Sums over the micro-batch's response tokens, each already divided by the step's normaliser; the
    parts are detached 0-dim tensors on the loss's device (no host sync per micro-batch)."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor
    clipped: torch.Tensor


def policy_loss(stats: TokenStats, batch: Batch, cfg: TrainConfig, normalizer: float,
                ref_logp: torch.Tensor | None = None) -> LossParts:
    """The objective of one micro-batch: ``sum over its response tokens / normalizer``.

    On policy (``batch.old_logprobs`` None): ``-advantage * log p``; the PPO ratio exp(logp - logp.detach())
    is 1 with the same gradient, so clipping never binds and the plain form is exact. With the behaviour
    policy's log-probs (samples generated by older weights, as in one-step-off): PPO's clipped surrogate
    ``-min(r A, clip(r, 1 - eps_clip, 1 + eps_clip_high) A)`` with ``r = exp(log p - old log p)``.
    ``--use-tis`` (the decoupled form, for tokens of several versions: ``old log p`` is then the trainer's at
    the step's start, the proximal policy): each token's term is also multiplied by the constant
    ``clamp(exp(old log p - rollout log p), tis_clip_low, tis_clip)``, the truncated importance weight of the
    proximal policy over the engine's, per token because a partial rollout's tokens come from different
    versions, truncated so that one token's weight cannot dominate a step (Miles' ``--use-tis``).
    ``normalizer``: the step's response tokens over all micro-batches and data-parallel ranks, divided by
    the number of ranks the gradient is averaged over (backends average gradients across data-parallel
    ranks; this turns the average into the global token sum). A router loss (:class:`TokenStats`) counts
    once per response token of the micro-batch, so the step's is the token-weighted mean of its micro-batches'
    (each micro-batch's load balance is over its own tokens, as in HF's and megatron's losses); it is in
    ``loss`` only.
    """
    logp = stats.logp
    mask = batch.loss_mask.to(logp.dtype)
    adv = batch.advantages.to(logp.dtype)[:, None]
    clipped = logp.new_zeros(())
    if batch.old_logprobs is None:
        per_token = -adv * logp
    else:
        ratio = torch.exp(logp - batch.old_logprobs.to(logp.dtype))
        bounded = ratio.clamp(1 - cfg.eps_clip, 1 + cfg.eps_clip_upper)
        per_token = -torch.minimum(ratio * adv, bounded * adv)
        clipped = ((ratio * adv > bounded * adv).to(logp.dtype) * mask).sum().detach()
    if cfg.use_tis:
        if batch.rollout_logprobs is None or batch.old_logprobs is None:
            raise ValueError("--use-tis needs Batch.rollout_logprobs (the engine's) and Batch.old_logprobs (the "
                             "trainer's at the step's start)")
        weight = torch.exp(batch.old_logprobs.to(logp.dtype) - batch.rollout_logprobs.to(logp.dtype))
        per_token = per_token * weight.clamp(cfg.tis_clip_low, cfg.tis_clip)
    policy = (per_token * mask).sum()
    total = policy
    kl = logp.new_zeros(())
    if cfg.use_kl_loss:
        if ref_logp is None:
            raise ValueError("--use-kl-loss needs the reference model's log-probs")
        kl = (kl_penalty(logp, ref_logp.to(logp.dtype), cfg.kl_loss_type) * mask).sum()
        total = total + cfg.kl_loss_coef * kl
    entropy = logp.new_zeros(())
    if cfg.entropy_coef:
        entropy = (stats.entropy * mask).sum()
        total = total - cfg.entropy_coef * entropy
    if stats.router_loss is not None:
        total = total + stats.router_loss * mask.sum()
    return LossParts(total / normalizer, *(t.detach() / normalizer for t in (policy, kl, entropy, clipped)))
