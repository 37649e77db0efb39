"""What an engine's settings resolve to when the user leaves them to the model: its dtype, the GPU
memory it may take, and the check that a request fits its context. Pure functions of the model
folder (vLLM is imported only for the GPU's size)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlplacement.errors import ConfigError, ContextLengthError

VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_DTYPE_NAMES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32"}


def declared_dtype(model_dir: str | Path) -> str:
    """The dtype the model's ``config.json`` declares (``dtype``, or the older ``torch_dtype``): the one
    its weights are published in. A config that declares none is float32, as transformers reads it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    name = _DTYPE_NAMES.get(name, name)
    if name not in _DTYPE_BYTES:
        raise ConfigError(f"{Path(model_dir) / 'config.json'} declares dtype {name!r}, which the engines do not "
                          f"serve: set --vllm-dtype to one of {', '.join(_DTYPE_BYTES)}.")
    return name


def resolve_dtype(model_dir: str | Path, requested: str) -> str:
    """``requested`` by name; ``auto``: :func:`declared_dtype`. vLLM's own ``auto`` would serve a
    float32 checkpoint in half precision; naming the dtype keeps the model's and tells the trainer's
    stream what to cast to."""
    return declared_dtype(model_dir) if requested == "auto" else requested


def model_bytes(model_dir: str | Path, dtype: str) -> int:
    """Bytes of every tensor of the model's checkpoint in ``dtype``: what one update stages on each
    engine worker today (every receiver stages the whole model)."""
    from rlplacement.engines.vllm_loader import checkpoint_shapes

    shapes = checkpoint_shapes(model_dir) or {}
    return sum(math.prod(s) for s in shapes.values()) * _DTYPE_BYTES[dtype]


def default_gpu_memory_utilization(model_dir: str | Path, dtype: str, total_bytes: int | None = None) -> float:
    """vLLM's default fraction less the share of the GPU one update stages, so the first update fits
    beside the KV cache vLLM sized at start. ``total_bytes``: the GPU's size (default: this process's
    first visible GPU, read through vLLM's platform without creating a CUDA context)."""
    if total_bytes is None:
        from vllm.platforms import current_platform

        total_bytes = int(current_platform.get_device_total_memory(0))
    staged = model_bytes(model_dir, dtype)
    fraction = VLLM_DEFAULT_GPU_MEMORY_UTILIZATION - staged / total_bytes
    if fraction <= 0.1:
        raise ConfigError(f"an update stages the whole model ({staged / 2**30:.1f} GiB in {dtype}) on each engine "
                          f"worker, which leaves no room on a {total_bytes / 2**30:.0f} GiB GPU: raise "
                          f"--rollout-num-gpus-per-engine, or set --vllm-gpu-memory-utilization yourself.")
    return round(fraction, 4)


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, where: str) -> None:
    """Refuse a request that cannot fit the engine's context, rather than have it cut short."""
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"{where}: a prompt of {prompt_len} tokens plus max_tokens {max_tokens} is {prompt_len + max_tokens} "
            f"tokens, over the engines' context of {max_model_len} (--vllm-max-model-len): shorten the prompt, "
            f"lower --rollout-max-response-len, or raise --vllm-max-model-len (up to the model's own).")
