"""The live adapter written straight into vLLM's stacked LoRA slots on the engine's device, then served by
switching the adapter's slot.

vLLM's LoRA linear layers keep per adapter slot ``lora_a_stacked[i][slot]`` ``[max_rank, in]`` and
``lora_b_stacked[i][slot]`` ``[out, max_rank]``, one ``i`` per packed member (q/k/v of ``qkv_proj``, gate/up
of ``gate_up_proj``); its punica kernels read the slot ``LoRAModelManager.lora_index_to_id`` gives a request's
adapter id. The engine starts with two slots (``live_lora.engine_args``). One update, on every worker:

1. :meth:`AdapterSlots.prepare`, while the update is staged (nothing served changes): the staged tensors are
   copied into the idle one of two whole-adapter buffer sets on the device, cast to the LoRA dtype, and
   ``alpha / rank`` is folded into every B after the cast, as vLLM's own load folds it (so the bytes equal a
   fresh load's); then this worker's tensor-parallel part of each (the layer's own ``slice_lora_a`` /
   ``slice_lora_b``, the cut ``set_lora`` makes) goes into the idle slot, whatever the slot held past the
   adapter's rank zeroed. On a GPU the copies of each step run as one chunk-kernel launch
   (``engines.copy_kernel``), and the stream is synchronized before it returns: the slot is whole before
   anything can name it, and the staging buffers may be reused.
2. :meth:`AdapterSlots.switch`, the commit: the adapter id is mapped to that slot, the manager's remembered
   mapping is forgotten so its next step rebuilds the punica metadata from the new slot layout (vLLM 0.32
   notices a layout change itself; 0.26 compares the batch's mapping only), and the registered ``LoRAModel``
   is given the new buffer set, so an eviction followed by vLLM's re-activation (``activate_adapter`` ->
   ``set_lora``) restores these weights, never older ones.

Invariants: until :meth:`switch` every request reads the previous adapter's slot and the registered model
holds the previous buffer set, so an update failing anywhere before it (in transfer, validation or a copy)
leaves the previous adapter served whole; :meth:`switch` on this path is assignments only. A slot another
adapter occupies is taken through vLLM's ``deactivate_adapter`` (that adapter is re-activated from its
registered model when next named). Where no slot serves the adapter (the first update, or after an eviction)
:meth:`switch` registers or updates the model and activates it through vLLM (``set_lora`` from the device
buffers). The prefix cache, whose key holds the adapter's name, is reset by the engine after every update
(``vllm_pause``). Memory: two whole adapters in the LoRA dtype on the device beside vLLM's slots, no host copy.
"""

from __future__ import annotations

from typing import Any, Sequence

from rlplacement.engines.vllm.live_lora import ADAPTER_ID
from rlplacement.transfer.base import TransferError


