"""The one trainer interface the RL loop and the transfer layer use, whatever the sharding.

Data flow per train call: ``Batch`` (this rank's share) -> optimizer steps of ``--global-batch-size``
samples -> micro-batches (:mod:`.batching`) -> forward/backward of the objective (:mod:`.objective`),
gradients accumulating -> one optimizer step each -> :meth:`TrainerBackend.iter_hf_tensors`
(collective; full HF-named tensors on rank 0, one parameter at a time) -> transfer layer.

Contracts every backend keeps:
- every rank of the trainer calls every public method in the same order (they are collective);
- each rank gets its data-parallel share of the batch; ranks of one tensor-parallel group get the same;
- gradients are averaged over the data-parallel ranks (the objective's normaliser makes the average the
  step's global token mean);
- ``log_probs`` returns ``[B, T]`` float32 with ``lp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])``
  and ``lp[:, 0] = 0`` (0 past a sample's length); sequences are right-padded (causal attention never
  sees the padding of a later position), and ``loss_mask`` is 0 on prompt and padding tokens;
- ``iter_hf_tensors`` yields on global rank 0 only; the tensors are copies of (or views on) the
  trained parameters in HF layout, bit-equal to what the backend holds, valid until the next step.

What a backend saves and resumes from is :class:`~.backend_checkpoints.BackendCheckpoints`' part of the
interface, its move to host memory and back :class:`~.backend_offload.BackendHostOffload`'s, one step trained in
chunks as a rollout's groups finish :class:`~.chunked_step.ChunkedStep`'s; all are mixed into
:class:`TrainerBackend`, and a backend overrides their hooks as it does this module's.
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import Any, ClassVar, Iterator

import torch

from rlplacement.backends.backend_checkpoints import BackendCheckpoints
from rlplacement.backends.backend_offload import BackendHostOffload
from rlplacement.backends.chunked_step import ChunkedStep
from rlplacement.backends.batching import fixed_micro_batches, pack_by_tokens, split_steps
from rlplacement.backends.objective import (LossParts, TokenStats, policy_loss,  # noqa: F401  (backends' API)
                                            token_log_probs)
from rlplacement.backends.registry import backend_class
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.train_io import Batch, refuse_unreplayed_routes
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

# per optimizer step, summed over micro-batches then data-parallel ranks: what the report averages
_SUMS = ("loss", "policy", "kl", "entropy", "clipped", "logp", "tokens")


def resolve_bf16(train: TrainConfig) -> bool:
    """``--bf16`` as set, else on where CUDA is."""
    return torch.cuda.is_available() if train.bf16 is None else train.bf16


class TrainerBackend(ChunkedStep, BackendCheckpoints, BackendHostOffload, abc.ABC):
    """Build or load a model, train it on batches, and stream its weights in HF names."""

    name: ClassVar[str]

    def __init__(self, optim: OptimConfig, train: TrainConfig | None = None):
        self.optim_config = optim
        self.train_config = train or TrainConfig()
        self.optimizer: torch.optim.Optimizer | None = None
        self.step = 0
        """Optimizer steps taken: the learning-rate schedule's position."""
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite gradient norm (``train/skipped_steps``)."""
        self.train_calls = 0
        """Train calls so far (rollout steps): what ``--save-interval`` counts and checkpoints are named by."""
        self.resumed: dict[str, Any] | None = None
        """The saved state this backend was loaded from (``--load`` of a ``--save`` folder), else None."""
        self.source_hf_dir: str | None = None
        """The HF folder this run's model is (``--hf-checkpoint``): what a ``--load`` must have been saved from."""
        self._identity: dict[str, Any] | None = None  # what a checkpoint records (model_identity), read once

    @classmethod
    @abc.abstractmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), **options: Any) -> "TrainerBackend":
        """Build on every rank; torch.distributed must be initialised (see ``launch.init_distributed``)."""

    # True where iter_update_tensors yields views of this rank's own device parameters (no gather, cast or
    # copy): they stay allocated and unchanged while an update runs, so cuda_ipc reads them in place
    yields_resident_tensors: bool = False

    # with yields_resident_tensors: the tensors iter_update_tensors yields in another shape than HF's
    # (rows grouped as a fused parameter holds them; transfer.base.HFShapes), else None
    update_hf_shapes: dict[str, tuple[int, ...]] | None = None
    # collectives this rank issued in its TP/PP groups to stream the last update (None: not counted)
    last_stream_collectives: int | None = None

    @property
    def is_source(self) -> bool:
        """True on the rank where :meth:`iter_hf_tensors` yields (global rank 0)."""
        import torch.distributed as dist

        return dist.get_rank() == 0

    @property
    def device(self) -> torch.device:
        """Where the trained weights live: the device of the first parameter. Read once: parameters never
        change device (an offload resizes their storages in place), and finding the first one walks the
        whole module tree (~2 ms at 36 layers), which a loop over the optimizer's state would pay per tensor."""
        device = self.__dict__.get("_device")
        if device is None:
            device = self.__dict__["_device"] = self._parameters()[0].device
        return device

    @property
    def data_parallel_rank(self) -> int:
        """Which share of the batch this rank takes (ranks of one TP/PP group share a share)."""
        import torch.distributed as dist

        return dist.get_rank()

    @property
    def data_parallel_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size()

    @property
    def data_parallel_group(self):
        """The process group of this rank's data-parallel peers (None: the default group)."""
        return None

    @abc.abstractmethod
    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Differentiable ``[B, T]`` log-probs at ``--rollout-temperature`` (see the module contract)."""

    def _token_stats(self, input_ids: torch.Tensor, *, with_entropy: bool = False) -> TokenStats:
        """Log-probs and, where asked, entropies; a backend that computes entropies overrides this."""
        if with_entropy:
            raise ConfigError(f"--entropy-coef: the {self.name} backend does not compute entropies; drop it.")
        return TokenStats(self._token_log_probs(input_ids))

    def _reference_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` log-probs under the frozen reference model (``--use-kl-loss``)."""
        raise ConfigError(f"--use-kl-loss: the {self.name} backend keeps no reference model; drop it.")

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
    def iter_hf_tensors(self, owners: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective on every rank; yields ``(hf_name, full_tensor)`` on the source rank, one at a time, or,
        with ``owners`` (:meth:`update_owners`), each tensor on the rank ``owners`` names."""

    def iter_update_tensors(self, share: str = RANK0) -> Iterator[tuple[str, torch.Tensor]]:
        """What a weight update streams: :meth:`iter_hf_tensors`, except that a backend yielding resident
        tensors may yield some in another shape (:attr:`update_hf_shapes`) to avoid copying them.

        ``share`` (who sends, :data:`~rlplacement.transfer.spec.RANK0` and its kin): every tensor on global rank
        0; :data:`~rlplacement.transfer.spec.SHARES`, each whole tensor on exactly one rank, chosen by
        :meth:`update_owners` (a backend whose ranks send pieces, ``transfer.pieces``, yields those instead);
        :data:`~rlplacement.transfer.spec.OWN_GPU`, every tensor on every rank.
        Collective in every case: every rank calls it and consumes it to the end."""
        import torch.distributed as dist

        if share == OWN_GPU and dist.get_world_size() > 1:
            rank = dist.get_rank()
            return self.iter_hf_tensors(owners={name: rank for name, _ in self._update_sizes()})
        return self.iter_hf_tensors(owners=self.update_owners() if share == SHARES else None)

    def update_owners(self) -> dict[str, int] | None:
        """HF name -> the rank that sends it when every rank sends its share: whole tensors balanced by
        bytes over the ranks, a fused parameter's pieces on one rank
        (:func:`~rlplacement.transfer.plan.senders.spread_owners_by_group`). None: one rank holds everything
        (a single-rank trainer), so rank 0 sends it all as before."""
        import torch.distributed as dist

        if dist.get_world_size() == 1:
            return None
        owners = self.__dict__.get("_update_owners")
        if owners is None:
            from rlplacement.transfer.bucket import fused_group_of
            from rlplacement.transfer.plan.senders import spread_owners_by_group

            owners = self.__dict__["_update_owners"] = spread_owners_by_group(
                self._update_sizes(), dist.get_world_size(), fused_group_of)
        return owners

    def update_shares(self) -> list[tuple[str, int, int]]:
        """``(hf_name, bytes as streamed, sending rank)`` of every tensor when every rank sends
        (:meth:`update_owners`): what each rank's share of an update is, before any byte moves."""
        owners = self.update_owners() or {}
        return [(name, nbytes, owners.get(name, 0)) for name, nbytes in self._update_sizes()]

    def _update_sizes(self) -> list[tuple[str, int]]:
        """``(hf_name, bytes as streamed)`` of every tensor an update sends, in stream order, the same on every
        rank (what :meth:`update_owners` balances)."""
        raise NotImplementedError(f"{type(self).__name__} cannot spread an update over its ranks")

    def set_train(self, training: bool) -> None:
        """Hook: switch dropout etc.; models here have no dropout."""

    def _micro_batches(self, batch: Batch) -> list[list[int]]:
        """Sample indices of each micro-batch of ``batch``: the same count on every data-parallel rank."""
        cfg = self.train_config
        if not cfg.use_dynamic_batch_size:
            return fixed_micro_batches(len(batch), cfg.micro_batch_size)
        lengths = batch.sample_lengths()
        mine = len(pack_by_tokens(lengths, cfg.max_tokens_per_gpu))
        return pack_by_tokens(lengths, cfg.max_tokens_per_gpu, self._all_reduce([mine], "max")[0])

    def _all_reduce(self, values: list[float] | torch.Tensor, op: str = "sum") -> list[float]:
        """``values`` reduced over the data-parallel ranks, in float64 (one collective, one host sync)."""
        import torch.distributed as dist

        t = torch.as_tensor(values, dtype=torch.float64, device=self.device).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM,
                        group=self.data_parallel_group)
        return t.tolist()

    def log_probs(self, batch: Batch) -> torch.Tensor:
        """``[B, T]`` float32 log-probs of ``batch`` under the current weights, micro-batch by micro-batch."""
        self._check_routes(batch)
        self.set_train(False)
        batch = batch.to(self.device)
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for idx in self._micro_batches(batch):
                mb = batch.rows(idx).trimmed()
                with self._routes(mb):
                    out[idx, :mb.input_ids.shape[1]] = self._token_stats(mb.input_ids).logp
        return out

    replays_routes = False
    """Started with ``--use-rollout-routing-replay`` (the megatron and fsdp backends, a mixture of experts)."""

    def _routes(self, batch: Batch, reference: bool = False) -> contextlib.AbstractContextManager:
        """While open, forwards of the trained model (``reference``: of the frozen reference) route as
        ``batch.routed_experts`` says (a no-op where the batch has none)."""
        return contextlib.nullcontext()

    def _check_routes(self, batch: Batch) -> None:
        """A batch's ``routed_experts`` fit the model and the job replays them, checked once per call, before
        any forward (the batch still on the host)."""
        refuse_unreplayed_routes(batch, self.replays_routes)
        if batch.routed_experts is None:
            return
        from rlplacement.backends.routing_replay import check_routes

        check_routes(batch.routed_experts, self.hf_config, self.family.sparse_layers(self.hf_config))

    def train_step(self, batch: Batch) -> dict[str, float]:
        """Optimizer steps over this rank's share ``batch`` (one per ``--global-batch-size`` samples).
        Metrics are the same on every rank: the loss and its parts are the steps' global token means."""
        cfg = self.train_config
        self.refuse_while_chunks_open("a train step", "zeroes them")
        batch = self._ready_to_train(batch)
        per_step = None if cfg.global_batch_size is None else cfg.global_batch_size // self.data_parallel_size
        steps = split_steps(len(batch), per_step)
        totals = dict.fromkeys(_SUMS, 0.0)
        norm, lr, skipped = 0.0, self.optim_config.lr_at(self.step), 0
        for rows in steps:
            sums, norm, lr = self._optimizer_step(batch.rows(slice(rows.start, rows.stop)))
            skipped += lr is None
            for key in _SUMS:
                totals[key] += sums[key]
        self.train_calls += 1
        return self._train_report(totals, len(steps), norm, lr, skipped, float(batch.loss_mask.sum()))

    def _train_report(self, totals: dict[str, float], steps: int, norm: float, lr: float | None, skipped: int,
                      num_tokens: float) -> dict[str, float]:
        """A train call's report from its steps' summed ``_SUMS`` (the last step's norm and learning rate)."""
        tokens = max(totals["tokens"], 1.0)
        return {"loss": totals["loss"] / steps, "grad_norm": norm, "lr": lr or 0.0,
                "num_tokens": num_tokens, "mean_logprob": totals["logp"] / tokens,
                "kl": totals["kl"] / steps, "entropy": totals["entropy"] / steps,
                "clip_fraction": totals["clipped"] / steps, "optimizer_steps": steps - skipped,
                "skipped_steps": self.skipped_steps}

    def _ready_to_train(self, batch: Batch) -> Batch:
        """``batch`` checked (its routes) and on this rank's device, the optimizer built, the model in train
        mode: what every train call (a step, or a chunk of one) starts with."""
        self._check_routes(batch)
        batch = batch.to(self.device)
        if self.optimizer is None:
            self.optimizer = self.optim_config.build(self._parameters())
        self.set_train(True)
        return batch

    def _optimizer_step(self, batch: Batch) -> tuple[dict[str, float], float, float | None]:
        """Gradients of every micro-batch of ``batch`` into one optimizer step. Returns the step's sums over
        every rank, the gradient norm, and the learning rate used (None: skipped, the norm not finite)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.accumulate_gradients(batch)
        norm, lr = self._apply_gradients()
        return sums, norm, lr

    def _apply_gradients(self) -> tuple[float, float | None]:
        """The accumulated gradients into one optimizer step: reduced where the framework does not, norm,
        clip, step, zeroed. Returns the norm and the learning rate used (None: skipped, the norm not finite)."""
        self._finish_grads()
        norm = self._grad_norm()
        lr = None
        if math.isfinite(norm):
            self._clip(norm)
            lr = self.optim_config.lr_at(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
        else:  # an inf/nan gradient: nothing is applied, the run goes on
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)  # a model's worth of memory free through the update
        return norm, lr

    def accumulate_gradients(self, batch: Batch) -> dict[str, float]:
        """Backward of one optimizer step's objective on this rank's share ``batch``, micro-batch by
        micro-batch, into the parameters' gradients (collective). Returns the step's sums over every rank
        (loss parts as global token means, the log-prob sum and the token count)."""
        tokens = self._all_reduce([float(batch.loss_mask.sum())])[0]
        normalizer = max(tokens, 1.0) / self.data_parallel_size
        return self._step_sums(self._accumulate_local(batch, normalizer), tokens)

    def _zero_local_sums(self) -> torch.Tensor:
        """This rank's loss parts and log-prob sum (``_SUMS`` but tokens), zero, float64."""
        return torch.zeros(len(_SUMS) - 1, dtype=torch.float64, device=self.device)

    def _accumulate_local(self, batch: Batch, normalizer: float) -> torch.Tensor:
        """Backward of every micro-batch of ``batch`` at ``normalizer`` into the gradients; this rank's loss parts
        and log-prob sum (``_SUMS`` but tokens), float64."""
        cfg = self.train_config
        local = self._zero_local_sums()
        for idx in self._micro_batches(batch):
            mb = batch.rows(idx).trimmed()
            ref = None
            if cfg.use_kl_loss:
                with torch.no_grad(), self._routes(mb, reference=True):
                    ref = self._reference_log_probs(mb.input_ids)
            with self._routes(mb):
                parts, logp_sum = self._forward_backward(mb, normalizer, ref)
            local += torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).detach()
                                  for v in (*parts, logp_sum)])
        return local

    def _step_sums(self, local: torch.Tensor, tokens: float) -> dict[str, float]:
        """This rank's loss parts and log-prob sum (``_SUMS`` but tokens) summed over the data-parallel
        ranks: the parts as global token means of the step, the log-prob sum and the token count as sums."""
        dp = self.data_parallel_size
        reduced = self._all_reduce(local)
        sums = {k: v / dp for k, v in zip(_SUMS[:-2], reduced[:-1])}
        sums.update(logp=reduced[-1], tokens=tokens)
        return sums

    def _forward_backward(self, batch: Batch, normalizer: float,
                          ref_logp: torch.Tensor | None) -> tuple[LossParts, torch.Tensor]:
        """One micro-batch: backward of its objective (see :func:`objective.policy_loss`). Returns its loss
        parts and the sum of its response tokens' log-probs (0-dim tensors, or floats), the same on every
        rank of a model replica."""
        stats = self._token_stats(batch.input_ids, with_entropy=bool(self.train_config.entropy_coef))
        parts = policy_loss(stats, batch, self.train_config, normalizer, ref_logp)
        parts.loss.backward()
        return parts, (stats.logp.detach() * batch.loss_mask).sum()

    lora = None
    """The :class:`~rlplacement.config.LoRAConfig` where adapters train (``--lora-rank``), else None."""
    reference: torch.nn.Module | None = None
    """The frozen starting model of ``--use-kl-loss``, where the backend keeps one."""

    def close(self) -> None:
        """Release framework state (parallel groups); the process group stays the caller's."""


def make_backend(cfg: BackendConfig, optim: OptimConfig = OptimConfig(), train: TrainConfig | None = None,
                 **options: Any) -> TrainerBackend:
    """Build the backend ``cfg.name`` on this rank (collective)."""
    return backend_class(cfg.name).from_config(cfg, optim, train=train or TrainConfig(), **options)
