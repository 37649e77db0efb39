"""What an engine's settings resolve to when the user leaves them to the model: its dtype, the GPU
memory it may take, and the check that a request fits its context. Pure functions of the model
folder (vLLM is imported only for the GPU's size)."""

from __future__ import annotations

import dataclasses
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


def checkpoint_tensor_bytes(model_dir: str | Path, dtype: str) -> dict[str, int]:
    """HF name -> bytes in ``dtype`` of every tensor of the model's checkpoint (its safetensors headers)."""
    from rlplacement.hf_folder import safetensors_shapes

    return {n: math.prod(s) * _DTYPE_BYTES[dtype] for n, s in (safetensors_shapes(model_dir) or {}).items()}


def worker_tensor_bytes(model_dir: str | Path, dtype: str, tensor_parallel_size: int = 1) -> dict[str, int]:
    """HF name -> bytes in ``dtype`` of what the busiest worker of a ``tensor_parallel_size``-wide engine
    receives of each tensor when workers receive only their slices (``transfer.shards.keeps_for_worker``);
    every tensor whole at width 1 or for a model the slicing rules do not know."""
    whole = checkpoint_tensor_bytes(model_dir, dtype)
    if tensor_parallel_size <= 1:
        return whole
    from rlplacement.transfer import shards

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        per_worker = [shards.keeps_for_worker(config, w, tensor_parallel_size) for w in range(tensor_parallel_size)]
    except (ValueError, KeyError, TypeError, OSError):
        return whole
    return shards.busiest_share(whole, per_worker, _DTYPE_BYTES[dtype])


def model_bytes(model_dir: str | Path, dtype: str) -> int:
    """Bytes of every tensor of the model's checkpoint in ``dtype``: what one update stages on each
    engine worker under ``full`` staging (every receiver stages the whole model)."""
    return sum(checkpoint_tensor_bytes(model_dir, dtype).values())


def largest_bucket_bytes(model_dir: str | Path, dtype: str, bucket_bytes: int) -> int:
    """The largest bucket an update of this model makes (:func:`largest_bucket_of`)."""
    return largest_bucket_of(checkpoint_tensor_bytes(model_dir, dtype), bucket_bytes)


def largest_bucket_of(tensor_bytes: dict[str, int], bucket_bytes: int) -> int:
    """The largest bucket an update of tensors of these sizes makes: ``bucket_bytes``, or a fused group
    larger than it (q/k/v, gate/up, an embedding), which goes alone (``transfer.bucket.iter_buckets``)."""
    from rlplacement.transfer.bucket import fused_group_of

    groups: dict[str, int] = {}
    for name, nbytes in tensor_bytes.items():
        groups[fused_group_of(name)] = groups.get(fused_group_of(name), 0) + nbytes
    return max([bucket_bytes, *groups.values()])


def staging_per_option(tensor_bytes: dict[str, int], bucket_bytes: int, pieces: bool = False) -> dict[str, int]:
    """Bytes an update holds on each engine worker under each ``--update-weight-staging`` option, of tensors
    of these sizes (the whole model's, or a worker's share: :func:`worker_tensor_bytes`): all of them under
    ``full``; two of the largest buckets under ``bucket`` (never more than all). ``pieces``: the trainer's
    ranks each send their rows of every tensor (``transfer.pieces``) and the worker assembles them: under
    ``full`` the pieces as received and the tensors assembled from them, at most all of them twice (a piece
    that is all a worker keeps of a tensor is loaded as it arrived); under ``bucket`` still two buckets
    (each sender's bucket is halved for the tensors assembling: ``transfer.multi_sender.sender_bucket_size``)
    where every fused group is at most half a bucket, else three times the largest group: its pieces, each
    alone in a sender's bucket, in the channels' two buffers, beside the group assembling."""
    whole = sum(tensor_bytes.values())
    if pieces:
        group = largest_bucket_of(tensor_bytes, 0)
        return {"full": 2 * whole, "bucket": min(2 * whole, max(2 * bucket_bytes, 3 * group))}
    return {"full": whole, "bucket": min(whole, 2 * largest_bucket_of(tensor_bytes, bucket_bytes))}


