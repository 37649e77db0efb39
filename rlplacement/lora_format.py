"""The adapter tensors of a LoRA update as trainer and engines both name them: PEFT's saved names
(``base_model.model.<HF module>.lora_A.weight`` ``[rank, in]`` and ``.lora_B.weight`` ``[out, rank]``), the
names vLLM's LoRA loader parses (``vllm.lora.utils.parse_fine_tuned_lora_name``) and a PEFT adapter
folder holds. Pure: the shapes come from ``config.json`` alone (the plan's table of the model's tensors).
"""

from __future__ import annotations

from typing import Any

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the HF module name of every saved adapter tensor."""


def adapter_name(module: str, matrix: str) -> str:
    """The saved name of ``matrix`` (``A`` or ``B``) of the adapter on the HF module ``module``
    (``model.layers.0.self_attn.q_proj``)."""
    return f"{PEFT_PREFIX}{module}.lora_{matrix}.weight"


def adapter_shapes(hf_config: dict[str, Any], rank: int, target_modules: tuple[str, ...] | list[str],
                   source: str = "config.json") -> dict[str, tuple[int, int]]:
    """Saved name -> shape of every adapter tensor of a model with rank-``rank`` adapters on the decoder
    linear layers named in ``target_modules`` (HF names: ``q_proj``, ..., ``down_proj``), in layer order."""
    from rlplacement.transfer.plan.tensors import ModelTensors

    model = ModelTensors.from_hf_config(dict(hf_config), source, dtype="float32")
    shapes: dict[str, tuple[int, int]] = {}
    for tensor in model.tensors:
        module, _, leaf = tensor.name.rpartition(".")
        if tensor.layer is None or leaf != "weight" or len(tensor.shape) != 2:
            continue
        if module.rsplit(".", 1)[-1] in target_modules:
            out_features, in_features = tensor.shape
            shapes[adapter_name(module, "A")] = (rank, in_features)
            shapes[adapter_name(module, "B")] = (out_features, rank)
    return shapes
