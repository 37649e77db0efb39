"""A Megatron optimizer step the way megatron's own training builds it: ``Float16Module`` around a bf16
model (``--bf16``: bf16 compute, fp32 logits out of the last stage, fp32 main parameters in the
optimizer, the bf16 parameters refreshed from them after each step), ``DistributedDataParallel``
(gradients in fp32 buffers, reduced per bucket), ``get_megatron_optimizer`` (``--use-distributed-optimizer``:
main parameters and moments sharded over the data-parallel ranks) and ``get_forward_backward_func``
over the step's micro-batches (pipelined across stages when PP > 1).

Contracts kept from the other backends (``backends/base.py``): every micro-batch's loss is already
normalised by the step's global token count, so the gradient is the whole step's in one piece (megatron's
schedule divides each micro-batch's loss by their number: the loss handed to it is multiplied back);
DDP averages over data-parallel ranks, which the normaliser (tokens / DP size) accounts for; a step
whose gradient is not finite anywhere is skipped and counted, nothing applied; the learning rate is
the run's schedule (``OptimConfig.lr_at``), set on every parameter group before each step.
Megatron's own rules apply where they differ: no weight decay on biases and norm weights.

Under expert parallelism every forward is a collective of the expert-parallel group, so its ranks run the
same number of micro-batches, and under the all-gather token dispatcher (which gathers every rank's tokens
as equal blocks) micro-batches of the same index hold the same number of tokens: :func:`line_up` pads them to
the group's shape and gives a rank with fewer micro-batches stand-ins (``batching.lined_up``). The padding
changes no result: it is outside the loss mask, megatron's routers leave it out of the load-balancing loss
(its ``padding_mask``), a stand-in trains with the routers' losses off, and the routers' loss keeps the
weight ``1 / (the rank's own micro-batches)`` it has without stand-ins.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from rlplacement.backends.batching import LinedUpBatch, lined_up
from rlplacement.errors import ConfigError
from rlplacement.train_io import Batch

GATHERING_DISPATCHERS = ("allgather",)
"""megatron's token dispatchers that gather every expert-parallel rank's tokens as equal blocks."""


class MegatronTraining:
    """The DDP wrapper and megatron optimizer of one model stage; :meth:`step` runs one optimizer step."""

    def __init__(self, model, optim, *, use_distributed_optimizer: bool, overlap_grad_reduce: bool,
                 grad_reduce_in_fp32: bool = True):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = model.config
        if config.bf16 or config.fp16:  # half-precision model parameters; the optimizer's main ones are fp32
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        self.ddp = DistributedDataParallel(
            config=config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
                                                     use_distributed_optimizer=use_distributed_optimizer))
        limit = optim.max_grad_norm
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="sgd" if optim.name == "sgd" else "adam", lr=optim.lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps, sgd_momentum=0.0,
            # megatron reports the norm only while clipping: an infinite bound asks for it and never scales
            clip_grad=float(limit) if limit else math.inf,
            bf16=config.bf16, params_dtype=config.params_dtype, use_distributed_optimizer=use_distributed_optimizer),
            [self.ddp])
        config.no_sync_func = self.ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        if overlap_grad_reduce:
            config.grad_sync_func = self.ddp.start_grad_sync
        config.variable_seq_lengths = True  # micro-batches are trimmed to their longest sample
        self.config = config

    def forward_backward(self, micro_batches: list, forward: Callable, loss: Callable, *, reduce: bool = True) -> None:
        """Every micro-batch through ``forward(model, batch) -> output`` and, on the last stage,
        ``loss(batch, output) -> 0-dim loss`` (already normalised for the whole step), backward included;
        the gradients end reduced in DDP's buffers. ``reduce`` False (a chunk of ``--train-during-rollout``): the
        buffers are neither zeroed nor reduced, so the gradients accumulate on this rank until
        :meth:`reduce_accumulated`; the whole schedule runs under DDP's ``no_sync`` with the schedule's own
        ``no_sync_func``, ``grad_sync_func`` and ``finalize_model_grads_func`` off (each would end the hold at the
        schedule's last micro-batch)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        n = len(micro_batches)
        own = sum(not is_stand_in(b) for b in micro_batches)
        routers = self._routers() if own < n else []
        if routers and self.config.recompute_granularity == "full" and self.config.pipeline_model_parallel_size > 1:
            raise ConfigError("--recompute-granularity full with pipeline stages and expert-parallel ranks whose shares "
                              "make different numbers of micro-batches: send every data-parallel rank the same number "
                              "of samples, or drop --recompute-granularity")

        def step_func(data: Iterator, model):
            batch = next(data)
            if is_stand_in(batch):  # from here to the step's end only stand-ins run forwards (they come last)
                for router in routers:
                    router.training = False
            return forward(model, batch), functools.partial(_scaled_loss, loss, batch, own)

        if reduce:
            self.zero_grads()
        first = micro_batches[0].input_ids
        if own < n:  # megatron weighs the routers' losses by 1 / n: scaled back to 1 / own (see _scaled_loss)
            self.config.grad_scale_func = lambda value: self.optimizer.scale_loss(value) * (n / own)
        syncs = {k: getattr(self.config, k) for k in ("no_sync_func", "grad_sync_func", "finalize_model_grads_func")}
        held = contextlib.nullcontext() if reduce else self.ddp.no_sync()
        try:
            if not reduce:
                for k in syncs:
                    setattr(self.config, k, None)
            with held:
                get_forward_backward_func()(forward_step_func=step_func, data_iterator=iter(micro_batches),
                                            model=[self.ddp], num_microbatches=n, seq_length=first.shape[1],
                                            micro_batch_size=first.shape[0], forward_only=False)
        finally:
            for k, v in syncs.items():
                setattr(self.config, k, v)
            self.config.grad_scale_func = self.optimizer.scale_loss
            for router in routers:
                router.training = True

    def zero_grads(self) -> None:
        """DDP's gradient buffers and the optimizer's gradients zeroed: a step's (or a chunked step's) start."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def reduce_accumulated(self, scale: float) -> None:
        """After a chunked step's last chunk: DDP's buffers scaled by ``scale`` (DDP's ``scale_gradients``), then
        reduced as the schedule reduces a step (``finalize_model_grads``: the data-parallel all-reduce, or
        reduce-scatter under the distributed optimizer, then the TP and embedding-group reductions). DDP runs
        without overlapped reduction under the flag, so its reduction starts here, synchronously."""
        if self.ddp.ddp_config.overlap_grad_reduce:
            raise RuntimeError("a chunked step's reduction needs DDP built without overlap_grad_reduce")
        self.ddp.scale_gradients(scale)
        self.config.finalize_model_grads_func([self.ddp])

    def _routers(self) -> list:
        from megatron.core.transformer.moe.router import Router

        return [m for m in self.ddp.modules() if isinstance(m, Router)]

    def step(self, lr: float) -> tuple[float, bool]:
        """Apply the reduced gradients at ``lr``; returns (gradient norm, applied). Not applied where any
        rank's gradient holds an inf or NaN (the norm is then reported as inf)."""
        finite = torch.tensor([float(all(bool(torch.isfinite(b.grad_data).all()) for b in self.ddp.buffers))],
                              device=self.ddp.buffers[0].grad_data.device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if finite.item() < 1:
            return math.inf, False
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        applied, norm, _ = self.optimizer.step()
        return float(norm), bool(applied)

    def megatron_optimizers(self) -> list:
        """The megatron optimizers inside the one built (a chain of them, or itself); each wraps a torch
        optimizer (``.optimizer``) holding the state."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def ensure_optimizer_state(self, adam_step: int) -> None:
        """Before loading a checkpoint into an optimizer that has not stepped: its state created (zeros, and
        torch's Adam step counter at ``adam_step``, the optimizer steps the checkpoint had applied), the
        structure megatron's ``sharded_state_dict`` reads and the load overwrites. megatron's ``init_state_fn``
        makes the moments but not torch's step, and without apex or TE the distributed optimizer's
        ``dp_reshardable`` load keeps the step counters it finds here rather than the saved ones."""
        for opt in self.megatron_optimizers():
            inner = opt.optimizer
            if any(inner.state.get(p) for group in inner.param_groups for p in group["params"]):
                continue
            if getattr(opt, "init_state_fn", None) is not None:
                opt.init_state_fn(inner, getattr(opt, "config", None))
            if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
                for group in inner.param_groups:
                    for p in group["params"]:
                        inner.state[p].setdefault("step", torch.tensor(float(adam_step)))

    def load_optimizer_state(self, state: dict) -> None:
        """megatron's ``load_state_dict``, then every parameter's step counter its own tensor again: without
        apex or TE (torch's Adam, as on a CPU host) the distributed optimizer's load hands one step tensor
        to every parameter's state, and torch's Adam increments each parameter's counter in place, so one
        shared counter would advance by the number of parameters per step."""
        self.optimizer.load_state_dict(state)
        for opt in self.megatron_optimizers():
            for per_param in opt.optimizer.state.values():
                if isinstance(per_param.get("step"), torch.Tensor):
                    per_param["step"] = per_param["step"].clone()

    def gradient_buffers(self) -> list[torch.Tensor]:
        """DDP's gradient buffers: zeroed at the start of every step (``forward_backward``), so a hand-off
        frees them without moving their bytes."""
        return [b.grad_data for b in self._buffers() if b.grad_data is not None]

    def _buffers(self) -> list:
        return list(self.ddp.buffers) + list(getattr(self.ddp, "expert_parallel_buffers", []))

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor this step machinery keeps on the device that must survive a hand-off: DDP's
        parameter buffers and the optimizer's main parameters and state."""
        out = [b.param_data for b in self._buffers() if b.param_data is not None]
        for opt in self.megatron_optimizers():
            inner = opt.optimizer
            for group in inner.param_groups:
                for p in group["params"]:
                    out.append(p)
                    out += [v for v in inner.state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        return out


def _scaled_loss(loss: Callable, batch: Any, num_microbatches: int, output: torch.Tensor):
    """megatron's schedule divides what this returns by the number of micro-batches; the loss is already
    normalised for the whole step, so it is handed over multiplied by that number. With stand-ins the schedule
    divides by all ``n`` micro-batches and the loss scale is raised by ``n / own``
    (:meth:`MegatronTraining.forward_backward`): ``num_microbatches`` is then this rank's ``own``."""

    value = loss(batch, output)
    return value * num_microbatches, {}


def is_stand_in(batch: Batch) -> bool:
    """A micro-batch :func:`line_up` made for a rank that had fewer than its group."""
    return isinstance(batch, LinedUpBatch) and batch.own_rows == 0


def line_up(micro_batches: list[Batch], config) -> list[Batch]:
    """This rank's micro-batches as its expert-parallel group runs them (collective over the group where expert
    parallelism is on, else ``micro_batches`` as given): as many as the rank with most, each padded to the
    largest of its index across the group under a gathering dispatcher (:data:`GATHERING_DISPATCHERS`), then
    stand-ins (``batching.lined_up``, 1 x the sequence-parallel multiple under other dispatchers). Own
    micro-batches come first, in order."""
    from megatron.core import parallel_state as ps

    if not config.num_moe_experts or ps.get_expert_model_parallel_world_size() == 1:
        return micro_batches
    if not micro_batches:
        raise ValueError("a rank's share made no micro-batch: every expert-parallel rank needs samples")
    group = ps.get_expert_model_parallel_group()
    device = micro_batches[0].input_ids.device
    count = torch.tensor([len(micro_batches)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    shapes = torch.zeros(int(count.item()), 2, dtype=torch.int64, device=device)
    shapes[:, 1] = config.tensor_model_parallel_size if config.sequence_parallel else 1
    shapes[:, 0] = 1
    for i, mb in enumerate(micro_batches):
        shapes[i] = torch.tensor(mb.input_ids.shape)
    if config.moe_token_dispatcher_type in GATHERING_DISPATCHERS:
        dist.all_reduce(shapes, op=dist.ReduceOp.MAX, group=group)
    template = micro_batches[0].rows([])
    out: list[Batch] = []
    for i, (rows, width) in enumerate(shapes.tolist()):
        mb = micro_batches[i] if i < len(micro_batches) else template
        out.append(mb if tuple(mb.input_ids.shape) == (rows, width) else lined_up(mb, rows, width))
    return out


def padding_mask_of(batch: Batch, config) -> dict[str, torch.Tensor]:
    """The keyword a model's forward takes for a micro-batch's added tokens (``LinedUpBatch.padding``), none
    where nothing was added. megatron splits it over the sequence-parallel ranks on the first pipeline stage
    only: later stages get it split here."""
    padding = getattr(batch, "padding", None)
    if padding is None:
        return {}
    from megatron.core import parallel_state as ps

    if config.sequence_parallel and not ps.is_pipeline_first_stage(ignore_virtual=True):
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        padding = scatter_to_sequence_parallel_region(padding.transpose(0, 1).contiguous()).transpose(0, 1)
    return {"padding_mask": padding.contiguous()}
