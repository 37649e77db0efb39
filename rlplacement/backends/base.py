"""The one trainer interface the RL loop and the transfer layer use, whatever the sharding.

Data flow per step: ``Batch`` -> :meth:`TrainerBackend.train_step` (GRPO-style policy-gradient loss
from per-token log-probs, a response mask and per-sample advantages; one optimizer step) ->
:meth:`TrainerBackend.iter_hf_tensors` (collective; full HF-named tensors on rank 0, one parameter
at a time) -> transfer layer.

Contracts every backend keeps:
- every rank of the trainer calls every public method in the same order (they are collective);
- each rank gets its data-parallel share of the batch; ranks of one tensor-parallel group get the same;
- ``log_probs`` returns ``[B, T]`` float32 with ``lp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``
  and ``lp[:, 0] = 0``; sequences are right-padded (causal attention never sees the padding of a
  later position), and ``loss_mask`` is 0 on prompt and padding tokens;
- ``iter_hf_tensors`` yields on global rank 0 only; the tensors are copies of (or views on) the
  trained parameters in HF layout, bit-equal to what the backend holds, valid until the next step.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar, Iterator

import torch

from rlplacement.args import BackendConfig
from rlplacement.backends.registry import backend_class
from rlplacement.errors import ConfigError


@dataclasses.dataclass
class Batch:
    """One rank's share of a training batch. ``advantages`` is per sample (GRPO: group-normalised reward)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] 1 on response tokens whose log-prob counts
    advantages: torch.Tensor  # [B]
    # [B, T] the behaviour policy's log-probs (the engine's, at the positions of the tokens it sampled):
    # given when samples may be stale (one-step-off), so the loss weighs them by a clipped importance ratio
    old_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.dtype != torch.int64:
            raise ValueError(f"Batch.input_ids must be [B, T] int64, got {tuple(self.input_ids.shape)} "
                             f"{self.input_ids.dtype}")
        if tuple(self.loss_mask.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"Batch.loss_mask shape {tuple(self.loss_mask.shape)} must equal input_ids "
                             f"shape {tuple(self.input_ids.shape)}")
        if tuple(self.advantages.shape) != (self.input_ids.shape[0],):
            raise ValueError(f"Batch.advantages must be [B] = [{self.input_ids.shape[0]}], got "
                             f"{tuple(self.advantages.shape)}")
        if self.old_logprobs is not None and tuple(self.old_logprobs.shape) != tuple(self.input_ids.shape):
            raise ValueError(f"Batch.old_logprobs shape {tuple(self.old_logprobs.shape)} must equal input_ids "
                             f"shape {tuple(self.input_ids.shape)}")

    def to(self, device: torch.device | str) -> "Batch":
        old = None if self.old_logprobs is None else self.old_logprobs.to(device)
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.advantages.to(device), old)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """``name`` adamw or sgd; ``max_grad_norm`` None or 0 disables clipping."""

    name: str = "adamw"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.name not in ("adamw", "sgd"):
            raise ConfigError(f"optimizer {self.name!r} is unknown: use adamw or sgd")
        if self.lr <= 0:
            raise ConfigError(f"learning rate must be positive, got {self.lr}")

    def build(self, params) -> torch.optim.Optimizer:
        params = [p for p in params if p.requires_grad]
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


