"""A live named LoRA adapter in a vLLM engine, replaced whole by every adapter-only update.

The engine starts with vLLM's LoRA support on (``enable_lora``, one adapter slot, ``max_lora_rank`` the
smallest vLLM size that holds the rank) and the frozen base from its checkpoint. Each update's tensors
(:mod:`rlplacement.lora_format` names) arrive through the transfer mode like any update; the commit
builds a ``LoRAModel`` from them (vLLM's ``LoRAModel.from_lora_tensors``) and swaps it into the worker's
adapter manager under one id (:data:`ADAPTER_ID`), re-activating it so vLLM copies it into the layers'
slots. Requests then name the adapter (:func:`lora_request`).

Invariants: the adapter is built before the one being served is removed, so a bad update leaves the
previous adapter served; vLLM folds ``alpha / rank`` into ``B`` in place when it packs an adapter, so it is
given copies and the received tensors (hashed for ``--check-weight-update-equal``) stay as sent.
"""

from __future__ import annotations

from typing import Any

ADAPTER_ID = 1
"""The one adapter id every engine serves (vLLM's ids start at 1)."""
ADAPTER_NAME = "rlplacement-policy"
LIVE_PATH = "rlplacement://live-adapter"
"""The path a request's adapter names: never read, since the adapter is installed before any request
names it (vLLM loads from the path only an id its cache lacks)."""

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's allowed ``max_lora_rank`` values (``vllm.config.lora.MaxLoRARanks``)."""


def engine_args(rank: int) -> dict[str, Any]:
    """vLLM's LLM keywords for one live adapter of rank ``rank``."""
    fitting = [r for r in VLLM_RANKS if r >= rank]
    if not fitting:
        from rlplacement.errors import ConfigError

        raise ConfigError(f"--lora-rank {rank}: vLLM serves adapters up to rank {VLLM_RANKS[-1]}; use a smaller "
                          f"rank or --lora-merge-for-rollout")
    return {"enable_lora": True, "max_lora_rank": fitting[0], "max_loras": 1, "max_cpu_loras": 1}


def lora_request():
    """The request field that makes generation use the live adapter."""
    from vllm.lora.request import LoRARequest

    from rlplacement.console import VLLM_INPUT_LOGGER, VLLM_LORA_TOKENIZER_NOTICE, drop_notices

    drop_notices(VLLM_INPUT_LOGGER, VLLM_LORA_TOKENIZER_NOTICE)  # this adapter has no tokenizer of its own

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, LIVE_PATH)


def install(model_runner, staged: list, spec: dict) -> None:
    """Serve ``staged`` (the adapter's ``(name, tensor)`` pairs, every one of ``spec``'s) as the live adapter
    on this worker. ``spec``: ``rank``, ``alpha``, ``target_modules`` (HF names)."""
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(model_runner, "lora_manager", None)
    if manager is None:
        from rlplacement.transfer.base import TransferError

        raise TransferError("an adapter-only update reached an engine started without LoRA (enable_lora): start "
                            "the engines through RLJob with --lora-rank, or add --lora-merge-for-rollout")
    adapters = manager._adapter_manager  # vLLM's LoRAModelManager: the worker manager has no swap-by-object call
    helper = PEFTHelper.from_dict({"r": int(spec["rank"]), "lora_alpha": float(spec["alpha"]),
                                   "target_modules": list(spec["target_modules"])})
    helper.validate_legal(manager.lora_config)
    with torch.no_grad():
        tensors = {name: t.clone() for name, t in staged}  # vLLM scales B in place when it packs the adapter
    model = LoRAModel.from_lora_tensors(ADAPTER_ID, tensors, helper, device="cpu",
                                        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size)
    adapters.remove_adapter(ADAPTER_ID)  # deactivates it too: activate below copies the new one into the slots
    adapters.add_adapter(model)
    adapters.activate_adapter(ADAPTER_ID)
