"""The built-in rollout engine kind's spec (vllm), registered on import
(:mod:`rlplacement.specs.engine` imports this module on its first lookup), and the mapping of the
rollout settings to its keywords. Torch-free."""

from __future__ import annotations

from typing import Any

from rlplacement.specs.engine import register_engine
from rlplacement.specs.engine import EngineSpec


def vllm_engine_kwargs(rollout) -> dict[str, Any]:
    """The vLLM engine's keywords from a ``RolloutConfig``: its dtype, context, CUDA graphs and, where set,
    the GPU memory share (``--vllm-*`` flags)."""
    kwargs: dict[str, Any] = {"dtype": rollout.dtype, "max_model_len": rollout.max_model_len,
                              "enforce_eager": rollout.enforce_eager}
    if rollout.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    return kwargs


VLLM = register_engine(EngineSpec(
    name="vllm", engine="rlplacement.engines.vllm_engine:VllmRolloutEngine",
    summary="vLLM's engine core in the actor's process, its workers one per GPU (tensor parallel)",
    engine_kwargs=f"{__name__}:vllm_engine_kwargs",
    worker_needs="rlplacement.transfer.plan.engine_shards:vllm_worker_needs",
    worker_weight_bytes="rlplacement.advisor.memory:engine_worker_weight_bytes"))
