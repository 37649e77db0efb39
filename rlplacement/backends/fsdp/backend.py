"""FSDP2 trainer: the HF model sharded with ``fully_shard`` on every decoder layer and the root (gloo on
CPU, NCCL on GPU), built so that no rank holds the whole model (:mod:`.sharded_model`). Each rank is a
data-parallel replica holding a ``Shard(0)`` slice of every parameter; FSDP averages gradients across
ranks. Under ``--bf16`` the parameters and AdamW state stay fp32 (the master weights) while FSDP2's
``MixedPrecisionPolicy`` computes in bf16 and reduces gradients in fp32. Weights stream out one
parameter at a time, already in HF names, cast to the served dtype (bf16 under ``--bf16``): gathered whole
onto the rank that sends it, or, where every rank sends (``SHARES``), each rank's own rows as pieces
(``transfer.pieces``), with no gather at all.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from rlplacement.backends import launch
from rlplacement.backends.base import TrainerBackend, resolve_bf16
from rlplacement.backends.objective import TokenStats
from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
from rlplacement.errors import ConfigError
from rlplacement.families import family_for
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES


def served_dtype(stream_dtype: torch.dtype | None, bf16: bool) -> torch.dtype | None:
    """What the weight stream yields: as asked, else bf16 under mixed precision, else the parameters' own."""
    return torch.bfloat16 if stream_dtype is None and bf16 else stream_dtype