AUTO_FULL_SHARE = 0.2
"""``--update-weight-staging auto`` is ``full`` while the whole model takes at most this share of the GPU
(an 8B model in bf16 on a 141 GB GPU: 0.12), else ``bucket``: ``full`` keeps the previous version served
through a failed update and commits through the recorded copy plan; beyond this share its cost in KV
cache outweighs that."""
MIN_VLLM_SHARE = 0.1
"""The least share of the GPU left to vLLM (weights, activations, KV cache) once the staging is counted."""


@dataclasses.dataclass(frozen=True)
class EngineMemory:
    """How an engine's budget (``--vllm-gpu-memory-utilization``, or vLLM's 0.9) is spent on each worker."""

    staging: str
    """``full`` or ``bucket`` (``--update-weight-staging`` resolved)."""
    staging_bytes: int
    """What one update holds on each worker beside vLLM: the whole model, or two of its largest buckets."""
    vllm_utilization: float
    """The fraction vLLM is given: the budget less the staging's share of the GPU."""


def resolve_engine_memory(model_dir: str | Path, dtype: str, *, staging: str = "full", bucket_bytes: int,
                          utilization: float | None = None, total_bytes: int | None = None,
                          sliced_width: int = 1, pieces: bool = False) -> EngineMemory:
    """The staging an engine runs and the fraction vLLM gets: the engine's budget (``utilization``, or
    vLLM's 0.9) less what an update holds on each worker, whoever set the budget, so the first update fits
    beside the KV cache vLLM sized at start. ``staging`` ``auto``: :data:`AUTO_FULL_SHARE`. Refused by
    name when the staging leaves vLLM less than :data:`MIN_VLLM_SHARE`. ``total_bytes``: the GPU's size
    (default: this process's first visible GPU, read through vLLM's platform without a CUDA context).
    ``sliced_width``: the engine's tensor-parallel width where its workers receive only their slices (the
    mode sends slices and ``--update-weight-slices auto``): a worker then stages its share
    (:func:`worker_tensor_bytes`); 1: every worker stages whole tensors. ``pieces``: the trainer sends pieces
    (:func:`staging_per_option`)."""
    if total_bytes is None:
        from vllm.platforms import current_platform

        total_bytes = int(current_platform.get_device_total_memory(0))
    budget = VLLM_DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else float(utilization)
    held_by = staging_per_option(worker_tensor_bytes(model_dir, dtype, sliced_width), bucket_bytes, pieces)
    if staging == "auto":
        staging = "full" if held_by["full"] <= AUTO_FULL_SHARE * total_bytes else "bucket"
    held = held_by[staging]
    fraction = budget - held / total_bytes
    if fraction <= MIN_VLLM_SHARE:
        gib = float(1 << 30)
        budget_flag = (f"--vllm-gpu-memory-utilization {budget}" if utilization is not None
                       else f"vLLM's default budget {budget}")
        if staging == "full":
            fix = (f"use --update-weight-staging bucket (two buckets, {held_by['bucket'] / gib:.1f} GiB, with a "
                   f"transfer mode that supports it), or raise --vllm-gpu-memory-utilization")
        else:
            fix = "lower --update-weight-buffer-size, or raise --vllm-gpu-memory-utilization"
        wider = (" More GPUs per engine do not help: this engine's workers receive whole tensors "
                 "(a mode that sends slices, with --update-weight-slices auto, sends each worker its share)."
                 if sliced_width == 1 else "")
        raise ConfigError(f"an update under --update-weight-staging {staging} holds {held / gib:.1f} GiB in {dtype} "
                          f"on each engine worker, which leaves vLLM {max(fraction, 0):.2f} of a "
                          f"{total_bytes / gib:.0f} GiB GPU within {budget_flag}: {fix}.{wider}")
    return EngineMemory(staging, held, round(fraction, 4))


def check_context(prompt_len: int, max_tokens: int, max_model_len: int, where: str) -> None:
    """Refuse a request that cannot fit the engine's context, rather than have it cut short."""
    if prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(
            f"{where}: a prompt of {prompt_len} tokens plus max_tokens {max_tokens} is {prompt_len + max_tokens} "
            f"tokens, over the engines' context of {max_model_len} (--vllm-max-model-len): shorten the prompt, "
            f"lower --rollout-max-response-len, or raise --vllm-max-model-len (up to the model's own).")
