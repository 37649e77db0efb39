"""Probes of a live LoRA adapter inside an engine worker (tests only), reached by name as methods of
``worker_hooks.HookedWorkerExtension``: what the worker serves, and vLLM's own ways of loading and evicting an
adapter to compare with."""

from rlplacement.engines.vllm.live_lora import ADAPTER_ID, ADAPTER_NAME
from rlplacement.transfer.base import tensor_checksum


def _manager(worker):
    return worker.model_runner.lora_manager._adapter_manager


def served_adapter(worker) -> dict:
    """``slot`` (the slot the live adapter is served from, None if none) and the checksum of every view of it
    the LoRA kernels read (``<vLLM module>.<member>.A|B``)."""
    from rlplacement.engines.vllm.adapter_slots import served_slot_tensors

    manager = _manager(worker)
    ids = manager.lora_index_to_id
    slot = ids.index(ADAPTER_ID) if ADAPTER_ID in ids else None
    sums = {} if slot is None else {k: tensor_checksum(t) for k, t in served_slot_tensors(manager, slot).items()}
    return {"slot": slot, "checksums": sums}


def evict_adapter(worker) -> None:
    """Take the live adapter out of its slot as vLLM's LRU eviction does (``deactivate_adapter``): the next
    request naming it makes vLLM activate it again from its registered model."""
    _manager(worker).deactivate_adapter(ADAPTER_ID)


def load_adapter_as_vllm_does(worker, folder: str) -> None:
    """Replace the live adapter by vLLM's own load of the PEFT folder ``folder`` under the same id and name (a
    ``LoRARequest`` from a folder: read on the host, packed, scaled, then ``set_lora`` into a slot)."""
    from vllm.lora.request import LoRARequest

    _manager(worker).remove_adapter(ADAPTER_ID)
    worker.model_runner.lora_manager.add_adapter(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder))