def token_log_probs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` log-probs of ``input_ids`` under full-vocabulary ``logits`` ``[B, T, V]`` (float32)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.cat([logp.new_zeros(logp.shape[0], 1), logp], dim=1)


CLIP_EPS = 0.2  # PPO's clip range for the importance ratio of stale samples


def policy_gradient_loss(logp: torch.Tensor, batch: Batch, clip_eps: float = CLIP_EPS) -> torch.Tensor:
    """GRPO loss, token mean over response tokens.

    On policy (``batch.old_logprobs`` None): ``-advantage * log p``; the PPO ratio
    exp(logp - logp.detach()) is 1 with the same gradient, so clipping never binds and the plain
    form is exact. With the behaviour policy's log-probs (samples generated by older weights, as
    in one-step-off): PPO's clipped surrogate ``-min(r A, clip(r, 1 - eps, 1 + eps) A)`` with
    ``r = exp(log p - old log p)``, so a stale sample is weighed by how likely the current policy
    finds it and cannot move the policy far.
    """
    mask = batch.loss_mask.to(logp.dtype)
    adv = batch.advantages.to(logp.dtype)[:, None]
    if batch.old_logprobs is None:
        per_token = adv * logp
    else:
        ratio = torch.exp(logp - batch.old_logprobs.to(logp.dtype))
        per_token = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return -(per_token * mask).sum() / mask.sum().clamp(min=1.0)


class TrainerBackend(abc.ABC):
    """Build or load a model, train it on batches, and stream its weights in HF names."""

    name: ClassVar[str]

    def __init__(self, optim: OptimConfig):
        self.optim_config = optim
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), **options: Any) -> "TrainerBackend":
        """Build on every rank; torch.distributed must be initialised (see ``launch.init_distributed``)."""

    # True where iter_hf_tensors yields views of this rank's own device parameters (no gather, cast or
    # un-fusing): they stay allocated and unchanged while an update runs, so cuda_ipc reads them in place
    yields_resident_tensors: bool = False

    @property
    def is_source(self) -> bool:
        """True on the rank where :meth:`iter_hf_tensors` yields (global rank 0)."""
        import torch.distributed as dist

        return dist.get_rank() == 0

    @property
    def device(self) -> torch.device:
        """Where the trained weights live: the device of the first parameter."""
        return self._parameters()[0].device

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the batch this rank takes (ranks of one TP/PP group share a share)."""
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def data_parallel_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    @abc.abstractmethod
    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Differentiable ``[B, T]`` log-probs (see the module contract)."""

    @abc.abstractmethod
    def _parameters(self) -> list[torch.nn.Parameter]: ...

    def _finish_grads(self) -> None:
        """Reduce gradients the framework does not reduce itself (hook)."""

    @abc.abstractmethod
    def _grad_norm(self) -> float:
        """Global L2 norm of the gradient, each element counted once across all ranks."""

    def _clip(self, norm: float) -> None:
        limit = self.optim_config.max_grad_norm
        if limit and norm > limit:
            scale = limit / (norm + 1e-6)
            for p in self._parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    @abc.abstractmethod
    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective on every rank; yields ``(hf_name, full_tensor)`` on the source rank, one at a time."""

    def set_train(self, training: bool) -> None:
        """Hook: switch dropout etc.; models here have no dropout."""

    def log_probs(self, batch: Batch) -> torch.Tensor:
        self.set_train(False)
        with torch.no_grad():
            return self._token_log_probs(batch.input_ids.to(self.device)).detach()

    def train_step(self, batch: Batch) -> dict[str, float]:
        batch = batch.to(self.device)
        if self.optimizer is None:
            self.optimizer = self.optim_config.build(self._parameters())
        self.set_train(True)
        self.optimizer.zero_grad(set_to_none=True)
        loss, logp = self._forward_backward(batch)
        self._finish_grads()
        norm = self._grad_norm()
        if not math.isfinite(norm):
            raise FloatingPointError(f"{self.name}: gradient norm is {norm} at step {self.step}; step skipped")
        self._clip(norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)  # a model's worth of memory free through the update
        self.step += 1
        mask = batch.loss_mask.float()
        return {"loss": loss, "grad_norm": norm, "lr": self.optim_config.lr,
                "num_tokens": float(mask.sum()),
                "mean_logprob": float((logp * mask).sum() / mask.sum().clamp(min=1.0))}

    def _forward_backward(self, batch: Batch) -> tuple[float, torch.Tensor]:
        """Loss and gradients for one batch; returns (loss, detached log-probs) on every rank."""
        logp = self._token_log_probs(batch.input_ids)
        loss = policy_gradient_loss(logp, batch)
        loss.backward()
        return float(loss.detach()), logp.detach()

    def offload_to_host(self) -> dict[str, float]:
        """Move weights and optimizer state to host memory and drop the gradients (``--offload-train``),
        so colocated engines can use the GPU; :meth:`reload_from_host` before the next step or gather.
        Works on any device (on CPU it only proves the round trip); the job calls it on GPUs only."""
        from rlplacement.backends.offload import HostOffload

        if getattr(self, "_host_offload", None) is None:
            self._host_offload = HostOffload()
        for p in self._parameters():
            p.grad = None  # the next step starts from None anyway
        return self._host_offload.offload(self._resident_tensors())

    @property
    def offloaded_to_host(self) -> bool:
        host = getattr(self, "_host_offload", None)
        return host is not None and host.offloaded

    def reload_from_host(self) -> dict[str, float]:
        host = getattr(self, "_host_offload", None)
        return host.reload() if host is not None else {"seconds": 0.0, "bytes": 0.0}

    def _resident_tensors(self) -> list[torch.Tensor]:
        """Parameters and optimizer state on the training device (the optimizer's CPU step counters stay)."""
        from rlplacement.backends.offload import local_tensor

        tensors = list(self._parameters())
        if self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor)]
        return [t for t in tensors if local_tensor(t).device == self.device]

    def close(self) -> None:
        """Release framework state (parallel groups); the process group stays the caller's."""


def make_backend(cfg: BackendConfig, optim: OptimConfig = OptimConfig(), **options: Any) -> TrainerBackend:
    """Build the backend ``cfg.name`` on this rank (collective)."""
    return backend_class(cfg.name).from_config(cfg, optim, **options)
