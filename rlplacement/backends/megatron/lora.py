"""LoRA adapters on megatron's parallel linear layers (``--train-backend megatron --lora-rank``): one adapter per
HF module (``q_proj``, ``k_proj``, ``v_proj`` on ``linear_qkv``; ``o_proj`` on ``linear_proj``; ``gate_proj``,
``up_proj`` on ``linear_fc1``; ``down_proj`` on ``linear_fc2``), so the adapters are exactly peft's on the HF
model and move under PEFT's names (:mod:`rlplacement.lora_format`).

Megatron-Bridge's PEFT imports TransformerEngine, which does not run on these CPUs, so the adapters are
written here on megatron-core's own tensor-parallel regions, the way its parallel layers are:

- a column-parallel layer (``linear_qkv``, ``linear_fc1``; output rows split over TP): each adapter's ``A``
  ``[r, in]`` whole on every TP rank, ``B`` split by rows like the layer's own rows (``[out / tp, r]``). The
  input is replicated; ``A x`` goes through ``copy_to_tensor_model_parallel_region`` (its backward
  all-reduces), so ``A``'s gradient is whole and equal on every TP rank. The parts land where the layer's
  rows are: ``linear_qkv`` per query group ``[q heads; k; v]``, ``linear_fc1`` ``[gate_r; up_r]``.
- a row-parallel layer (``linear_proj``, ``linear_fc2``; input columns split): ``A`` split by columns
  (``[r, in / tp]``), ``B`` ``[out, r]`` whole; ``A x`` is summed over TP by
  ``reduce_from_tensor_model_parallel_region``, so ``B``'s gradient is equal on every TP rank.

Each adapter adds ``alpha / r * B A x`` to its layer's output through a forward hook, so the base layer and its
parameter names are megatron's own; the adapters are submodules (``<layer>.lora``), in megatron's DDP and
optimizer, the base frozen. Replicated adapter tensors are marked not tensor-parallel (megatron counts them once
in the gradient norm). A checkpoint holds the adapters alone (:func:`sharded_state_dict`). Under
TransformerEngine's fused layer-norm linears the hook normalises the input with
the layer's own RMSNorm weight first (not run here: TE needs a GPU). Sequence parallelism and adapter
dropout are refused (:func:`check_supported`). ``A`` starts as :func:`rlplacement.backends.lora.initial_a`
of the HF adapter's name (as the fsdp backend and a peft reference draw it), ``B`` at zero; or both as a PEFT
adapter folder holds them (``--lora-adapter-path``). Tested on gloo at TP=2 and DP=2 (bf16, the distributed
optimizer); with pipeline stages each stage's adapters are gathered over PP (:func:`full_adapters`), untested.
"""

from __future__ import annotations

from typing import Iterator

import torch

from rlplacement.errors import ConfigError

COLUMN_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj")}
ROW_PARTS = {"linear_proj": ("o_proj",), "linear_fc2": ("down_proj",)}
HF_PARENT = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def check_supported(lora, sequence_parallel: bool, moe: bool) -> None:
    """What these adapters do not cover, refused by flag."""
    if sequence_parallel:
        raise ConfigError("--lora-rank with --sequence-parallel: megatron's LoRA adapters here take the layer's "
                          "whole input; drop --sequence-parallel")
    if lora.dropout:
        raise ConfigError(f"--lora-dropout {lora.dropout} with --train-backend megatron: adapter dropout is built on "
                          f"the fsdp backend only; use --lora-dropout 0")
    if moe:
        raise ConfigError("--lora-rank with a mixture-of-experts model: adapters are built for dense models only")
    for layer, parts in COLUMN_PARTS.items():
        chosen = [p for p in parts if p in lora.target_modules]
        if chosen and len(chosen) != len(parts):
            raise ConfigError(f"--target-modules {','.join(lora.target_modules)}: megatron fuses {', '.join(parts)} "
                              f"into {layer}; adapt all of them or none (add "
                              f"{','.join(p for p in parts if p not in chosen)}, or exclude {','.join(chosen)})")


