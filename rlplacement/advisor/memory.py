"""GPU memory a layout needs for the model's state, from ``config.json`` alone (a
:class:`~rlplacement.transfer.plan.tensors.ModelTensors`): the busiest trainer rank's weights, gradients and
optimizer state, and each engine worker's served weights. Activations, the KV cache and framework buffers are
not modelled (the engine's KV cache is what ``--vllm-gpu-memory-utilization`` leaves after its weights).

Per parameter, Adam under ``--bf16`` (fp32 master weights and moments):

* megatron: bf16 weights (2 bytes) and fp32 gradient buffers (4) on every rank that holds the parameter;
  fp32 main weights and two moments (12) sharded over the data-parallel ranks with
  ``--use-distributed-optimizer`` (an expert's over its expert-data-parallel ranks, ``DP / EP``), else whole.
  A rank holds its pipeline stage's layers (the embedding on the first stage, the final norm and head on the
  last), a TP shard of each, and ``1 / EP`` of every sparse layer's experts.
* fsdp: fp32 weights (4), gradients (4) and moments (8), every parameter sharded over all trainer ranks,
  plus one decoder layer gathered whole in bf16 while it computes.
* Without ``--bf16`` (fp32 training) weights and gradients are 4 bytes each and megatron keeps no main copy.

A mixture-of-experts model's experts dominate: Qwen3-30B-A3B's are 29 of its 30.5 B parameters, so expert
parallelism is what brings a rank's share down (``--expert-model-parallel-size``)."""

from __future__ import annotations

import dataclasses
import math

from rlplacement.transfer.plan.boxes import volume
from rlplacement.transfer.plan.trainer_shards import expert_of


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """Bytes one trainer rank holds for the model's state."""

    parameters: int
    """Parameter elements this rank holds (its shards)."""
    weights: int
    gradients: int
    optimizer: int
    gathered: int = 0
    """fsdp: the largest decoder layer, gathered whole while it computes."""

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.gathered

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


