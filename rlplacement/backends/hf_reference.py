"""The plain single-process HF model as the reference the backends are checked against.

Same objective (:func:`objective.policy_loss`), same optimizer, schedule and clipping as
:meth:`TrainerBackend.train_step`, without any sharding, micro-batches or chunking: the whole step's
batch in one piece. A backend is right when its streamed tensors after a step equal these within fp32
tolerance.
"""

from __future__ import annotations

import math
import os

import torch

from rlplacement.backends.objective import TokenStats, policy_loss
from rlplacement.backends.routing_replay import hf_routed
from rlplacement.config import OptimConfig, TrainConfig
from rlplacement.train_io import Batch


def load_hf(hf_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()


def hf_token_stats(model, input_ids: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
                   router_loss=None) -> TokenStats:
    """Log-probs (and entropies) from the full-vocabulary logits, unchunked; a mixture-of-experts model's
    router loss where its config asks for it (``output_router_logits``): HF's ``aux_loss`` times
    ``router_aux_loss_coef``, or ``router_loss(router_logits)`` (per layer, as the model returns them) where given."""
    out = model(input_ids=input_ids, use_cache=False)
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        router_loss = None
    elif router_loss is not None:
        router_loss = router_loss(out.router_logits)
    else:
        router_loss = model.config.router_aux_loss_coef * aux
    logits = out.logits[:, :-1].float() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    zeros = logits.new_zeros(input_ids.shape[0], 1)
    logp = torch.cat([zeros, logp_all.gather(-1, input_ids[:, 1:, None]).squeeze(-1)], dim=1)
    entropy = torch.cat([zeros, -(logp_all.exp() * logp_all).sum(-1)], dim=1) if with_entropy else None
    return TokenStats(logp, entropy, router_loss)


def hf_log_probs(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        return hf_token_stats(model, input_ids, temperature).logp


def hf_reference_step(model, rank_batches: list[Batch], optim: OptimConfig, train: TrainConfig | None = None,
                      reference=None, iteration: int = 0, optimizer=None, router_loss=None) -> dict[str, float]:
    """One optimizer step on the union of ``rank_batches`` (every data-parallel rank's share): the loss is
    the global token mean over all of them. ``reference``: the frozen model of ``--use-kl-loss``;
    ``optimizer``: one built by ``optim.build(model.parameters())`` and kept across steps (default: a
    fresh one, so each call is a first step); ``router_loss``: as :func:`hf_token_stats` takes it."""
    train = train or TrainConfig()
    opt = optimizer if optimizer is not None else optim.build(model.parameters())
    opt.zero_grad()
    tokens = max(float(sum(b.loss_mask.sum() for b in rank_batches)), 1.0)
    loss = 0.0
    for b in rank_batches:
        with hf_routed(model, b.routed_experts):  # each batch's routes, where it replays them
            stats = hf_token_stats(model, b.input_ids, train.rollout_temperature,
                                   with_entropy=bool(train.entropy_coef), router_loss=router_loss)
        ref = hf_log_probs(reference, b.input_ids, train.rollout_temperature) if train.use_kl_loss else None
        part = policy_loss(stats, b, train, tokens, ref).loss
        part.backward()
        loss += float(part.detach())
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    if optim.max_grad_norm and norm > optim.max_grad_norm:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(optim.max_grad_norm / (norm + 1e-6))
    for group in opt.param_groups:
        group["lr"] = optim.lr_at(iteration)
    opt.step()
    return {"loss": loss, "grad_norm": norm}


def random_batch(vocab_size: int, batch: int = 2, seq: int = 12, prompt: int = 4, seed: int = 0) -> Batch:
    """A deterministic batch: random tokens, responses after ``prompt`` tokens, the last row right-padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.zeros(batch, seq)
    mask[:, prompt:] = 1.0
    mask[-1, seq - 3:] = 0.0  # padding at the end of the last sample
    adv = torch.randn(batch, generator=g)
    return Batch(ids, mask, adv)


def megatron_load_balancing_loss(coeff: float, num_experts: int, topk: int):
    """megatron's load-balancing loss (``--moe-router-load-balancing-type aux_loss``) from HF router logits
    ``[tokens, experts]`` per sparse layer: per layer ``coeff x E x sum_e f_e P_e`` with ``f_e`` the share of the
    layer's ``tokens x topk`` assignments to expert e and ``P_e`` its mean softmax probability, summed over the
    layers (HF's ``load_balancing_loss_func`` pools the layers and leaves out the ``1 / topk``)."""

    def loss(router_logits) -> torch.Tensor:
        total = 0.0
        for logits in router_logits:
            probs = torch.softmax(logits.float(), dim=-1)
            chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
            tokens = probs.shape[0]
            total = total + num_experts * (chosen.sum(0) / (tokens * topk) * probs.mean(0)).sum()
        return coeff * total
    return loss
