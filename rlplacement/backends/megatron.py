"""Megatron-core trainer: a ``GPTModel`` sharded by TP (and DP by replication), loaded from a torch_dist
checkpoint (``--load``, from ``rlplacement convert``) or straight from an HF folder (``--hf-checkpoint``).

It trains with megatron-core's own machinery (``megatron_train``): ``DistributedDataParallel``, a
megatron optimizer (``--use-distributed-optimizer`` shards it over data-parallel ranks) and
``get_forward_backward_func`` over the step's micro-batches, pipelined across stages when PP > 1;
megatron reduces the gradients (data-parallel buckets, q/k norms over TP, a tied embedding's two
copies over its embedding group). On a CPU host the few CUDA calls of that machinery are shimmed
(``megatron_cpu``). Weights stream out bucket by bucket (:func:`megatron_model.iter_hf_tensors`).
Log-probs use Megatron's vocab-parallel cross-entropy with the padded vocabulary columns masked to
-inf, so they equal the HF model's; without gradients, a pipeline's log-probs go through the stages
by point-to-point sends and the last stage broadcasts them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.backends import launch
from rlplacement.families import megatron_mapping as mapping
from rlplacement.backends import megatron_model as mm
from rlplacement.backends.base import TrainerBackend, resolve_bf16
from rlplacement.backends.objective import TokenStats
from rlplacement.families import family_for
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES


class MegatronBackend(TrainerBackend):
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
        from rlplacement.backends.megatron_cpu import cuda_absent
        from rlplacement.backends.megatron_train import MegatronTraining

        overlap = not cuda_absent() if overlap_grad_reduce is None else overlap_grad_reduce
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
        from rlplacement.backends import megatron_checkpoint as layout

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
            from rlplacement.backends import megatron_lora

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
        from rlplacement.backends.megatron_lora import adapters_of

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
        """``[B, T]`` log-probs (and entropies) from this TP rank's vocabulary shard of the logits, the padded
        vocabulary columns masked out; differentiable, each sum over the vocabulary all-reduced over TP.

        ``--log-probs-chunk-size`` positions at a time: the fp32 logits of a chunk, their masking and
        megatron's vocab-parallel cross-entropy exist for one chunk at once (with gradients each chunk runs
        under activation checkpointing and is recomputed in backward). The output layer's own logits are
        whole: megatron's ``Float16Module`` hands the last stage's output back in fp32."""
        from megatron.core import parallel_state as ps
        from torch.utils.checkpoint import checkpoint

        b, t, shard = logits.shape
        first = ps.get_tensor_model_parallel_rank() * shard
        padding = torch.arange(first, first + shard, device=logits.device) >= self.shape.vocab_size
        rows = logits.reshape(-1, shard)  # a view: the model's output is contiguous
        # position p predicts token p + 1; each sample's last position predicts nothing (any target, dropped)
        targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).reshape(-1)
        grad = torch.is_grad_enabled() and logits.requires_grad
        chunk = self.train_config.log_probs_chunk_size
        logps, entropies = [], []
        for start in range(0, rows.shape[0], chunk):
            piece = (rows[start:start + chunk], targets[start:start + chunk], padding, with_entropy)
            logp, entropy = (checkpoint(self._chunk_stats, *piece, use_reentrant=False) if grad
                             else self._chunk_stats(*piece))
            logps.append(logp)
            entropies.append(entropy)
        zero = logits.new_zeros(b, 1, dtype=torch.float32)
        logp = torch.cat([zero, torch.cat(logps).reshape(b, t)[:, :-1]], dim=1)
        entropy = torch.cat([zero, torch.cat(entropies).reshape(b, t)[:, :-1]], dim=1) if with_entropy else None
        return TokenStats(logp, entropy)

    def _chunk_stats(self, logits: torch.Tensor, targets: torch.Tensor, padding: torch.Tensor,
                     with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``targets`` (and entropies) for ``[rows, V_padded / TP]`` logits of one chunk."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        fresh = logits.dtype != torch.float32  # then the fp32 copy below is ours to mask in place
        logits = logits.float()
        if self.train_config.rollout_temperature != 1.0:
            logits, fresh = logits / self.train_config.rollout_temperature, True
        logits = (logits.masked_fill_ if fresh else logits.masked_fill)(padding, float("-inf"))
        # the entropy first: megatron's cross-entropy overwrites its input in place
        entropy = _vocab_parallel_entropy(logits, padding) if with_entropy else None
        return -vocab_parallel_cross_entropy(logits, targets), entropy

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
        log-probs), lined up across an expert-parallel group (``megatron_train.line_up``)."""
        from megatron.core import parallel_state as ps

        from rlplacement.backends.megatron_train import line_up

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
        from rlplacement.backends.megatron_train import padding_mask_of

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
        """One optimizer step through megatron's schedule and optimizer (``megatron_train``); the same sums,
        norm and learning rate as :meth:`TrainerBackend._optimizer_step` returns."""
        from rlplacement.backends.base import _SUMS
        from rlplacement.backends.objective import policy_loss

        tokens = self._all_reduce([float(batch.loss_mask.sum())])[0]
        normalizer = max(tokens, 1.0) / self.data_parallel_size
        local = torch.zeros(len(_SUMS) - 1, dtype=torch.float64, device=self.device)  # all but tokens

        cfg = self.train_config
        multiple = self.model.config.tensor_model_parallel_size if self.model.config.sequence_parallel else 1
        from rlplacement.backends.megatron_train import line_up

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
            self._training.forward_backward(micro, self._stage_forward, loss)
        finally:
            if self.replays_routes:
                from rlplacement.backends.routing_replay import megatron_clear

                megatron_clear(self.model)
        if self._pp > 1:
            from megatron.core import parallel_state as ps

            local = self._from_last_stage(local if ps.is_pipeline_last_stage(ignore_virtual=True) else None, local)
        sums = self._step_sums(local, tokens)
        lr = self.optim_config.lr_at(self.step)
        norm, applied = self._training.step(lr)
        if applied:
            self.step += 1
        else:
            self.skipped_steps += 1
        return sums, norm, lr if applied else None

    def _grad_norm(self) -> float:
        raise NotImplementedError("megatron's optimizer computes the gradient norm inside its step (megatron_train)")

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

    def save_checkpoint(self, root: str, weight_version: int, job_state: dict[str, Any] | None = None) -> str:
        """Collective: the whole training state under ``root`` with megatron's ``dist_checkpointing`` (the
        model, the optimizer's main parameters and state, the frozen reference; reshardable to another
        TP/PP/DP as megatron's own checkpoints are), plus the counters and RNG, published whole
        (``train_checkpoint.publish``, with checksums and the model's identity); the model's description at the
        root (``megatron_checkpoint.describe``); ``job_state`` as the base class keeps it."""
        from megatron.core import dist_checkpointing

        from rlplacement.backends import megatron_checkpoint as layout
        from rlplacement.backends import train_checkpoint

        def write(tmp: Path) -> None:
            if dist.get_rank() == 0:
                layout.describe(root, *self.description)
            dist_checkpointing.save(self._sharded_state_dict(loading=False), str(tmp))

        state = self._saved_state(weight_version, job_state, kl_reference=self.reference is not None,
                                  **self.lora_checkpoint_state())
        return str(train_checkpoint.publish(root, self.train_calls, write, state, self.model_identity()))

    def load_checkpoint(self, root: str) -> dict[str, Any]:
        """Collective: resume from the last checkpoint under ``root`` (see :meth:`save_checkpoint`), checked
        first against its manifest and :attr:`source_hf_dir`'s model (``train_checkpoint.verified``)."""
        from megatron.core import dist_checkpointing

        from rlplacement.backends import train_checkpoint

        @torch.no_grad()  # the loads copy into parameters and views of them
        def read(folder: Path) -> None:
            saved = train_checkpoint.read_state(folder)
            if self.reference is not None and self.lora is None and not saved.get("kl_reference"):
                raise ConfigError(f"--use-kl-loss with --load {root}: that run had no --use-kl-loss, so its "
                                  f"checkpoint holds no reference model to pull towards; drop --use-kl-loss, or "
                                  f"start from the converted checkpoint with it")
            self._refuse_other_checkpoint_kind(saved, root)
            self._training.ensure_optimizer_state(adam_step=saved["step"])
            loaded = dist_checkpointing.load(self._sharded_state_dict(loading=True), str(folder))
            if self.lora is not None:
                from rlplacement.backends.megatron_lora import load_state

                load_state(self.model, loaded["model"], folder)
            else:
                _load_model_state(self.model, loaded["model"], folder)
            if self.reference is not None and self.lora is None:
                _load_model_state(self.reference, {k.removeprefix("reference."): v
                                                   for k, v in loaded["reference"].items()}, folder)
            self._training.load_optimizer_state(loaded["optimizer"])

        state = train_checkpoint.restore(train_checkpoint.latest(root), read, self.source_hf_dir)
        return self._resumed_from(state)

    def _sharded_state_dict(self, loading: bool) -> dict:
        """What a checkpoint holds, as megatron's training lays it out: the distributed optimizer's state
        ``dp_reshardable`` (its default there: one tensor per buffer, resumable at another DP size; the
        model itself at any TP/PP). Under LoRA the model is its adapters alone
        (:func:`megatron_lora.sharded_state_dict`)."""
        if self.lora is not None:  # the adapters alone: the base is the HF folder's, named by the identity
            from rlplacement.backends.megatron_lora import sharded_state_dict

            model = sharded_state_dict(self.model)
        else:
            model = self.model.sharded_state_dict()
        out = {"model": model, "optimizer": self.optimizer.sharded_state_dict(
            model, is_loading=loading, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
        if self.reference is not None and self.lora is None:  # LoRA's reference is the HF folder's base
            out["reference"] = self.reference.sharded_state_dict(prefix="reference.")
        return out

    def _stepped_by(self, param) -> bool:
        """megatron's optimizers hold only what they step (fp32 main parameters need not require grad)."""
        return True

    def _torch_optimizers(self) -> list:
        return [o.optimizer for o in self._training.megatron_optimizers()]

    @property
    def yields_resident_tensors(self) -> bool:
        """One rank holds every parameter whole (TP = PP = DP = 1) in the dtype streamed (bf16 under
        ``--bf16``, whose fp32 main parameters live in the optimizer): an update reads the parameters in
        place (:meth:`iter_update_tensors`). A cast stream (fp32 training, bf16 served) still goes by copies."""
        return dist.get_world_size() == 1 and self.stream_dtype in (None, self._dtype) and self.lora is None

    @property
    def update_hf_shapes(self) -> dict[str, tuple[int, ...]] | None:
        return self._resident_views()[1] if self.yields_resident_tensors else None

    def iter_update_tensors(self, share: str = RANK0) -> Iterator[tuple[str, torch.Tensor]]:
        """With resident tensors, views of the parameters (:func:`megatron_mapping.hf_views`): q, k and v
        as the fused QKV's row groups (:attr:`update_hf_shapes`), the rest in their HF shapes; else
        :meth:`iter_hf_tensors`, or, by ``share``, every rank's share of its own stage (its pieces,
        :meth:`_iter_pieces`; under LoRA :func:`megatron_model.iter_own_stage_megatron`: megatron parameters
        whole, so q/k/v and gate/up of one fused parameter go from one rank) or every tensor on every rank
        (:func:`megatron_model.iter_everywhere_megatron`)."""
        if self.yields_resident_tensors:
            self.last_stream_collectives = 0
            return iter(self._resident_views()[0])
        if self.lora is not None and self.lora.adapter_updates:
            return self._iter_adapters(share)
        if share == SHARES and self._sends_pieces:
            return self._iter_pieces()
        return self._iter_stream(share)

    @property
    def _sends_pieces(self) -> bool:
        """Where every rank sends, each sends the parts of the HF tensors its own shards are
        (``transfer.pieces.trainer_sends_pieces``) instead of whole tensors its TP group gathered."""
        from rlplacement.transfer.pieces import trainer_sends_pieces

        return trainer_sends_pieces("megatron", dist.get_world_size(), SHARES, lora=self.lora is not None)

    def update_shares(self) -> list[tuple[str, int, int]]:
        """Where every rank sends pieces (:attr:`_sends_pieces`): ``(piece name, or the HF name of a box that is
        the whole tensor, bytes as streamed, rank)`` of every rank's pieces, from the transfer plan's rule
        (``trainer_shards.megatron_piece_holdings``, which :func:`megatron_model.iter_own_pieces_megatron`
        follows) on this model's config, before any byte moves; else the base's."""
        if not self._sends_pieces:
            return super().update_shares()
        import os

        from megatron.core import parallel_state as ps

        from rlplacement.transfer.pieces import piece_name
        from rlplacement.transfer.plan.boxes import volume, whole
        from rlplacement.transfer.plan.tensors import ModelTensors
        from rlplacement.transfer.plan.trainer_shards import megatron_piece_holdings

        model = ModelTensors.from_hf_config(os.path.join(self.source_hf_dir, "config.json"))
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        dp = dist.get_world_size() // (tp * pp)
        ep = ps.get_expert_model_parallel_world_size() if self.family.moe else 1
        itemsize = (self.stream_dtype or self._dtype).itemsize
        shapes = {t.name: t.shape for t in model.tensors}
        return [(name if box == whole(shapes[name]) else piece_name(name, box, shapes[name]),
                 volume(box) * itemsize, rank)
                for rank, boxes in enumerate(megatron_piece_holdings(model, tp, pp, dp, ep))
                for name, box in boxes.items()]

    def _iter_pieces(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's pieces (:func:`megatron_model.iter_own_pieces_megatron`), cast to the stream's dtype."""
        skip = frozenset({"output_layer.weight"}) if self.shape.tied else frozenset()
        for name, tensor in mm.iter_own_pieces_megatron(self.model, self.shape, self.family, skip):
            yield name, tensor if self.stream_dtype is None else tensor.to(self.stream_dtype)
        self.last_stream_collectives = 0

    def _iter_adapters(self, share: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters alone under their PEFT names (gathered everywhere: they are small): every one on global
        rank 0, on every rank (``OWN_GPU``), or each on the one rank that sends it (``SHARES``, balanced by
        bytes)."""
        from rlplacement.backends.megatron_lora import full_adapters
        from rlplacement.transfer.bucket import fused_group_of
        from rlplacement.transfer.plan.senders import spread_owners_by_group

        adapters = full_adapters(self.model)
        rank, world = dist.get_rank(), dist.get_world_size()
        if share == OWN_GPU:
            owners = {name: rank for name in adapters}
        elif share == SHARES and world > 1:
            owners = spread_owners_by_group([(n, t.numel() * (self.stream_dtype or t.dtype).itemsize)
                                             for n, t in adapters.items()], world, fused_group_of)
        else:
            owners = {name: 0 for name in adapters}
        self.last_stream_collectives = None
        for name, tensor in adapters.items():
            if owners[name] == rank:
                yield name, tensor if self.stream_dtype is None else tensor.to(self.stream_dtype)

    def iter_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Under LoRA, the frozen base as :meth:`iter_hf_tensors` streams it, adapters not merged (collective)."""
        return self._iter_stream(RANK0, merge=False)

    def _resident_views(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, tuple[int, ...]]]:
        """Made once: the parameters are never replaced (loads copy into them), and views follow their
        storages through an offload and reload, so the same objects serve every update (the direct
        path's manifest is kept while the objects and their addresses are unchanged)."""
        if self._views is None:
            views, shapes = [], {}
            for mname, param in self._named:
                for name, view, hf_shape in mapping.hf_views(mname, param.detach(), self.shape, self.family):
                    views.append((name, view))
                    if hf_shape is not None:
                        shapes[name] = hf_shape
            self._views = (views, shapes)
        return self._views

    def iter_hf_tensors(self, owners: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Bucket by bucket (:func:`megatron_model.iter_full_megatron`); once the stream ends,
        :attr:`last_stream_collectives` holds the collectives this rank issued in its TP and PP groups.
        Megatron shares an update out by its own parameters (:meth:`iter_update_tensors`), not by ``owners``."""
        if owners is not None:
            raise ValueError("megatron spreads an update by its own parameters: iter_update_tensors(share)")
        return self._iter_stream(RANK0)

    def _iter_stream(self, share: str, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Under LoRA (``merge``) each adapted weight with ``alpha / r * B A`` merged in (the adapters gathered
        everywhere first: :func:`megatron_lora.full_adapters`)."""
        counter = mm.CollectiveCount()
        merges = {}
        if self.lora is not None and merge:
            from rlplacement.backends.megatron_lora import full_adapters
            from rlplacement.lora_format import PEFT_PREFIX

            adapters = full_adapters(self.model)
            merges = {n.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight"):
                      (t, adapters[n.replace(".lora_A.", ".lora_B.")]) for n, t in adapters.items() if ".lora_A." in n}
        for name, tensor in mm.iter_hf_tensors(self.model, self.shape, self.family, counter=counter, share=share):
            if name in merges:
                from rlplacement.backends.lora import merged

                tensor = merged(tensor, *merges[name], self.lora.scaling)
            yield name, tensor if self.stream_dtype is None else tensor.to(self.stream_dtype)
        self.last_stream_collectives = counter.count

    def local_megatron_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's shards with global Megatron names (for checks that streamed == held)."""
        return [(n, p.detach()) for n, p in self._named]

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        from rlplacement.backends.megatron_cpu import remove_cpu_shims

        ps.destroy_model_parallel()
        remove_cpu_shims()


def _vocab_parallel_entropy(logits: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Per row of ``logits`` (``[..., V_padded / TP]``, this TP rank's vocabulary shard, ``-inf`` in
    ``padding``'s columns), the entropy of the softmax over the whole vocabulary: log Z - sum p l, each
    vocabulary sum all-reduced over TP by megatron's differentiable reduction (forward: sum; backward: each
    rank's own share), the max taken out first."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    top = logits.detach().amax(dim=-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = (logits - top).masked_fill(padding, 0.0)
    weights = torch.exp(logits - top)  # 0 in the padding
    total = reduce_from_tensor_model_parallel_region(weights.sum(-1))
    weighted = reduce_from_tensor_model_parallel_region((weights * shifted).sum(-1))
    return torch.log(total) - weighted / total


def _load_model_state(model, state: dict, folder: Path) -> None:
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise RuntimeError(f"{folder}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
