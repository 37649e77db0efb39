"""Log-probs and entropies from one TP rank's vocabulary shard of a Megatron model's logits.

Invariants: the padded vocabulary columns (past the HF vocabulary) are masked to ``-inf``, so the result
equals the HF model's; every sum over the vocabulary is all-reduced over TP through megatron's
differentiable reductions, so the values are differentiable and the same on every TP rank; the fp32 logits
of only one chunk of positions exist at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlplacement.backends.objective import TokenStats


def token_stats(logits: torch.Tensor, input_ids: torch.Tensor, vocab_size: int, chunk: int, temperature: float,
                with_entropy: bool = False) -> TokenStats:
    """``[B, T]`` log-probs (and entropies) from this TP rank's vocabulary shard ``logits`` (``[B, T, V_padded /
    TP]``), the columns from ``vocab_size`` on masked out; differentiable, each sum over the vocabulary
    all-reduced over TP.

    ``chunk`` positions at a time: the fp32 logits of a chunk, their masking and megatron's vocab-parallel
    cross-entropy exist for one chunk at once (with gradients each chunk runs under activation
    checkpointing and is recomputed in backward). The output layer's own logits are whole: megatron's
    ``Float16Module`` hands the last stage's output back in fp32."""
    from megatron.core import parallel_state as ps
    from torch.utils.checkpoint import checkpoint

    b, t, shard = logits.shape
    first = ps.get_tensor_model_parallel_rank() * shard
    padding = torch.arange(first, first + shard, device=logits.device) >= vocab_size
    rows = logits.reshape(-1, shard)  # a view: the model's output is contiguous
    # position p predicts token p + 1; each sample's last position predicts nothing (any target, dropped)
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).reshape(-1)
    grad = torch.is_grad_enabled() and logits.requires_grad
    logps, entropies = [], []
    for start in range(0, rows.shape[0], chunk):
        piece = (rows[start:start + chunk], targets[start:start + chunk], padding, temperature, with_entropy)
        logp, entropy = (checkpoint(_chunk_stats, *piece, use_reentrant=False) if grad
                         else _chunk_stats(*piece))
        logps.append(logp)
        entropies.append(entropy)
    zero = logits.new_zeros(b, 1, dtype=torch.float32)
    logp = torch.cat([zero, torch.cat(logps).reshape(b, t)[:, :-1]], dim=1)
    entropy = torch.cat([zero, torch.cat(entropies).reshape(b, t)[:, :-1]], dim=1) if with_entropy else None
    return TokenStats(logp, entropy)


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, padding: torch.Tensor, temperature: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` (and entropies) for ``[rows, V_padded / TP]`` logits of one chunk."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    fresh = logits.dtype != torch.float32  # then the fp32 copy below is ours to mask in place
    logits = logits.float()
    if temperature != 1.0:
        logits, fresh = logits / temperature, True
    logits = (logits.masked_fill_ if fresh else logits.masked_fill)(padding, float("-inf"))
    # the entropy first: megatron's cross-entropy overwrites its input in place
    entropy = vocab_parallel_entropy(logits, padding) if with_entropy else None
    return -vocab_parallel_cross_entropy(logits, targets), entropy


def vocab_parallel_entropy(logits: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` (``[..., V_padded / TP]``, this TP rank's vocabulary shard, ``-inf`` in
    ``padding``'s columns), the entropy of the softmax over the whole vocabulary: log Z - sum p l, each
    vocabulary sum all-reduced over TP by megatron's differentiable reduction (forward: sum; backward: each
    rank's own share), the max taken out first."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    top = logits.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = (logits - top).masked_fill(padding, 0.0)
    weights = torch.exp(logits - top)  # 0 in the padding
    total = reduce_from_tensor_model_parallel_region(weights.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((weights * shifted).sum(-1))
    return torch.log(total) - weighted / total
