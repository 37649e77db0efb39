"""The slices of every HF tensor a vLLM engine worker keeps, as boxes of the HF tensor, for the dense
families' loaders in vLLM 0.32 (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``/``ParallelLMHead``, replicated norms).

* q/k/v: worker ``w`` of ``tp`` keeps heads ``[w*H/tp, (w+1)*H/tp)`` of q; with fewer KV heads than
  workers, KV head ``w // (tp / KV)`` (replicated over ``tp / KV`` workers), else ``KV/tp`` heads. vLLM
  fuses q, k and v into one ``qkv_proj`` parameter and sends nothing fused over the wire; the plan cuts
  the HF tensors q, k and v by head, and the worker's loader places each slice into its own part of
  ``qkv_proj``. gate/up into ``gate_up_proj`` likewise: each a row chunk of the HF tensor.
* o_proj, down_proj: a column chunk.
* a mixture-of-experts layer's experts (vLLM's fused-MoE loader without expert parallelism): every expert's
  gate_proj/up_proj a row chunk, its down_proj a column chunk, as a dense MLP's; the router whole.
* embed_tokens, lm_head: the vocabulary padded to a multiple of 64, split evenly; rows past the real
  vocabulary are padding the loader zero-fills, so a worker keeps rows ``[w*per, min((w+1)*per, V))``.

The rules are checked against the loaders' own slices in ``tests/test_transfer_plan.py`` (vLLM's
sharding functions at TP 2 and 4).
"""

from __future__ import annotations

from rlplacement.transfer.plan.boxes import Box, volume, whole
from rlplacement.transfer.plan.tensors import ModelTensors

VLLM_VOCAB_PADDING = 64
Needs = list[dict[str, Box]]


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def check_engine_width(model: ModelTensors, tp: int) -> None:
    """Refuse a width vLLM cannot shard this model over, naming the flag."""
    kv = model.num_kv_heads
    padded = vllm_padded_vocab(model.vocab_size)
    bad = [f"num_attention_heads={model.num_heads}"] if model.num_heads % tp else []
    bad += [f"num_key_value_heads={kv}"] if kv % tp and tp % kv else []
    bad += [f"intermediate_size={model.ffn_hidden_size}"] if model.ffn_hidden_size % tp else []
    bad += [f"moe_intermediate_size={model.expert_ffn_hidden_size}"] if model.expert_ffn_hidden_size % tp else []
    bad += [f"the vocabulary padded to {padded}"] if padded % tp else []
    if bad:
        raise ValueError(f"--rollout-num-gpus-per-engine {tp} does not divide {', '.join(bad)} of {model.source}: "
                         f"use a width that does")


def vllm_worker_needs(model: ModelTensors, tp: int) -> Needs:
    """Per worker of a ``tp``-wide engine, the box of every tensor it keeps (a worker whose vocabulary
    shard is all padding keeps no rows of that tensor and is not sent any)."""
    check_engine_width(model, tp)
    padded = vllm_padded_vocab(model.vocab_size)
    out: Needs = [{} for _ in range(tp)]
    for t in model.tensors:
        for w in range(tp):
            box = model.tp_box(t, w, tp, padded)
            if volume(box):
                out[w][t.name] = box
    return out


def whole_model_needs(model: ModelTensors, tp: int) -> Needs:
    """Today's receivers: every worker is sent every tensor whole and its loader keeps its slice."""
    return [{t.name: whole(t.shape) for t in model.tensors} for _ in range(tp)]
