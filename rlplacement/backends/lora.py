"""LoRA adapters on the fsdp backend (``--lora-rank``): peft's own LoRA layers
(``peft.inject_adapter_in_model``) put into the HF model before it is sharded, the base frozen.

Chosen over writing our own adapter layers because peft is the implementation HF models are fine-tuned
with and runs on CPU as on GPU; over Megatron-Bridge's PEFT because the fsdp backend trains the HF model
itself. Each adapted layer ``W`` (``...q_proj.base_layer.weight`` once injected) computes
``W x + scaling * B A dropout(x)`` with ``scaling = alpha / rank``. An adapter-only update
(``LoRAConfig.adapter_updates``) sends ``A`` and ``B`` alone under their PEFT names (:func:`peft_name`), which
vLLM serves live with the same scaling; under ``--lora-merge-for-rollout`` the stream sends the merged
``W + scaling * B A`` under the HF name instead.

Initialisation is peft's rule (``A`` Kaiming-uniform with ``a = sqrt(5)``, ``B`` zero: the first forward is
the base model's), drawn from a generator seeded per adapter name so every rank, and a reference model,
draws the same ``A`` whatever its shard (:func:`initial_a`).
"""

from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlplacement.config import LoRAConfig

ADAPTER = "default"
"""peft's adapter name."""


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (``lora_A``/``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def hf_name(name: str) -> str:
    """The HF name of an injected model's base parameter (``.base_layer.`` dropped)."""
    return name.replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    """The saved PEFT name (:mod:`rlplacement.lora_format`) of an injected adapter parameter
    (``model.layers.0.self_attn.q_proj.lora_A.default.weight``)."""
    from rlplacement.lora_format import PEFT_PREFIX

    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def inject(lm: torch.nn.Module, lora: "LoRAConfig") -> None:
    """peft's LoRA layers into ``lm`` on ``lora.target_modules`` (any device, meta included), every other
    parameter frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none")
    on_meta = next(lm.parameters()).is_meta  # adapters made on the meta device too, else beside their layers
    inject_adapter_in_model(config, lm, adapter_name=ADAPTER, low_cpu_mem_usage=on_meta)
    for name, param in lm.named_parameters():
        param.requires_grad_(is_adapter(name))


def initial_a(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole initial ``lora_A`` of the adapter parameter ``name``: peft's Kaiming-uniform (``a = sqrt(5)``),
    from a generator seeded by the name, on the host in fp32."""
    fan_in = shape[1]
    bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))  # kaiming_uniform_ with a = sqrt(5): gain^2 = 2 / (1 + a^2)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def initialise(model: torch.nn.Module, start: dict[str, torch.Tensor] | None = None) -> None:
    """Every adapter of ``model`` (sharded or not) to its initial value, this rank's rows of it: ``A`` by
    :func:`initial_a`, ``B`` zero; or, with ``start`` (saved name -> whole tensor: ``--lora-adapter-path``),
    those tensors."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            if start is None and ".lora_B." in name:
                (param.to_local() if isinstance(param, DTensor) else param).zero_()
            else:
                full = start[peft_name(name)] if start is not None else initial_a(name, tuple(param.shape))
                if isinstance(param, DTensor):
                    local = param.to_local()
                    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                                          param.placements)
                    local.copy_(full[offset[0]:offset[0] + shape[0]])
                else:
                    param.copy_(full)


def adapted(params: dict[str, torch.nn.Parameter], name: str):
    """``(A, B)`` of the base parameter ``name`` where an adapter sits on its layer, else None."""
    if ".base_layer." not in name:
        return None
    prefix = name.split(".base_layer.")[0]
    return params[f"{prefix}.lora_A.{ADAPTER}.weight"], params[f"{prefix}.lora_B.{ADAPTER}.weight"]


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling * B A`` in fp32, in ``weight``'s dtype (a new tensor)."""
    return torch.addmm(weight.float(), b.float(), a.float(), alpha=scaling).to(weight.dtype)
