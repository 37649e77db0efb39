"""What the Megatron backend streams for a weight update: views of its parameters where one rank holds them
whole, else the model's update streams (:mod:`.update_streams`) by who sends, with LoRA's adapters merged in
or sent alone.

Mixed into :class:`~.backend.MegatronBackend`, whose ``model``, ``shape``, ``family``, ``stream_dtype``,
``lora``, ``source_hf_dir``, named parameters (``_named``) and parameter dtype (``_dtype``) it reads.
Invariants: every stream is collective (every rank calls it and consumes it to the end, see
:meth:`TrainerBackend.iter_update_tensors`); once one ends, :attr:`last_stream_collectives` holds the
collectives this rank issued for it (0 where nothing was gathered, None where not counted).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from rlplacement.backends.base import TrainerBackend
from rlplacement.backends.megatron.bucket_gather import CollectiveCount
from rlplacement.backends.megatron.update_streams import iter_hf_tensors, iter_own_pieces_megatron
from rlplacement.families import megatron_mapping as mapping
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES


class MegatronUpdates(TrainerBackend):
    """:meth:`iter_update_tensors` and its kin for the Megatron backend."""

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
        :meth:`_iter_pieces`; under LoRA :func:`.update_streams.iter_own_stage_megatron`: megatron parameters
        whole, so q/k/v and gate/up of one fused parameter go from one rank) or every tensor on every rank
        (:func:`.update_streams.iter_everywhere_megatron`)."""
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
        (``trainer_shards.megatron_piece_holdings``, which :func:`.update_streams.iter_own_pieces_megatron`
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
        """This rank's pieces (:func:`.update_streams.iter_own_pieces_megatron`), cast to the stream's dtype."""
        skip = frozenset({"output_layer.weight"}) if self.shape.tied else frozenset()
        for name, tensor in iter_own_pieces_megatron(self.model, self.shape, self.family, skip):
            yield name, tensor if self.stream_dtype is None else tensor.to(self.stream_dtype)
        self.last_stream_collectives = 0

    def _iter_adapters(self, share: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapters alone under their PEFT names (gathered everywhere: they are small): every one on global
        rank 0, on every rank (``OWN_GPU``), or each on the one rank that sends it (``SHARES``, balanced by
        bytes)."""
        from rlplacement.backends.megatron.lora import full_adapters
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
        """Bucket by bucket (:func:`.update_streams.iter_full_megatron`); once the stream ends,
        :attr:`last_stream_collectives` holds the collectives this rank issued in its TP and PP groups.
        Megatron shares an update out by its own parameters (:meth:`iter_update_tensors`), not by ``owners``."""
        if owners is not None:
            raise ValueError("megatron spreads an update by its own parameters: iter_update_tensors(share)")
        return self._iter_stream(RANK0)

    def _iter_stream(self, share: str, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Under LoRA (``merge``) each adapted weight with ``alpha / r * B A`` merged in (the adapters gathered
        everywhere first: :func:`.lora.full_adapters`)."""
        counter = CollectiveCount()
        merges = {}
        if self.lora is not None and merge:
            from rlplacement.backends.megatron.lora import full_adapters
            from rlplacement.lora_format import PEFT_PREFIX

            adapters = full_adapters(self.model)
            merges = {n.removeprefix(PEFT_PREFIX).replace(".lora_A.weight", ".weight"):
                      (t, adapters[n.replace(".lora_A.", ".lora_B.")]) for n, t in adapters.items() if ".lora_A." in n}
        for name, tensor in iter_hf_tensors(self.model, self.shape, self.family, counter=counter, share=share):
            if name in merges:
                from rlplacement.backends.lora import merged

                tensor = merged(tensor, *merges[name], self.lora.scaling)
            yield name, tensor if self.stream_dtype is None else tensor.to(self.stream_dtype)
        self.last_stream_collectives = counter.count