def _tp_elements(model, t, tp: int) -> int:
    padded = -(-model.vocab_size // tp) * tp
    return max(volume(model.tp_box(t, rank, tp, padded)) for rank in range(tp))


def megatron_rank_memory(model, *, world: int, tp: int, pp: int, ep: int, bf16: bool,
                         distributed_optimizer: bool, lora=None) -> RankMemory:
    """The busiest megatron rank of ``world`` (the pipeline stage holding the most): see the module's rules.
    Under LoRA (``lora`` on) the base is frozen: its weights only, and gradients and optimizer state of the
    stage's adapters alone (:func:`megatron_adapter_elements`). The megatron spec's memory model."""
    dp = world // (tp * pp)
    if dp % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {dp} data-parallel ranks")
    dense, experts = [0] * pp, [0] * pp
    for t in model.tensors:
        n = _tp_elements(model, t, tp)
        if expert_of(t.name) is not None:
            experts[model.stage_of(t, pp)] += n // ep
        else:
            dense[model.stage_of(t, pp)] += n
    stage = max(range(pp), key=lambda s: dense[s] + experts[s])
    held = dense[stage] + experts[stage]
    if lora is not None and lora.enabled:
        adapters = megatron_adapter_elements(model, lora, tp, pp)[stage]
        trained = adapters / dp if distributed_optimizer else adapters
        width = 2 if bf16 else 4
        return RankMemory(held + adapters, width * (held + adapters), width * adapters,
                          int((12 if bf16 else 8) * trained))
    sharded = (dense[stage] / dp + experts[stage] / (dp // ep)) if distributed_optimizer else held
    if bf16:
        return RankMemory(held, 2 * held, 4 * held, int(12 * sharded))
    return RankMemory(held, 4 * held, 4 * held, int(8 * sharded))


def adapter_elements(model, lora) -> int:
    """LoRA's trainable elements: ``rank x (in + out)`` of every adapted layer (``lora.target_modules``)."""
    if lora is None or not lora.enabled:
        return 0
    return sum(lora.rank * (t.shape[0] + t.shape[1]) for t in model.tensors
               if t.name.rsplit(".", 2)[-2] in lora.target_modules and len(t.shape) == 2)


def megatron_adapter_elements(model, lora, tp: int, pp: int) -> list[int]:
    """Each pipeline stage's adapter elements on one TP rank (``backends.megatron.lora``): a column-parallel
    layer's ``A`` whole and ``B`` split over TP, a row-parallel layer's ``A`` split and ``B`` whole."""
    stages = [0] * pp
    for t in model.tensors:
        if t.layer is None or len(t.shape) != 2 or t.name.rsplit(".", 2)[-2] not in lora.target_modules:
            continue
        out, inn = t.shape
        column = t.kind != "row"
        stages[model.stage_of(t, pp)] += (lora.rank * inn + -(-lora.rank * out // tp) if column
                                          else -(-lora.rank * inn // tp) + lora.rank * out)
    return stages


def fsdp_rank_memory(model, *, world: int, bf16: bool, lora=None, tp: int = 1, pp: int = 1, ep: int = 1,
                     distributed_optimizer: bool = False) -> RankMemory:
    """One fsdp rank: every parameter's ``1 / world`` (fp32 weights, gradients and moments) and, under
    ``--bf16``, the largest decoder layer gathered in bf16 (fp32 without). Under LoRA (``lora`` on) the base
    is frozen: its weights only, and gradients and moments of the adapters alone. The fsdp and torchtitan
    specs' memory model (FSDP2 has no model parallelism and shards the optimizer state itself: ``tp``,
    ``pp``, ``ep`` and ``distributed_optimizer`` are taken as every memory model is called, and unused)."""
    adapters = adapter_elements(model, lora)
    share = -(-(sum(math.prod(t.shape) for t in model.tensors) + adapters) // world)
    trained = -(-adapters // world) if adapters else share
    largest = max(_layer_elements(model).values(), default=0)
    return RankMemory(share, 4 * share, 4 * trained, 8 * trained, (2 if bf16 else 4) * largest)


def _layer_elements(model) -> dict[int, int]:
    per_layer: dict[int, int] = {}
    for t in model.tensors:
        if t.layer is not None:
            per_layer[t.layer] = per_layer.get(t.layer, 0) + math.prod(t.shape)
    return per_layer


def engine_worker_weight_bytes(model, tp: int) -> int:
    """The served weights one worker of an engine of ``tp`` GPUs holds in the served dtype: its TP slice of
    every tensor (vLLM's fused-MoE layer slices each expert as megatron does: no expert parallelism)."""
    return sum(_tp_elements(model, t, tp) for t in model.tensors) * model.itemsize


def layout_memory(model, *, backend: str, trainer_gpus: int, tp: int, pp: int, ep: int, bf16: bool,
                  distributed_optimizer: bool, engine_tp: int, lora=None, engine_kind: str = "vllm") -> dict:
    """The busiest trainer rank (``backend``'s memory model: ``BackendSpec.memory``) and an engine worker
    (``engine_kind``'s: ``EngineSpec.worker_weight_bytes``), as JSON (``rlplacement plan --memory``)."""
    from rlplacement.specs.backend import backend_spec
    from rlplacement.specs.engine import engine_spec

    rank = backend_spec(backend).call("memory", model, world=trainer_gpus, tp=tp, pp=pp, ep=ep, bf16=bf16,
                                      distributed_optimizer=distributed_optimizer, lora=lora)
    expert_elements = sum(math.prod(t.shape) for t in model.tensors if expert_of(t.name) is not None)
    return {"backend": backend, "bf16": bf16, "distributed_optimizer": distributed_optimizer,
            "parameters": sum(math.prod(t.shape) for t in model.tensors), "expert_parameters": expert_elements,
            "adapter_parameters": adapter_elements(model, lora),
            "trainer_rank": rank.to_json(), "engine_worker_weights": engine_spec(engine_kind).call("worker_weight_bytes", model, engine_tp)}
