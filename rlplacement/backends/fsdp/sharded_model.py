"""The HF causal LM under FSDP2, built so that no rank holds the whole model: built on the meta device,
sharded (``fully_shard`` per decoder layer and on the root), allocated shard by shard, and filled by
``torch.distributed.checkpoint`` reading the HF folder's safetensors (each rank reads only the rows it
keeps). Mixed precision is FSDP2's ``MixedPrecisionPolicy``.

The root module is :class:`CausalLMRoot`: the trunk and the output layer in one forward, so FSDP2's
root hooks all-gather the root's parameters (embedding, final norm, output layer) around the chunked
output layer too. Calling the output layer outside the root's forward would read its sharded tensors.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlplacement.backends.objective import TokenStats, chunked_token_stats


class CausalLMRoot(torch.nn.Module):
    """The FSDP2 root: ``lm`` (an HF ``*ForCausalLM``) as a child, so its parameter names stay its own."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The last hidden states ``[B, T, H]``, after the final norm."""
        return self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state

    def forward(self, input_ids: torch.Tensor, *, temperature: float, chunk_tokens: int,
                with_entropy: bool = False) -> TokenStats:
        if getattr(self.lm.config, "output_router_logits", False):
            hidden, router_loss = self._hidden_and_router_loss(input_ids)
        else:
            hidden, router_loss = self.hidden(input_ids), None
        stats = chunked_token_stats(hidden, input_ids, self.lm.lm_head, temperature=temperature,
                                    chunk_tokens=chunk_tokens, with_entropy=with_entropy)
        return stats._replace(router_loss=router_loss)

    def _hidden_and_router_loss(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden states and the routers' load-balancing loss times ``router_aux_loss_coef``, by the
        model's own ``load_balancing_loss_func`` over every sparse layer's router logits (HF's auxiliary loss)."""
        import sys

        cfg = self.lm.config
        out = self.lm.model(input_ids=input_ids, use_cache=False, output_router_logits=True)
        balance = sys.modules[type(self.lm).__module__].load_balancing_loss_func
        loss = balance(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok)
        return out.last_hidden_state, cfg.router_aux_loss_coef * loss


class TorchtitanRoot(CausalLMRoot):
    """The same root over torchtitan's ``Decoder``, told to stop before its output layer (``_skip_lm_head``)."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__(lm)
        lm._skip_lm_head = True

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids)


def recompute_and_compile(layer: torch.nn.Module, *, recompute: bool, compile_layer: bool) -> None:
    """One decoder layer's forward through ``torch.compile`` (its norms, rotary and activations fused;
    FSDP2's hooks stay eager around it) and under non-reentrant activation checkpointing (recomputed in
    the backward pass, where FSDP2 has gathered the layer's parameters again)."""
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    forward = torch.compile(layer.forward) if compile_layer else layer.forward
    if recompute:
        forward = partial(checkpoint, forward, use_reentrant=False)
    layer.forward = forward


def shard(root: torch.nn.Module, layers, device_type: str, mixed_precision: bool) -> None:
    """``fully_shard`` every layer and then the root over the default process group; mixed precision is
    bf16 compute with fp32 gradient reduction over the parameters' own (master) dtype."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision \
        else MixedPrecisionPolicy()
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(root, mesh=mesh, mp_policy=policy)


def build_sharded(hf_dir: str | os.PathLike, device: torch.device, *, mixed_precision: bool,
                  dtype: torch.dtype = torch.float32, gradient_checkpointing: bool = False,
                  trainable: bool = True, weights: bool = True, compile_layers: bool = False,
                  lora=None) -> CausalLMRoot:
    """The model of ``hf_dir`` with ``dtype`` parameters (fp32: the master weights), sharded over the
    default process group, its weights read from the folder. ``mixed_precision``: bf16 compute, fp32
    gradient reduction. ``trainable`` False: a frozen copy (a reference model), no gradients. ``weights``
    False: leave the parameters unset (a training checkpoint fills them next). Recompute is HF's own
    ``gradient_checkpointing_enable``; ``compile_layers``: see :func:`recompute_and_compile`. ``lora`` (a
    :class:`~rlplacement.config.LoRAConfig` that is on): peft's adapters injected before sharding, the base
    frozen, the adapters at their initial values (:mod:`.lora`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora is not None:
        from rlplacement.backends import lora as adapters

        adapters.inject(lm, lora)
    if gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_layers:
        for layer in lm.model.layers:
            recompute_and_compile(layer, recompute=False, compile_layer=True)
    root = CausalLMRoot(lm)
    shard(root, lm.model.layers, device.type, mixed_precision)
    root.to_empty(device=device)
    _rebuild_buffers(root, device)
    if weights:
        load_hf_into(root, hf_dir)
    if lora is not None:
        from rlplacement.lora_format import read_adapter_folder

        adapters.initialise(root.lm, read_adapter_folder(lora.adapter_path) if lora.adapter_path else None)
    if not trainable:
        root.requires_grad_(False)
    return root


def _rebuild_buffers(root: torch.nn.Module, device: torch.device) -> None:
    """Buffers computed at construction (rotary frequencies) are garbage after ``to_empty``: rebuild each
    module that has any from its config, on the host (they are small), and copy them in."""
    for name, module in root.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise RuntimeError(f"{name}: buffers {sorted(own)} cannot be rebuilt after meta-device init (no config)")
        fresh = dict(type(module)(config).named_buffers(recurse=False))
        with torch.no_grad():
            for key, buf in own.items():
                buf.copy_(fresh[key].to(device=device, dtype=buf.dtype))


def load_hf_into(root: CausalLMRoot, hf_dir: str | os.PathLike) -> None:
    """Fill the sharded parameters from the HF folder with ``torch.distributed.checkpoint`` (each rank reads
    its rows; the file's dtype is cast to the parameters'). A tied output layer is the embedding. A
    mixture-of-experts model's fused expert parameters are not in the files under their names (checkpoints
    store each expert apart): each rank reads the experts its shard holds (:func:`_load_local_experts`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from rlplacement.families import family_for

    family = family_for(root.lm.config)
    state = hf_state_dict(root)
    fused = {n: p for n, p in state.items() if family.moe and family.holds_experts(n)}
    dcp.load({n: p for n, p in state.items() if n not in fused}, storage_reader=HuggingFaceStorageReader(str(hf_dir)))
    if fused:
        _load_local_experts(fused, hf_dir, family)


def _load_local_experts(fused: dict[str, Any], hf_dir: str | os.PathLike, family) -> None:
    """Copy each expert this rank's shard of a fused expert parameter holds (FSDP shards dim 0, the experts)
    from its per-expert checkpoint tensors, one expert at a time."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from rlplacement.hf_folder import HFTensors

    read = HFTensors(hf_dir).get
    with torch.no_grad():
        for name, param in fused.items():
            if isinstance(param, DTensor):
                local = param.to_local()
                _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
                first = offset[0]
            else:
                local, first = param, 0
            for key, view in family.checkpoint_views(name, local, first_expert=first):
                view.copy_(read(key).to(view.dtype))


def hf_state_dict(root: CausalLMRoot) -> dict[str, Any]:
    """HF name -> the parameter itself (a DTensor shard), each tied tensor once; LoRA adapters left out, an
    adapted layer's base weight under its HF name."""
    from rlplacement.backends.lora import hf_name, is_adapter

    return {hf_name(n): p for n, p in root.lm.named_parameters() if not is_adapter(n)}