class FSDPBackend(TrainerBackend):
    name = "fsdp"

    def __init__(self, root: torch.nn.Module, model: torch.nn.Module, optim: OptimConfig, train: TrainConfig,
                 stream_dtype: torch.dtype | None, reference: torch.nn.Module | None = None):
        """``root``: the FSDP2 root module (its forward returns :class:`TokenStats`); ``model``: the module
        whose ``named_parameters`` are the HF-named parameters (the root's child, or the root itself)."""
        super().__init__(optim, train)
        self.root, self.model, self.stream_dtype, self.reference = root, model, stream_dtype, reference
        self._whole_cache: tuple[list, list] | None = None  # see _whole_parameters
        self._served: tuple[list, list[tuple[str, torch.Tensor]]] | None = None  # (parameters, copies): _served_copies
        self._expanded: tuple[list, list[tuple[str, torch.Tensor]]] | None = None  # see _checkpoint_pairs
        self.hf_config = model.config
        self.family = family_for(model.config)
        self.route_replay = None  # HFRouteReplay under --use-rollout-routing-replay

    @classmethod
    def from_config(cls, cfg: BackendConfig, optim: OptimConfig = OptimConfig(), train: TrainConfig | None = None,
                    dtype: torch.dtype = torch.float32, stream_dtype: torch.dtype | None = None,
                    compile_layers: bool = False, **_: Any) -> "FSDPBackend":
        """``dtype``: the parameters' (master) dtype; ``stream_dtype``: what the weight stream yields (default:
        bf16 under ``--bf16``, else the parameters' own); ``compile_layers``: ``torch.compile`` each decoder
        layer (GPU runs: see ``sharded_model.build_sharded``)."""
        from rlplacement.backends.fsdp.sharded_model import build_sharded

        train = train or TrainConfig()
        if not cfg.hf_checkpoint:
            raise ConfigError("--train-backend fsdp needs --hf-checkpoint (an HF model folder)")
        if not dist.is_initialized():
            launch.init_single_process()
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        bf16 = resolve_bf16(train)
        root = build_sharded(cfg.hf_checkpoint, device, mixed_precision=bf16, dtype=dtype,
                             gradient_checkpointing=train.gradient_checkpointing,
                             weights=not cfg.load or cfg.lora.enabled,  # a LoRA checkpoint holds no base
                             compile_layers=compile_layers, lora=cfg.lora if cfg.lora.enabled else None)
        reference = None
        if train.use_kl_loss:
            reference = build_sharded(cfg.hf_checkpoint, device, mixed_precision=bf16, dtype=dtype, trainable=False)
            reference.lm.config.output_router_logits = False  # its log-probs only
        backend = cls(root, root.lm, optim, train, served_dtype(stream_dtype, bf16), reference)
        if backend.family.moe:  # the flag, else config.json, decides the router loss (MoEConfig.aux_loss)
            coeff = cfg.moe.aux_loss(root.lm.config)
            root.lm.config.output_router_logits, root.lm.config.router_aux_loss_coef = coeff > 0, coeff
        if cfg.moe.rollout_routing_replay:
            from rlplacement.backends.routing_replay import HFRouteReplay

            backend.route_replay = HFRouteReplay([root] + ([reference] if reference is not None else []))
        backend.lora = cfg.lora if cfg.lora.enabled else None
        # over the sharded DTensors, built once; under LoRA the adapters only (the base is frozen)
        backend.optimizer = optim.build([p for p in root.parameters() if p.requires_grad])
        backend.source_hf_dir = cfg.hf_checkpoint
        if cfg.load:
            backend.load_checkpoint(cfg.load)
        return backend

    def _checkpointed(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        return self.root, self.optimizer

    @property
    def yields_resident_tensors(self) -> bool:
        """One rank holds every parameter whole (see iter_hf_tensors): the tensors streamed are the
        parameters themselves, or, cast to the served dtype, the persistent copies of
        :meth:`_served_copies`; either stays allocated and unchanged while an update runs."""
        return dist.get_world_size() == 1 and self.lora is None

    def _served_copies(self) -> list[tuple[str, torch.Tensor]]:
        """One rank with a cast stream (fp32 master weights, bf16 served): copies in the served dtype, in
        one allocation kept between updates (so cuda_ipc maps one handle, once) and refreshed by one
        ``_foreach_copy_`` per update, a cast at HBM speed (2 + 4 bytes per parameter read and written).
        The same pair objects every update while the parameters are the same, as for the parameters
        themselves; dropped on offload (they are derived) and made again at the next update."""
        whole = self._whole_parameters()
        if self._served is None or self._served[0] is not whole:
            align = max(1, 16 // self.stream_dtype.itemsize)  # every copy 16-byte aligned (the copy kernel's vectors)
            sizes = [-(-t.numel() // align) * align for _, t in whole]
            flat = torch.empty(sum(sizes), dtype=self.stream_dtype, device=self.device)
            views, offset = [], 0
            for (name, t), size in zip(whole, sizes):
                views.append((name, flat[offset:offset + t.numel()].view(t.shape)))
                offset += size
            self._served = (whole, views)
        views = self._served[1]
        with torch.no_grad():
            torch._foreach_copy_([v for _, v in views], [t for _, t in whole])
        return views

    def offload_to_host(self) -> dict[str, float]:
        start = time.perf_counter()
        self._served = None  # derived from the parameters: freed, not moved
        dropped = time.perf_counter() - start
        report = super().offload_to_host()
        return {**report, "prepare_seconds": report["prepare_seconds"] + dropped}

    def _resident_tensors(self) -> list[torch.Tensor]:
        from rlplacement.backends.offload import local_tensor

        frozen = list(self.reference.parameters()) if self.reference is not None else []
        return super()._resident_tensors() + [t for t in frozen if local_tensor(t).device == self.device]

    def _whole_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """One rank: (name, detached local tensor) of every parameter, the same objects every update while
        each module still holds the same parameter with the same local tensor. Walking the model and
        making ~400 views cost ~3.5 ms per update, on the colocated update's critical path; checking the
        kept owners costs ~0.1 ms. The views share their parameters' storages, so they follow an offload
        and reload (storages resized in place) as the parameters do."""
        kept = self._whole_cache
        if kept is not None and all(table.get(key) is param and getattr(param, "_local_tensor", param) is local
                                    for table, key, param, local in kept[0]):
            return kept[1]
        owners, stream = [], []
        for name, param in self.model.named_parameters():
            module_name, _, key = name.rpartition(".")
            local = getattr(param, "_local_tensor", None)
            if local is None:
                local = param.to_local() if hasattr(param, "to_local") else param
            # the module's own dict: replacing its parameter replaces this entry
            owners.append((self.model.get_submodule(module_name)._parameters, key, param, local))
            stream.append((name, local.detach()))
        self._whole_cache = (owners, stream)
        return stream

    def set_train(self, training: bool) -> None:
        self.model.train(training)

    def _parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._token_stats(input_ids).logp

    def _token_stats(self, input_ids: torch.Tensor, *, with_entropy: bool = False) -> TokenStats:
        cfg = self.train_config
        return self.root(input_ids, temperature=cfg.rollout_temperature, chunk_tokens=cfg.log_probs_chunk_size,
                         with_entropy=with_entropy)

    @property
    def replays_routes(self) -> bool:
        return self.route_replay is not None

    def _routes(self, batch, reference: bool = False):
        """One hook set serves the trained model and its reference (see :class:`HFRouteReplay`)."""
        if batch.routed_experts is None:
            return super()._routes(batch, reference)
        return self.route_replay.routing(batch.routed_experts)

    def _reference_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.train_config
        try:
            return self.reference(input_ids, temperature=cfg.rollout_temperature,
                                  chunk_tokens=cfg.log_probs_chunk_size).logp
        finally:
            self.reference.reshard()

    def log_probs(self, batch):
        """FSDP2 keeps the root's parameters gathered after a forward with no backward; while gathered,
        ``model.parameters()`` are plain tensors, so an optimizer or a weight stream would see copies that
        the next gather overwrites. Reshard to put the sharded DTensors back."""
        try:
            return super().log_probs(batch)
        finally:
            self.root.reshard()

    def _grad_norm(self) -> float:
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._parameters():
            if p.grad is not None:
                total += p.grad.to_local().double().pow(2).sum()
        dist.all_reduce(total)
        return math.sqrt(float(total))

    def _update_sizes(self) -> list[tuple[str, int]]:
        return [(name, p.numel() * (self.stream_dtype or p.dtype).itemsize)
                for name, p, _ in self._stream_entries(self._adapter_updates)]

    @property
    def _adapter_updates(self) -> bool:
        return self.lora is not None and self.lora.adapter_updates

    def _to_hf(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (parameter ``name`` whole, or rows of it that :meth:`_rows_convert` allows) in the HF
        layout: the parameters here are HF's."""
        return tensor

    def _rows_convert(self, name: str, box: tuple) -> bool:
        """Whether rows ``box`` of parameter ``name`` can be put in the HF layout on their own."""
        return True

    def _stream_entries(self, adapters: bool = False, base: bool = False) -> list[tuple[str, torch.nn.Parameter,
                                                                                         tuple | None]]:
        """``(name, parameter, adapter)`` of every tensor a stream yields, in stream order: each parameter
        under its HF name; under LoRA the adapters left out and each adapted layer's base weight with its
        ``(A, B)`` to merge in (:mod:`.lora`). ``adapters``: the adapters alone instead, under their PEFT
        names (:mod:`rlplacement.lora_format`), what an adapter-only update sends; ``base``: the frozen base
        unmerged."""
        from rlplacement.backends import lora as adapters_of

        params = dict(self.model.named_parameters())
        if adapters:
            return [(adapters_of.peft_name(n), p, None) for n, p in params.items() if adapters_of.is_adapter(n)]
        merge = self.lora is not None and not base
        return [(adapters_of.hf_name(n), p, adapters_of.adapted(params, n) if merge else None)
                for n, p in params.items() if not adapters_of.is_adapter(n)]

    def iter_base_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Under LoRA, the frozen base whole on rank 0 under HF names, in the stream's dtype, adapters not
        merged: what the engines serve under adapter-only updates (collective)."""
        self.root.reshard()
        yield from self._iter_gathered(None, everywhere=False, base=True)

    def iter_update_tensors(self, share: str = RANK0) -> Iterator[tuple[str, torch.Tensor]]:
        """Under adapter-only LoRA updates (:attr:`LoRAConfig.adapter_updates`) the adapters alone, under
        their PEFT names; else the HF tensors."""
        adapters = self._adapter_updates
        if share == OWN_GPU and dist.get_world_size() > 1:  # every rank needs every tensor: all-gathers
            return self._iter_hf(None, everywhere=True, adapters=adapters)
        if adapters:
            return self._iter_hf(self.update_owners() if share == SHARES else None, everywhere=False, adapters=True)
        if share == SHARES and self._sends_pieces:
            return self._iter_pieces()
        return super().iter_update_tensors(share)

    @property
    def _sends_pieces(self) -> bool:
        """Where every rank sends, each sends its own rows of each tensor (``transfer.pieces``) instead of
        gathering it onto one owner (``trainer_sends_pieces``)."""
        from rlplacement.transfer.pieces import trainer_sends_pieces

        return trainer_sends_pieces(self.name, dist.get_world_size(), SHARES, lora=self.lora is not None)

    def _row_pieces(self, name: str, param) -> list[tuple[int, tuple]] | None:
        """``(global rank, box)`` of each rank's rows of a dim-0-sharded parameter (FSDP2's ``torch.chunk``
        split; a rank past the last row holds none and is left out); None for a parameter held otherwise, or
        whose rows some rank cannot put in the HF layout alone (:meth:`_rows_convert`)."""
        if not hasattr(param, "full_tensor") or param.device_mesh.size() == 1 or not _dim0_sharded(param):
            return None
        from rlplacement.transfer.pieces import row_part

        group = param.device_mesh.get_group()
        box = tuple((0, n) for n in param.shape)
        parts = [(r, row_part(box, dist.get_world_size(group), r)) for r in range(dist.get_world_size(group))]
        out = [(dist.get_global_rank(group, r), (rows,) + box[1:]) for r, rows in parts if rows is not None]
        return out if all(self._rows_convert(name, b) for _, b in out) else None

    def _iter_pieces(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's rows of every dim-0-sharded parameter, each under its piece name
        (``transfer.pieces.piece_name``), cast to the stream's dtype: no gather, so no rank receives another's
        shard. A sparse layer's fused experts are sharded by expert, so a rank's rows of them are whole
        experts: those go as the checkpoint's per-expert tensors, whole (``family.checkpoint_views``). Any
        other parameter is gathered whole onto its owner (:meth:`update_owners`), a collective every rank
        runs in the same order."""
        from rlplacement.transfer.pieces import piece_name

        self.root.reshard()
        rank = dist.get_rank()
        owners = self.update_owners()
        self.last_stream_gathered_bytes = 0
        for name, param, _ in self._stream_entries():
            pieces = self._row_pieces(name, param)
            if pieces is None:
                full = self._whole_on(param, owners[name], everywhere=False)
                if owners[name] == rank:
                    full = self._to_hf(name, full.detach())
                    yield from self.family.checkpoint_views(
                        name, full if self.stream_dtype is None else full.to(self.stream_dtype))
                continue
            box = dict(pieces).get(rank)
            if box is None:
                continue
            local = param.to_local().detach()
            if local.shape[0] != box[0][1] - box[0][0]:
                raise RuntimeError(f"{name}: this rank holds {local.shape[0]} rows, FSDP2's chunking gives "
                                   f"{box[0][1] - box[0][0]} ({box[0]})")
            local = self._to_hf(name, local)
            local = local if self.stream_dtype is None else local.to(self.stream_dtype)
            if self.family.holds_experts(name):
                yield from self.family.checkpoint_views(name, local, first_expert=box[0][0])
            else:
                yield piece_name(name, box, tuple(param.shape)), local

    def update_shares(self) -> list[tuple[str, int, int]]:
        """Where every rank sends its own rows (:attr:`_sends_pieces`): ``(piece name, bytes, rank)`` of every
        rank's piece of every tensor (a rank's experts under their own names, whole); else whole tensors by
        :meth:`update_owners`."""
        if not self._sends_pieces:
            return super().update_shares()
        from rlplacement.transfer.pieces import piece_name

        out, owners = [], self.update_owners()
        itemsizes = {name: (self.stream_dtype or p.dtype).itemsize for name, p, _ in self._stream_entries()}

        def views(name: str, shape: tuple, first_expert: int = 0) -> list[tuple[str, int]]:
            meta = torch.empty(shape, device="meta")
            return [(n, v.numel() * itemsizes[name])
                    for n, v in self.family.checkpoint_views(name, meta, first_expert=first_expert)]

        for name, param, _ in self._stream_entries():
            pieces = self._row_pieces(name, param)
            if pieces is None:
                out.extend((n, nbytes, owners[name]) for n, nbytes in views(name, tuple(param.shape)))
            elif self.family.holds_experts(name):
                for r, box in pieces:
                    rows = (box[0][1] - box[0][0],) + tuple(param.shape[1:])
                    out.extend((n, nbytes, r) for n, nbytes in views(name, rows, box[0][0]))
            else:
                per_row = math.prod(param.shape[1:]) * itemsizes[name]
                out.extend((piece_name(name, box, tuple(param.shape)), (box[0][1] - box[0][0]) * per_row, r)
                           for r, box in pieces)
        return out

    def iter_hf_tensors(self, owners: dict[str, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter is gathered onto the one rank that yields it (``owners``, else rank 0): its
        shards go to that rank alone, so a rank receives what it sends and no more
        (:attr:`last_stream_gathered_bytes`). Names are the checkpoint's (``family.checkpoint_views``: a
        mixture-of-experts layer's fused experts as per-expert views); ``owners`` is keyed by parameter, so
        an expert parameter's views go from one rank."""
        return self._iter_hf(owners, everywhere=False)

    last_stream_gathered_bytes: int = 0
    """Bytes this rank received from other ranks' shards in its last stream."""

    def _iter_hf(self, owners: dict[str, int] | None, everywhere: bool,
                 adapters: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        self.root.reshard()  # see log_probs: stream the sharded parameters, never a stale gathered copy
        if adapters:
            yield from self._iter_gathered(owners, everywhere, adapters=True)
            return
        if dist.get_world_size() == 1 and self.lora is None:
            whole = self._whole_parameters()
            if self.stream_dtype is None or all(t.dtype == self.stream_dtype for _, t in whole):
                yield from self._checkpoint_pairs(whole)  # the same pairs every update: receivers see nothing moved
            else:
                yield from self._checkpoint_pairs(self._served_copies())
            return
        for name, tensor in self._iter_gathered(owners, everywhere):
            yield from self.family.checkpoint_views(name, tensor)

    def _checkpoint_pairs(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``pairs`` in the checkpoint's names, the same list object while ``pairs`` is (views of views made
        once, so a receiver that keys on the tensors sees nothing moved)."""
        if not self.family.moe:
            return pairs
        if self._expanded is None or self._expanded[0] is not pairs:
            self._expanded = (pairs, [v for name, t in pairs for v in self.family.checkpoint_views(name, t)])
        return self._expanded[1]

    def _iter_gathered(self, owners: dict[str, int] | None, everywhere: bool, adapters: bool = False,
                       base: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``everywhere``: every parameter all-gathered on every rank and yielded there; else each gathered
        onto its owner only (``dist.gather`` of the ranks' dim-0 shards, padded to one size) and yielded
        there. Collective: every rank runs through every parameter in the same order."""
        from rlplacement.backends.lora import merged

        rank = dist.get_rank()
        self.last_stream_gathered_bytes = 0
        for name, param, adapter in self._stream_entries(adapters, base):
            owner = rank if everywhere else owners[name] if owners is not None else 0
            full = self._whole_on(param, owner, everywhere)
            if adapter is not None:  # LoRA: the adapters gathered with their layer, merged in fp32
                a, b = (self._whole_on(t, owner, everywhere) for t in adapter)
                full = merged(full, a, b, self.lora.scaling) if full is not None else None
            if owner == rank:
                full = self._to_hf(name, full.detach())
                yield name, full if self.stream_dtype is None else full.to(self.stream_dtype)

    def _whole_on(self, param, owner: int, everywhere: bool) -> torch.Tensor | None:
        """``param`` whole on ``owner`` (on every rank where ``everywhere``), None on the others (collective)."""
        if not hasattr(param, "full_tensor"):
            return param.detach()
        if param.device_mesh.size() == 1:
            # one rank holds it whole: no gather, no copy (the attribute read is ~6x cheaper than
            # to_local()'s autograd wrapper, which is ~5 ms per update over 400 parameters)
            local = getattr(param, "_local_tensor", None)
            return param.to_local() if local is None else local
        if everywhere or not _dim0_sharded(param):
            full = param.full_tensor()
        else:
            full = _gather_onto(param, owner)
        if full is not None:
            self.last_stream_gathered_bytes += (full.numel() - param.to_local().numel()) * full.element_size()
        return full


def _dim0_sharded(param) -> bool:
    """FSDP2's layout: one mesh dimension, the parameter's dim 0 split over it (``torch.chunk``'s sizes)."""
    from torch.distributed.tensor import Shard

    return param.device_mesh.ndim == 1 and tuple(param.placements) == (Shard(0),)


def _gather_onto(param, owner: int) -> torch.Tensor | None:
    """The whole of a dim-0-sharded DTensor on global rank ``owner`` (None on the others): each rank's shard,
    zero-padded to ``ceil(rows / ranks)`` rows, gathered there alone."""
    local = param.to_local().detach()
    group = param.device_mesh.get_group()
    ranks = dist.get_world_size(group)
    rows = -(-param.shape[0] // ranks)
    if local.shape[0] != rows or not local.is_contiguous():
        padded = local.new_zeros((rows, *param.shape[1:]))
        padded[:local.shape[0]] = local
        local = padded
    if dist.get_rank() != owner:
        dist.gather(local, None, dst=owner, group=group)
        return None
    whole = local.new_empty((ranks * rows, *param.shape[1:]))
    dist.gather(local, list(whole.chunk(ranks)), dst=owner, group=group)  # each rank's rows in place
    return whole[:param.shape[0]]