class AdapterSlots:
    """Two-slot updates of the live adapter on one worker; see the module docstring. ``worker_manager``:
    vLLM's worker LoRA manager (``model_runner.lora_manager``); ``spec``: ``rank`` and ``alpha``."""

    def __init__(self, worker_manager, spec: dict):
        import torch

        self.manager = worker_manager._adapter_manager  # the LoRAModelManager: the worker manager has no slot calls
        self.rank, self.alpha = int(spec["rank"]), float(spec["alpha"])
        self.scaling = self.alpha / self.rank
        self.dtype = self.manager.lora_config.lora_dtype
        self.device = torch.device(self.manager.device)
        model = self.manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)  # the renames vLLM's own adapter load applies
        # without the fusion maps, so members (q_proj) keep their names: get_rename_mapper in vLLM 0.32,
        # get_unstacked_mapper in 0.26
        renames = getattr(mapper, "get_rename_mapper", None) or getattr(mapper, "get_unstacked_mapper", None)
        self._mapper = renames() if renames is not None else mapper
        # (vLLM module, its LoRA layer, the adapter's module name of each packed member)
        self.layers = [(name, layer, list(self.manager.packed_modules.get(name, [name])))
                       for name, layer in self.manager.modules.items()]
        self._sets: list[dict | None] = [None, None]  # per set: (adapter module, is A) -> whole folded tensor
        self._loras: list[dict | None] = [None, None]  # per set: vLLM module -> vLLM's weights object over it
        self._registered_set: int | None = None
        self._prepared: tuple[int, int, int | None] | None = None  # (version, set, slot written or None)
        self._keys: dict[str, tuple[str, bool]] = {}
        self._plans: dict[tuple, tuple] = {}  # cached copy lists and fused copies (their sources' addresses)
        self.last_slot: int | None = None

    # ---- prepare -----------------------------------------------------------------------------------------
    def prepare(self, staged: Sequence, version: int) -> None:
        """Write ``staged`` (the adapter's ``(name, tensor)`` pairs) into the idle buffer set and, where a slot
        serves the adapter, into the other slot; nothing served changes."""
        import torch

        self._prepared = None
        new = 0 if self._registered_set is None else 1 - self._registered_set
        keys = [self._key(name) for name, _ in staged]
        buffers = self._buffers(new, keys, staged)
        with torch.no_grad():
            self._copy(("set", new), buffers, [t for _, t in staged])
            if self.scaling != 1:
                torch._foreach_mul_([b for b, (_, is_a) in zip(buffers, keys) if not is_a], self.scaling)
            served = self._served_slot()
            slot = self._idle_slot(served) if served is not None else None
            if slot is not None:
                self._write_slot(slot, new)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._prepared = (int(version), new, slot)

    def _key(self, name: str) -> tuple[str, bool]:
        key = self._keys.get(name)
        if key is None:
            from vllm.lora.utils import parse_fine_tuned_lora_name

            key = self._keys[name] = parse_fine_tuned_lora_name(name, self._mapper)
        return key

    def _buffers(self, index: int, keys: list, staged: Sequence) -> list:
        """Set ``index``'s tensors for ``keys``, allocated on first use; every key must belong to a LoRA layer."""
        import torch

        held = self._sets[index]
        if held is None or set(held) != set(keys):
            members = {m for _, _, ms in self.layers for m in ms}
            stray = next((name for (name, _), key in zip(staged, keys) if key[0] not in members), None)
            if stray is not None:
                raise TransferError(f"adapter tensor {stray!r} belongs to no LoRA layer of this engine "
                                    f"(vLLM's: {sorted(members)[:3]}...)")
            held = {key: torch.empty(tuple(t.shape), dtype=self.dtype, device=self.device)
                    for key, (_, t) in zip(keys, staged)}
            self._sets[index], self._loras[index] = held, None
            self._plans = {k: v for k, v in self._plans.items() if k[-1] != index}
        return [held[key] for key in keys]

    def _served_slot(self) -> int | None:
        ids = self.manager.lora_index_to_id
        return ids.index(ADAPTER_ID) if ADAPTER_ID in ids and self.manager.get_adapter(ADAPTER_ID) else None

    def _idle_slot(self, served: int) -> int | None:
        """A slot other than ``served``: a free one, else one another adapter holds, taken from it through
        vLLM's ``deactivate_adapter``; None with a single slot."""
        ids = self.manager.lora_index_to_id
        others = [i for i in range(len(ids)) if i != served]
        if not others:
            return None
        slot = next((i for i in others if ids[i] is None), others[0])
        if ids[slot] is not None:
            self.manager.deactivate_adapter(ids[slot])
        return slot

    def _write_slot(self, slot: int, index: int) -> None:
        """Set ``index``'s tensors, cut to this worker's part, into ``slot``; the rest of the slot zeroed, and
        the LoRA layers the adapter does not cover (the embedding, the head) reset as vLLM's activation does."""
        import torch

        plan = self._plans.get(("slot", slot, index))
        if plan is None:
            plan = self._plans[("slot", slot, index)] = self._slot_plan(slot, index)
        resets, zeros, dsts, srcs = plan
        for layer in resets:
            layer.reset_lora(slot)
        if zeros:
            torch._foreach_zero_(zeros)
        self._copy(("slot", slot, index), dsts, srcs)

    def _slot_plan(self, slot: int, index: int) -> tuple[list, list, list, list]:
        """(layers to reset, views to zero, slot views, set views) of one slot write."""
        tensors = self._sets[index]
        resets, zeros, dsts, srcs = [], [], [], []
        for name, layer, members in self.layers:
            a = [tensors.get((m, True)) for m in members]
            b = [tensors.get((m, False)) for m in members]
            if all(t is None for t in a + b):
                resets.append(layer)
                continue
            if len(getattr(layer, "lora_a_stacked", ())) != len(members):
                raise TransferError(f"vLLM's LoRA layer {name} ({type(layer).__name__}) is not a linear layer of "
                                    f"{len(members)} packed member(s): adapter-only updates cover the decoder's "
                                    f"linear layers")
            if layer.tp_size > 1:  # the worker's part, cut by the layer's own rule (views where it can)
                a, b = _cut(layer.slice_lora_a, a), _cut(layer.slice_lora_b, b)
            for i, (a_i, b_i) in enumerate(zip(a, b)):
                for src, stacked in ((a_i, layer.lora_a_stacked[i][slot, 0]), (b_i, layer.lora_b_stacked[i][slot, 0])):
                    if src is None or tuple(src.shape) != tuple(stacked.shape):
                        zeros.append(stacked)
                    if src is not None:
                        dsts.append(stacked[: src.shape[0], : src.shape[1]])
                        srcs.append(src)
        return resets, zeros, dsts, srcs

    def _copy(self, key: tuple, dsts: list, srcs: list) -> None:
        """``dsts[i] <- srcs[i]`` for every i: on a GPU the eligible ones in one chunk-kernel launch (kept per
        ``key`` while the sources stay where they were), the others in one ``_foreach_copy_``."""
        import torch

        if not dsts:
            return
        if self.device.type == "cuda":
            from rlplacement.engines import copy_kernel

            where = tuple(s.data_ptr() for s in srcs)
            cached = self._plans.get(("fused", *key))
            if cached is None or cached[0] != where:
                fused = copy_kernel.fuse(dsts, srcs)
                cached = self._plans[("fused", *key)] = (where, None if isinstance(fused, str) else fused)
            fused = cached[1]
            if fused is not None:
                fused.launch()
                if fused.rest:
                    torch._foreach_copy_([dsts[i] for i in fused.rest], [srcs[i] for i in fused.rest])
                return
        torch._foreach_copy_(dsts, srcs)

    # ---- switch ------------------------------------------------------------------------------------------
    def switch(self, version: int) -> None:
        """Serve what :meth:`prepare` wrote for ``version``."""
        if self._prepared is None or self._prepared[0] != int(version):
            raise TransferError(f"the live adapter of version {version} was not prepared on this worker")
        _, new, slot = self._prepared
        self._prepared = None
        loras = self._weights(new)
        manager = self.manager
        registered = manager.get_adapter(ADAPTER_ID)
        if slot is not None and registered is not None and self._served_slot() is not None:
            ids = [None if i == ADAPTER_ID else i for i in manager.lora_index_to_id]
            ids[slot] = ADAPTER_ID
            manager.lora_index_to_id = ids
            manager._last_mapping = None  # rebuild the punica metadata at the next step (see the module docstring)
            registered.loras = loras
        elif registered is not None:  # registered, in no slot: vLLM activates it from the new buffers
            old = registered.loras
            registered.loras = loras
            manager.deactivate_adapter(ADAPTER_ID)
            try:
                manager.activate_adapter(ADAPTER_ID)
            except BaseException:
                manager.deactivate_adapter(ADAPTER_ID)
                registered.loras = old
                raise
            slot = self._served_slot()
        else:
            from vllm.lora.lora_model import LoRAModel

            manager.add_adapter(LoRAModel(ADAPTER_ID, self.rank, loras))
            try:
                manager.activate_adapter(ADAPTER_ID)
            except BaseException:
                manager.remove_adapter(ADAPTER_ID)
                raise
            slot = self._served_slot()
        self._registered_set, self.last_slot = new, slot

    def _weights(self, index: int) -> dict:
        """vLLM module -> vLLM's weights object over set ``index``'s tensors, as a fresh load registers them:
        packed members in one ``PackedLoRALayerWeights``, scaling already folded (1)."""
        if self._loras[index] is None:
            from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

            tensors, loras = self._sets[index], {}
            for name, _, members in self.layers:
                a = [tensors.get((m, True)) for m in members]
                b = [tensors.get((m, False)) for m in members]
                if all(t is None for t in a):
                    continue
                if len(members) == 1:
                    loras[name] = LoRALayerWeights(module_name=name, rank=self.rank, lora_alpha=self.alpha,
                                                   lora_a=a[0], lora_b=b[0], scaling=1)
                else:
                    present = [t is not None for t in a]
                    loras[name] = PackedLoRALayerWeights(
                        module_name=name, rank=self.rank, lora_alphas=[self.alpha if p else None for p in present],
                        lora_a=a, lora_b=b, scaling=[1 if p else None for p in present])
            self._loras[index] = loras
        return self._loras[index]

    def forget_staged(self) -> None:
        """Drop the fused copies out of the staging buffers (freed by the receiver; rebuilt when next used)."""
        self._plans = {k: v for k, v in self._plans.items() if k[:2] != ("fused", "set")}


def served_slot_tensors(manager, slot: int) -> dict[str, Any]:
    """``<vLLM module>.<member>.A|B`` -> the stacked LoRA buffers' view of ``slot``, for every linear LoRA
    layer (the embedding's and the head's buffers are laid out otherwise)."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    out = {}
    for name, layer in manager.modules.items():
        if isinstance(layer, BaseLinearLayerWithLoRA):
            for i, (a, b) in enumerate(zip(layer.lora_a_stacked, layer.lora_b_stacked)):
                out[f"{name}.{i}.A"], out[f"{name}.{i}.B"] = a[slot, 0], b[slot, 0]
    return out


def _cut(slicer, tensors: list) -> list:
    """A LoRA layer's ``slice_lora_a``/``slice_lora_b`` on its members: a single member goes in as a tensor,
    packed ones as a list, as ``set_lora`` passes them."""
    if len(tensors) == 1:
        return [slicer(tensors[0]) if tensors[0] is not None else None]
    return list(slicer(tensors))