class LayerAdapters(torch.nn.Module):
    """The adapters of one megatron linear layer: ``a.<part>`` and ``b.<part>`` per HF module."""

    def __init__(self, layer: str, hf_prefix: str, parts: tuple[str, ...], in_local: int, outs_local: list[int],
                 rank: int, scaling: float, tp_rank: int, tp: int, shape, device, dtype, start: dict | None = None):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        from rlplacement.backends.lora import initial_a
        from rlplacement.lora_format import adapter_name

        super().__init__()
        self.layer, self.parts, self.scaling, self.shape = layer, parts, scaling, shape
        self.column = layer in COLUMN_PARTS
        self.hf_modules = [f"{hf_prefix}.{part}" for part in parts]
        self.a, self.b = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for part, module, out_local in zip(parts, self.hf_modules, outs_local):
            in_full = in_local if self.column else in_local * tp
            out_full = out_local * tp if self.column else out_local
            if start is None:
                full_a, full_b = initial_a(f"{module}.lora_A.default.weight", (rank, in_full)), None
            else:  # --lora-adapter-path: the folder's whole tensors, this rank's part of each
                full_a, full_b = start[adapter_name(module, "A")], start[adapter_name(module, "B")]
            a = full_a if self.column else full_a.chunk(tp, dim=1)[tp_rank]
            if full_b is None:
                b = torch.zeros(out_local if self.column else out_full, rank)
            else:
                b = full_b.chunk(tp, dim=0)[tp_rank] if self.column else full_b
            self.a[part] = torch.nn.Parameter(a.contiguous().to(device=device, dtype=dtype))
            self.b[part] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
            set_tensor_model_parallel_attributes(self.a[part], not self.column, 1, 1)
            set_tensor_model_parallel_attributes(self.b[part], self.column, 0, 1)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B A x`` laid out as the layer's (local) output."""
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        outs = []
        for part in self.parts:
            h = torch.nn.functional.linear(x, self.a[part])
            h = copy_to_tensor_model_parallel_region(h) if self.column else reduce_from_tensor_model_parallel_region(h)
            outs.append(torch.nn.functional.linear(h, self.b[part]))
        if self.layer == "linear_qkv":  # per query group: [q heads of the group; k; v]
            q, k, v = outs
            groups = k.shape[-1] // self.shape.head_dim
            lead = q.shape[:-1]
            out = torch.cat([q.reshape(*lead, groups, -1), k.reshape(*lead, groups, -1), v.reshape(*lead, groups, -1)],
                            dim=-1).reshape(*lead, -1)
        else:
            out = torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return out * self.scaling


def _hook(adapters: LayerAdapters):
    def add_delta(module, args, output):
        x = args[0]
        norm_weight = getattr(module, "layer_norm_weight", None)
        if norm_weight is not None:  # TransformerEngine's fused layer norm: the adapter sees the normalised input
            eps = float(getattr(module, "eps", 1e-6))
            gamma = norm_weight + 1 if getattr(module, "zero_centered_gamma", False) else norm_weight
            x = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma
        out, bias = output
        return out + adapters.delta(x).to(out.dtype), bias
    return add_delta


def inject(model, lora, shape) -> int:
    """Adapters on ``model``'s (one pipeline stage's) layers named in ``lora.target_modules``, every other
    parameter frozen; returns the adapters made. ``shape``: the model's ``mapping.ModelShape``."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    start = None
    if lora.adapter_path:
        from rlplacement.lora_format import read_adapter_folder

        start = read_adapter_folder(lora.adapter_path)
    model.requires_grad_(False)
    made = 0
    for layer in model.decoder.layers:
        index = layer.layer_number - 1
        for name, module in _linears(layer):
            parts = (COLUMN_PARTS | ROW_PARTS)[name]
            if not any(p in lora.target_modules for p in parts):
                continue
            weight = module.weight
            out_local, in_local = weight.shape
            if name == "linear_qkv":
                heads, groups, d = shape.num_heads // tp, shape.num_query_groups // tp, shape.head_dim
                outs = [heads * d, groups * d, groups * d]
            elif name == "linear_fc1":
                outs = [out_local // 2, out_local // 2]
            else:
                outs = [out_local]
            adapters = LayerAdapters(name, f"model.layers.{index}.{HF_PARENT[name]}", parts, in_local, outs,
                                     lora.rank, lora.scaling, tp_rank, tp, shape, weight.device, weight.dtype, start)
            module.lora = adapters
            module.register_forward_hook(_hook(adapters))
            made += len(parts)
    return made


def _linears(layer) -> Iterator[tuple[str, torch.nn.Module]]:
    attention, mlp = layer.self_attention, layer.mlp
    yield "linear_qkv", attention.linear_qkv
    yield "linear_proj", attention.linear_proj
    if hasattr(mlp, "linear_fc1"):
        yield "linear_fc1", mlp.linear_fc1
        yield "linear_fc2", mlp.linear_fc2


def adapters_of(model) -> list[LayerAdapters]:
    """Every layer's adapters in ``model`` (this stage), in layer order."""
    return [m for m in model.modules() if isinstance(m, LayerAdapters)]


