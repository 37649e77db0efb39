"""A live named LoRA adapter in a vLLM engine, replaced whole by every adapter-only update.

The engine starts with vLLM's LoRA support on (``enable_lora``, two adapter slots, ``max_lora_rank`` the
smallest vLLM size that holds the rank) and the frozen base from its checkpoint. Each update's tensors
(:mod:`rlplacement.lora_format` names) arrive through the transfer mode like any update and are written into
the slot that does not serve the adapter, then the adapter is switched to it
(:mod:`rlplacement.engines.vllm.adapter_slots`). Requests name the adapter (:func:`lora_request`) under one
id (:data:`ADAPTER_ID`).

Why two slots: the previous adapter keeps being served from its slot while the next one is written, so an
update that fails part-way leaves it served whole. Why two registered adapters' room (``max_cpu_loras``):
vLLM requires at least as much registry room as slots.
"""

from __future__ import annotations

from typing import Any

ADAPTER_ID = 1
"""The one adapter id every engine serves (vLLM's ids start at 1)."""
ADAPTER_NAME = "rlplacement-policy"
LIVE_PATH = "rlplacement://live-adapter"
"""The path a request's adapter names: never read, since the adapter is installed before any request
names it (vLLM loads from the path only an id its cache lacks)."""
SLOTS = 2
"""Adapter slots on the engine's device: the served one and the one the next update is written into."""

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``)."""


def engine_args(rank: int) -> dict[str, Any]:
    """vLLM's LLM keywords for one live adapter of rank ``rank``."""
    fitting = [r for r in VLLM_RANKS if r >= rank]
    if not fitting:
        from rlplacement.errors import ConfigError

        raise ConfigError(f"--lora-rank {rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}; use a smaller "
                          f"rank or --lora-merge-for-rollout")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": SLOTS, "max_cpu_loras": SLOTS}


def lora_request():
    """The request field that makes generation use the live adapter."""
    from vllm.lora.request import LoRARequest

    from rlplacement.console import VLLM_INPUT_LOGGER, VLLM_LORA_TOKENIZER_NOTICE, drop_notices

    drop_notices(VLLM_INPUT_LOGGER, VLLM_LORA_TOKENIZER_NOTICE)  # this adapter has no tokenizer of its own

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, LIVE_PATH)
