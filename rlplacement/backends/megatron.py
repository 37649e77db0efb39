"""Megatron-core trainer: a ``GPTModel`` sharded by TP (and DP by replication), loaded from a torch_dist
checkpoint (``--load``, from ``rlplacement convert``) or straight from an HF folder (``--hf-checkpoint``).

Weights stream out by gathering each parameter over TP, un-fusing q/k/v and gate/up, stripping the
vocabulary padding and renaming (:func:`megatron_model.iter_hf_tensors`). Log-probs use Megatron's
vocab-parallel cross-entropy with the padded vocabulary columns masked to -inf, so they equal the HF
model's. Pipeline parallelism is supported by convert/export; training with PP > 1 is refused here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlplacement.args import BackendConfig, ConfigError
from rlplacement.backends import launch, mapping
from rlplacement.backends import megatron_model as mm
from rlplacement.backends.base import OptimConfig, TrainerBackend
from rlplacement.backends.families import family_for


class MegatronBackend(TrainerBackend):
    name = "megatron"

    def __init__(self, model, hf_config: Any, shape: mapping.ModelShape, optim: OptimConfig,
                 stream_dtype: torch.dtype | None):
        super().__init__(optim)
        self.model, self.hf_config, self.shape = model, hf_config, shape
        self.family = family_for(hf_config)
        self.spec = model.rlplacement_spec
        self.stream_dtype = stream_dtype
        self._named = list(mm.global_named_parameters(model))

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), spec: str = "auto",
                    dtype: torch.dtype = torch.float32, stream_dtype: torch.dtype | None = None,
                    seed: int = 1234, **_: Any) -> "MegatronBackend":
        """``dtype``: the trained (master) weights; ``stream_dtype``: what ``iter_hf_tensors`` yields
        (default: the dtype the weights are trained in)."""
        from rlplacement.convert import layout

        tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        if pp > 1:
            raise ConfigError(f"--train-backend megatron trains with --pipeline-model-parallel-size 1 only (got {pp}); "
                              f"pipeline parallelism is supported by convert/export-hf")
        if cfg.load:
            meta = layout.read_meta(cfg.load)
            hf_dir = Path(cfg.load) / layout.HF_CONFIG_DIR
            padded = int(meta["padded_vocab_size"])
            if padded % tp:
                raise ConfigError(f"--load {cfg.load} has a padded vocabulary of {padded}, not divisible by "
                                  f"--tensor-model-parallel-size {tp}: reconvert with that TP")
        elif cfg.hf_checkpoint:
            hf_dir = Path(cfg.hf_checkpoint)
            padded = None
        else:
            raise ConfigError("--train-backend megatron needs --load (a torch_dist folder from `rlplacement convert`) "
                              "or --hf-checkpoint (an HF folder)")
        if not dist.is_initialized():
            launch.init_distributed(0, 1, "127.0.0.1", launch.free_port())
        hf_config = mm.load_hf_config(hf_dir)
        family = family_for(hf_config, f"{hf_dir}/config.json")
        padded = padded or mapping.padded_vocab_size(hf_config.vocab_size, tp)
        shape = mapping.ModelShape.from_hf(hf_config, padded)
        mm.init_model_parallel(tp, pp, seed)
        model = mm.build_model(hf_config, padded, tp, pp, spec, dtype=dtype)
        if cfg.load:
            mm.load_torch_dist(model, layout.checkpoint_dir(cfg.load))
        else:
            mm.load_hf_weights(model, hf_dir, shape, family)
        return cls(model, hf_config, shape, optim, stream_dtype)

    @property
    def is_source(self) -> bool:
        return dist.get_rank() == 0

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def data_parallel_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    def set_train(self, training: bool) -> None:
        self.model.train(training)

    def _parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._named]

    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        b, t = input_ids.shape
        position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        # the local spec needs an explicit causal mask on CPU (its default one is built on "cuda");
        # TransformerEngine builds its own from the causal mask type
        mask = None if self.spec == "te" else torch.triu(
            torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)[None, None]
        logits = self.model(input_ids, position_ids, mask).float()  # [B, T, V_padded / TP]
        shard = logits.shape[-1]
        first = ps.get_tensor_model_parallel_rank() * shard
        padding = torch.arange(first, first + shard, device=logits.device) >= self.shape.vocab_size
        logits = logits.masked_fill(padding, float("-inf"))
        nll = vocab_parallel_cross_entropy(logits[:, :-1].contiguous(), input_ids[:, 1:].contiguous())
        return torch.cat([nll.new_zeros(b, 1), -nll], dim=1)

    def _finish_grads(self) -> None:
        from megatron.core import parallel_state as ps

        # q/k norms are shared by all heads but each TP rank sees only its heads: their grads are partial.
        if ps.get_tensor_model_parallel_world_size() > 1:
            group = ps.get_tensor_model_parallel_group()
            for name, p in self._named:
                if p.grad is not None and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                    dist.all_reduce(p.grad, group=group)
        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            group = ps.get_data_parallel_group()
            for _, p in self._named:
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=group)
                    p.grad.div_(dp)

    def _grad_norm(self) -> float:
        from megatron.core import parallel_state as ps

        first_tp = ps.get_tensor_model_parallel_rank() == 0
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self._named:
            if p.grad is not None and (first_tp or mapping.tp_partition_dim(name) is not None):
                total += p.grad.double().pow(2).sum()
        dist.all_reduce(total, group=ps.get_model_parallel_group())
        return math.sqrt(float(total))

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in mm.iter_hf_tensors(self.model, self.shape, self.family):
            yield name, tensor if self.stream_dtype is None else tensor.to(self.stream_dtype)

    def local_megatron_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's shards with global Megatron names (for checks that streamed == held)."""
        return [(n, p.detach()) for n, p in self._named]

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