def full_adapters(model) -> dict[str, torch.Tensor]:
    """Collective over the whole model-parallel world: PEFT name -> whole adapter tensor (TP shards gathered,
    every pipeline stage's), the same dict on every rank, in layer order."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlplacement.lora_format import adapter_name

    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    mine: dict[str, torch.Tensor] = {}
    for adapters in adapters_of(model):
        for part, module in zip(adapters.parts, adapters.hf_modules):
            for matrix, param, split_dim in (("A", adapters.a[part], None if adapters.column else 1),
                                              ("B", adapters.b[part], 0 if adapters.column else None)):
                t = param.detach()
                if split_dim is not None and tp > 1:
                    pieces = [torch.empty_like(t) for _ in range(tp)]
                    dist.all_gather(pieces, t.contiguous(), group=tp_group)
                    t = torch.cat(pieces, dim=split_dim)
                mine[adapter_name(module, matrix)] = t
    pp = ps.get_pipeline_model_parallel_world_size()
    if pp == 1:
        return mine
    stages: list = [None] * pp
    dist.all_gather_object(stages, {n: t.cpu() for n, t in mine.items()}, group=ps.get_pipeline_model_parallel_group())
    device = next(iter(mine.values())).device if mine else torch.device("cpu")
    return {n: t.to(device) for stage in stages for n, t in stage.items()}


def sharded_state_dict(model) -> dict:
    """The adapters of ``model`` (this stage) as megatron ``dist_checkpointing`` entries keyed by global layer
    (``lora.layers.<L>.<layer>.<a|b>.<part>``): a TP-split tensor sharded along its split dimension, a
    replicated one marked so (megatron's replica ids), as megatron shards its own parameters."""
    from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

    out = {}
    for layer in model.decoder.layers:
        index = layer.layer_number - 1
        for name, module in _linears(layer):
            adapters = getattr(module, "lora", None)
            if adapters is None:
                continue
            for part in adapters.parts:
                for matrix, param in (("a", adapters.a[part]), ("b", adapters.b[part])):
                    key = f"lora.layers.{index}.{name}.{matrix}.{part}"
                    if getattr(param, "tensor_model_parallel", False):
                        out[key] = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=param.partition_dim)
                    else:
                        out[key] = make_sharded_tensor_for_checkpoint(param, key)
    return out


def peft_name_of(key: str) -> str | None:
    """The PEFT name of the adapter tensor a checkpoint stores under ``key`` (:func:`sharded_state_dict`'s
    keys), None for any other key."""
    from rlplacement.lora_format import adapter_name

    parts = key.split(".")
    if len(parts) != 6 or parts[:2] != ["lora", "layers"] or parts[3] not in HF_PARENT or parts[4] not in "ab":
        return None
    _, _, index, layer, matrix, part = parts
    return adapter_name(f"model.layers.{index}.{HF_PARENT[layer]}.{part}", matrix.upper())


def load_state(model, loaded: dict, folder) -> None:
    """Copy the adapters read back (:func:`sharded_state_dict`'s keys) into ``model``'s (this stage's)."""
    want = sharded_state_dict(model)
    missing = sorted(set(want) - set(loaded))
    if missing:
        raise RuntimeError(f"{folder}: the checkpoint lacks the adapters {missing[:3]}: it was written with other "
                           f"--lora-rank or --target-modules flags")
    with torch.no_grad():
        for key, entry in want.items():
            if loaded[key] is not entry.data:  # megatron may have loaded into the parameter itself
                entry.data.copy_(loaded[key])
