"""Megatron-core trainer: a ``GPTModel`` sharded by TP (and DP by replication), loaded from a torch_dist
checkpoint (``--load``, from ``rlplacement convert``) or straight from an HF folder (``--hf-checkpoint``).

It trains with megatron-core's own machinery (:mod:`.train`): ``DistributedDataParallel``, a
megatron optimizer (``--use-distributed-optimizer`` shards it over data-parallel ranks) and
``get_forward_backward_func`` over the step's micro-batches, pipelined across stages when PP > 1;
megatron reduces the gradients (data-parallel buckets, q/k norms over TP, a tied embedding's two
copies over its embedding group). On a CPU host the few CUDA calls of that machinery are shimmed
(:mod:`.cpu_shims`). Log-probs use Megatron's vocab-parallel cross-entropy with the padded vocabulary
columns masked to -inf (:mod:`.vocab_parallel`), so they equal the HF model's; without gradients, a
pipeline's log-probs go through the stages by point-to-point sends and the last stage broadcasts them.
What an update streams is :class:`~.backend_updates.MegatronUpdates`'s part of the backend, training
checkpoints :class:`~.backend_checkpoints.MegatronCheckpoints`'.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlplacement.backends import launch
from rlplacement.backends.base import resolve_bf16
from rlplacement.backends.megatron import model_build as mm
from rlplacement.backends.megatron.backend_checkpoints import MegatronCheckpoints
from rlplacement.backends.megatron.backend_updates import MegatronUpdates
from rlplacement.backends.megatron.vocab_parallel import token_stats
from rlplacement.backends.objective import TokenStats
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.families import family_for
from rlplacement.families import megatron_mapping as mapping


class MegatronBackend(MegatronUpdates, MegatronCheckpoints):
    name = "megatron"

    def __init__(self, model, hf_config: Any, shape: mapping.ModelShape, optim: OptimConfig,
                 stream_dtype: torch.dtype | None, train: TrainConfig | None = None,
                 overlap_grad_reduce: bool | None = None, reference=None):
        """``reference``: the frozen starting model of ``--use-kl-loss`` (a stage built and loaded as
        ``model`` was), else None."""
        super().__init__(optim, train)
        self.model, self.hf_config, self.shape = model, hf_config, shape
        self.reference = reference
        self.description: tuple[Path, dict] | None = None  # (HF side files, metadata): what --save writes beside
        self.family = family_for(hf_config)
        self.spec = model.rlplacement_spec
        self.stream_dtype = stream_dtype
        self._named = list(mm.global_named_parameters(model))
        self.last_stream_collectives: int | None = None
        self._views: tuple[list, dict] | None = None  # see _resident_views
        from rlplacement.backends.megatron.cpu_shims import cuda_absent
        from rlplacement.backends.megatron.train import MegatronTraining

        overlap = not cuda_absent() if overlap_grad_reduce is None else overlap_grad_reduce
        # chunks reduce once, after the last (MegatronTraining.reduce_accumulated): no backward to overlap it with
        overlap = overlap and not self.train_config.train_during_rollout
        self._training = MegatronTraining(model, optim, use_distributed_optimizer=self.train_config.use_distributed_optimizer,
                                          overlap_grad_reduce=overlap,
                                          grad_reduce_in_fp32=self.train_config.accumulate_allreduce_grads_in_fp32)
        self.optimizer = self._training.optimizer

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), train: TrainConfig | None = None,
                    spec: str = "auto",
                    dtype: torch.dtype = torch.float32, stream_dtype: torch.dtype | None = None,
                    seed: int = 1234, overlap_grad_reduce: bool | None = None, **_: Any) -> "MegatronBackend":
        """``dtype``: the trained weights without ``--bf16``; under ``--bf16`` (``train.bf16``, on by default on
        a GPU) the model's parameters are bf16 inside megatron's ``Float16Module`` and the optimizer keeps
        fp32 main parameters, as megatron's training does. ``stream_dtype``: what ``iter_hf_tensors`` yields
        (default: the model's parameters' dtype); ``overlap_grad_reduce``: DDP reduces each gradient bucket
        while backward goes on (None: on a GPU)."""
        from rlplacement.backends.megatron import checkpoint_layout as layout

        if resolve_bf16(train or TrainConfig()):
            dtype = torch.bfloat16
        tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
        resume = bool(cfg.load) and layout.is_training_checkpoint(cfg.load)  # a --save folder, not a conversion
        if cfg.load:
            meta = layout.read_meta(cfg.load)
            hf_dir = Path(cfg.load) / layout.HF_CONFIG_DIR
            padded = int(meta["padded_vocab_size"])
            if padded % tp:
                raise ConfigError(f"--load {cfg.load} has a padded vocabulary of {padded}, not divisible by "
                                  f"--tensor-model-parallel-size {tp}: use a TP that divides it"
                                  + ("" if resume else ", or reconvert with that TP"))
        elif cfg.hf_checkpoint:
            hf_dir = Path(cfg.hf_checkpoint)
            padded = None
        else:
            raise ConfigError("--train-backend megatron needs --load (a torch_dist folder from `rlplacement convert`) "
                              "or --hf-checkpoint (an HF folder)")
        if not dist.is_initialized():
            launch.init_single_process()
        hf_config = mm.load_hf_config(hf_dir)
        family = family_for(hf_config, f"{hf_dir}/config.json")
        padded = padded or mapping.padded_vocab_size(hf_config.vocab_size, tp)
        shape = mapping.ModelShape.from_hf(hf_config, padded)
        mm.init_model_parallel(tp, pp, seed, ep=cfg.expert_model_parallel_size)
        t = train or TrainConfig()
        recompute = {"recompute_granularity": t.recompute_granularity, "recompute_method": t.recompute_method,
                     "recompute_num_layers": t.recompute_num_layers}
        def built(**extra):
            stage = mm.build_model(hf_config, padded, tp, pp, spec, dtype=dtype,
                                   sequence_parallel=cfg.sequence_parallel,
                                   attention_softmax_in_fp32=t.attention_softmax_in_fp32, moe=cfg.moe, **extra)
            if cfg.load and not resume:  # a resumed run's whole state comes after, from load_checkpoint
                mm.load_torch_dist(stage, layout.checkpoint_dir(cfg.load))
            elif not cfg.load:
                mm.load_hf_weights(stage, hf_dir, shape, family)
            return stage

        model = built(recompute=recompute)
        if cfg.lora.enabled:  # before megatron's DDP and optimizer are built: they take the adapters alone
            from rlplacement.backends.megatron import lora as megatron_lora

            megatron_lora.check_supported(cfg.lora, cfg.sequence_parallel, family.moe)
            if resume:  # the checkpoint holds the adapters alone: the base comes from the HF folder
                if not cfg.hf_checkpoint:
                    raise ConfigError(f"--load {cfg.load} with --lora-rank: a LoRA run's checkpoint holds the adapters "
                                      f"alone; add --hf-checkpoint with the base model's HF folder")
                mm.load_hf_weights(model, cfg.hf_checkpoint, shape, family)
            megatron_lora.inject(model, cfg.lora, shape)
        reference = None
        if t.use_kl_loss:  # the starting weights, frozen: what the KL term pulls towards
            reference = built().eval()
            reference.requires_grad_(False)
            if cfg.lora.enabled and resume:  # LoRA's reference is its frozen base, which the checkpoint lacks
                mm.load_hf_weights(reference, cfg.hf_checkpoint, shape, family)
        backend = cls(model, hf_config, shape, optim, stream_dtype, train, overlap_grad_reduce, reference)
        backend.lora = cfg.lora if cfg.lora.enabled else None
        backend.description = (hf_dir, mm.model_meta(hf_config, family, padded, model.rlplacement_spec))
        backend.source_hf_dir = cfg.hf_checkpoint or str(hf_dir)  # hf_config/ of a --load: config, no weights
        if resume:
            backend.load_checkpoint(cfg.load)
        return backend

    @property
    def data_parallel_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank()

    @property
    def data_parallel_size(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    @property
    def data_parallel_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    def set_train(self, training: bool) -> None:
        self.model.train(training)

    def _parameters(self) -> list[torch.nn.Parameter]:
        from rlplacement.backends.megatron.lora import adapters_of

        return [p for _, p in self._named] + [p for a in adapters_of(self.model) for p in a.parameters()]

    def _stage_log_probs(self, input_ids: torch.Tensor, model=None) -> torch.Tensor | None:
        """This pipeline stage's forward of ``model`` (default: the trained one) without gradients: the
        log-probs on the last stage, None on the others (the activations go on by point-to-point sends;
        training goes through megatron's schedule)."""
        from megatron.core import parallel_state as ps

        model = self.model if model is None else model
        b, t = input_ids.shape
        if not ps.is_pipeline_first_stage(ignore_virtual=True):
            received = torch.empty(t, b, self.hf_config.hidden_size, dtype=self._dtype, device=input_ids.device)
            dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(received)
        out = model(input_ids, *self._positions_and_mask(input_ids))
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        return self._logits_to_stats(out, input_ids).logp

    def _logits_to_stats(self, logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = False) -> TokenStats:
        """``[B, T]`` log-probs (and entropies) from this TP rank's vocabulary shard of the logits
        (:func:`.vocab_parallel.token_stats`), at ``--rollout-temperature``, ``--log-probs-chunk-size``
        positions at a time."""
        cfg = self.train_config
        return token_stats(logits, input_ids, self.shape.vocab_size, cfg.log_probs_chunk_size,
                           cfg.rollout_temperature, with_entropy)

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def _pp(self) -> int:
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_world_size()

    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._stage_log_probs(input_ids)

    def _reference_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The frozen reference's log-probs (``--use-kl-loss``) on the last pipeline stage, None elsewhere."""
        with torch.no_grad():
            return self._stage_log_probs(input_ids, self.reference)

    def _from_last_stage(self, tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        buf = tensor.detach().contiguous() if tensor is not None else torch.empty_like(
            like, dtype=like.dtype if like.is_floating_point() else torch.float32)
        dist.broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
        return buf

    def log_probs(self, batch):
        """Micro-batch by micro-batch (a pipeline takes the share whole, its last stage broadcasting the
        log-probs), lined up across an expert-parallel group (``megatron.train.line_up``)."""
        from megatron.core import parallel_state as ps

        from rlplacement.backends.megatron.train import line_up

        self._check_routes(batch)
        self.set_train(False)
        batch = batch.to(self.device)
        parts = ([(slice(None), batch)] if self._pp > 1 else
                 [(idx, batch.rows(idx).trimmed()) for idx in self._micro_batches(batch)])
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for i, mb in enumerate(line_up([mb for _, mb in parts], self.model.config)):
                with self._routes(mb):
                    logp = self._stage_log_probs(mb.input_ids)
                if logp is not None and i < len(parts):  # the last stage; not a stand-in
                    idx, own = parts[i]
                    rows, width = own.input_ids.shape
                    out[idx, :width] = logp[:rows, :width]
        if self._pp == 1:
            return out
        return self._from_last_stage(out if ps.is_pipeline_last_stage(ignore_virtual=True) else None, out)

    @property
    def replays_routes(self) -> bool:
        return bool(getattr(self.model.config, "moe_enable_routing_replay", False))

    @contextlib.contextmanager
    def _routes(self, batch, reference: bool = False):
        """The routers of the model (``reference``: of the reference) replay ``batch``'s routes while open."""
        if batch.routed_experts is None:
            yield
            return
        model = self.reference if reference else self.model
        self._replay(model, batch)
        try:
            yield
        finally:
            from rlplacement.backends.routing_replay import megatron_clear

            megatron_clear(model)

    def _replay(self, model, batch) -> None:
        from megatron.core import parallel_state as ps

        from rlplacement.backends.routing_replay import megatron_replay

        megatron_replay(model, batch.routed_experts, tp_rank=ps.get_tensor_model_parallel_rank(),
                        tp_size=ps.get_tensor_model_parallel_world_size(),
                        sequence_parallel=self.model.config.sequence_parallel)

    def _stage_forward(self, model, batch) -> torch.Tensor:
        """This stage's forward of one micro-batch through ``model`` (DDP around the stage): logits on the
        last stage, hidden states elsewhere (the schedule sends and receives them). With routes, its routers
        replay them from here until the step ends (a full recompute in this micro-batch's backward replays
        them too: without pipelining megatron runs each micro-batch's backward right after its forward)."""
        from rlplacement.backends.megatron.train import padding_mask_of

        if batch.routed_experts is not None:
            self._replay(model, batch)
        return model(batch.input_ids, *self._positions_and_mask(batch.input_ids),
                     **padding_mask_of(batch, self.model.config))

    def _positions_and_mask(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids and, for the local spec, an explicit causal mask (its default one is built on
        "cuda"); TransformerEngine builds its own from the causal mask type."""
        b, t = input_ids.shape
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        mask = None if self.spec == "te" else torch.triu(
            torch.ones(t, t, dtype=torch.bool, device=input_ids.device), diagonal=1)[None, None]
        return positions, mask

    def _optimizer_step(self, batch):
        """One optimizer step through megatron's schedule and optimizer (:mod:`.train`); the same sums,
        norm and learning rate as :meth:`TrainerBackend._optimizer_step` returns."""
        tokens = self._all_reduce([float(batch.loss_mask.sum())])[0]
        normalizer = max(tokens, 1.0) / self.data_parallel_size
        sums = self._step_sums(self._schedule(batch, normalizer, reduce=True), tokens)
        norm, lr = self._stepped()
        return sums, norm, lr

    def _begin_chunks(self) -> None:
        self._training.zero_grads()

    def _chunk_gradients(self, batch) -> torch.Tensor:
        """A chunk through megatron's schedule into DDP's gradient buffers, neither zeroed nor reduced."""
        return self._schedule(batch, 1.0, reduce=False)

    def _step_chunks(self, scale: float) -> tuple[float, float | None]:
        """DDP's buffers scaled, then reduced once by megatron (``finalize_model_grads``), then its step."""
        self._training.reduce_accumulated(scale)
        return self._stepped()

    def _stepped(self) -> tuple[float, float | None]:
        lr = self.optim_config.lr_at(self.step)
        norm, applied = self._training.step(lr)
        if applied:
            self.step += 1
        else:
            self.skipped_steps += 1
        return norm, lr if applied else None

    def _schedule(self, batch, normalizer: float, *, reduce: bool) -> torch.Tensor:
        """Every micro-batch of ``batch`` through megatron's schedule at ``normalizer``: ``reduce``, the buffers
        zeroed first and reduced after (a whole step), else accumulated into as they are (a chunk). Returns this
        rank's loss parts and log-prob sum (``_SUMS`` but tokens), the same on every pipeline stage."""
        from rlplacement.backends.base import _SUMS
        from rlplacement.backends.objective import policy_loss

        local = torch.zeros(len(_SUMS) - 1, dtype=torch.float64, device=self.device)  # all but tokens

        cfg = self.train_config
        multiple = self.model.config.tensor_model_parallel_size if self.model.config.sequence_parallel else 1
        from rlplacement.backends.megatron.train import line_up

        micro = line_up([batch.rows(idx).trimmed(multiple) for idx in self._micro_batches(batch)], self.model.config)
        # the reference's log-probs of every micro-batch first (a pipeline runs them stage to stage)
        references = {}
        for mb in micro if cfg.use_kl_loss else ():
            with self._routes(mb, reference=True):
                references[id(mb)] = self._reference_log_probs(mb.input_ids)

        def loss(mb, logits):
            stats = self._logits_to_stats(logits, mb.input_ids, with_entropy=bool(cfg.entropy_coef))
            parts = policy_loss(stats, mb, cfg, normalizer, references.get(id(mb)))
            local.add_(torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device).detach()
                                    for v in (*parts, (stats.logp.detach() * mb.loss_mask).sum())]))
            return parts.loss

        try:
            self._training.forward_backward(micro, self._stage_forward, loss, reduce=reduce)
        finally:
            if self.replays_routes:
                from rlplacement.backends.routing_replay import megatron_clear

                megatron_clear(self.model)
        if self._pp > 1:
            from megatron.core import parallel_state as ps

            local = self._from_last_stage(local if ps.is_pipeline_last_stage(ignore_virtual=True) else None, local)
        return local

    def _grad_norm(self) -> float:
        raise NotImplementedError("megatron's optimizer computes the gradient norm inside its step (backends.megatron.train)")

    def _dropped_tensors(self) -> list[torch.Tensor]:
        return self._training.gradient_buffers()

    def _resident_tensors(self) -> list[torch.Tensor]:
        """Parameters, DDP's parameter buffers and the optimizer's main parameters and state on the device
        (the gradient buffers are freed, not moved: :meth:`_dropped_tensors`)."""
        from rlplacement.backends.offload import local_tensor

        tensors = self._parameters() + self._training.resident_tensors()
        if self.reference is not None:
            tensors += list(self.reference.parameters())
        device = self.device
        return [t for t in tensors if local_tensor(t).device == device]

    def _stepped_by(self, param) -> bool:
        """megatron's optimizers hold only what they step (fp32 main parameters need not require grad)."""
        return True

    def _torch_optimizers(self) -> list:
        return [o.optimizer for o in self._training.megatron_optimizers()]

    def local_megatron_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's shards with global Megatron names (for checks that streamed == held)."""
        return [(n, p.detach()) for n, p in self._named]

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        from rlplacement.backends.megatron.cpu_shims import remove_cpu_shims

        ps.destroy_model_parallel()
        remove_cpu_shims()
