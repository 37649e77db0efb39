"""One trainer rank as a Ray actor: a backend plus, on rank 0, the weight sender.

Every public method is collective across the trainer's ranks (the backend's contract), so the
driver calls each method on all ranks at once. During an update rank 0 streams the backend's
HF-named tensors into the transfer sender while the other ranks only take part in the gathers
(:meth:`gather_for_update`). Methods return wall-clock ``(start, end)`` stamps so the driver's
telemetry records the trainer's own busy time, not the driver's wait.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

from rlplacement.runtime.one_at_a_time import one_call_at_a_time
from rlplacement.runtime.trainer_transfer import TrainerTransferMixin

if TYPE_CHECKING:
    import torch

    from rlplacement.config import BackendConfig, OptimConfig, TrainConfig
    from rlplacement.train_io import Batch, TrainStepReport


@one_call_at_a_time  # a compiled update graph calls transfer_send from another thread
class TrainerWorker(TrainerTransferMixin):
    def __init__(self, rank: int, world_size: int):
        from rlplacement.backends.quiet import quiet_trainer_notices

        quiet_trainer_notices()  # before megatron or TransformerEngine is imported here
        self.rank, self.world_size = rank, world_size
        self.backend = None
        self._store = None  # rank 0: the trainer's rendezvous, bound in ``address``
        self._update_fault: tuple[int, str, float] | None = None  # ``inject_update_fault``'s, for the next update

    def address(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """Where rank 0 serves the trainer's rendezvous (called on rank 0 only).

        Rank 0 binds the store here and keeps it, so no other process can take the port between
        this call and ``setup`` (a port merely found free was taken by an engine once in CI); it
        listens on the job's interface only (``rendezvous.job_host``: loopback on one machine).
        """
        from rlplacement.rendezvous import host_store, job_host

        host = job_host()
        self._store, port = host_store(host, self.world_size, timeout_s)
        return host, port

    def setup(self, master_addr: str, master_port: int, backend_cfg: BackendConfig, optim: OptimConfig,
              train: TrainConfig, backend_options: dict[str, Any] | None = None, timeout_s: float = 600.0) -> dict:
        """Join the trainer's default process group and build the backend (collective); ``resumed`` is the
        saved state of a ``--load`` checkpoint (its ``weight_version``, ``train_calls`` and ``job_state``, {}
        for a checkpoint that recorded none), else None. The checkpoint's files and model are checked before
        it is read (``train_checkpoint.verified``)."""
        import torch

        from rlplacement.backends.base import make_backend
        from rlplacement.backends.launch import init_distributed
        from rlplacement.rendezvous import join_store

        torch.manual_seed(0)
        store = (self._store if self.rank == 0 else
                 join_store(master_addr, master_port, self.world_size, timeout_s=timeout_s))
        init_distributed(self.rank, self.world_size, store=store)
        options = dict(backend_options or {})
        if isinstance(options.get("stream_dtype"), str):  # a dtype's name, as an engine argument spells it;
            dtype = getattr(torch, options["stream_dtype"], None)  # vLLM's "auto": the trained dtype
            options["stream_dtype"] = dtype if isinstance(dtype, torch.dtype) else None
        self.backend = make_backend(backend_cfg, optim, train, **options)
        return {"rank": self.rank, "device": str(self.backend.device),
                "data_parallel_rank": self.backend.data_parallel_rank,
                "data_parallel_size": self.backend.data_parallel_size, "resumed": self.backend.resumed}

    def log_probs(self, batch: Batch) -> "torch.Tensor":
        """``[B, T]`` float32 log-probs of this rank's share, on the host."""
        self._require_resident("log-probs")
        return self.backend.log_probs(batch).cpu()

    def train_step(self, batch: Batch) -> TrainStepReport:
        from rlplacement.train_io import TrainStepReport

        self._require_resident("a train step")
        start = time.time()
        metrics = self.backend.train_step(batch)
        return TrainStepReport(rank=self.rank, start=start, end=time.time(), **metrics)

    def train_chunk(self, batch: Batch) -> tuple[float, float]:
        """``--train-during-rollout``: forward and backward of this rank's share of one chunk of finished groups,
        gradients held for :meth:`finish_chunked_step`; returns its (start, end) wall-clock times."""
        self._require_resident("a chunk of --train-during-rollout")
        start = time.time()
        self.backend.train_chunk(batch)
        return start, time.time()

    def finish_chunked_step(self) -> TrainStepReport:
        """The one optimizer step of the chunks trained since the last (``backends.chunked_step``)."""
        from rlplacement.train_io import TrainStepReport

        self._require_resident("the step of --train-during-rollout")
        start = time.time()
        metrics = self.backend.finish_chunked_step()
        return TrainStepReport(rank=self.rank, start=start, end=time.time(), **metrics)

    def save_checkpoint(self, root: str, weight_version: int, job_state: dict[str, Any] | None = None) -> str:
        """Collective: the whole training state under ``root`` (``--save``) and the driver's ``job_state`` (a
        small JSON-able dict, back in ``setup``'s ``resumed["job_state"]``); returns the published folder."""
        self._require_resident("saving a checkpoint")
        self.backend.refuse_while_chunks_open("saving a checkpoint",
                                              "does not save them, so a resumed run would lose them")
        return self.backend.save_checkpoint(root, weight_version, job_state)

    # ---- memory hand-off (--offload-train) --------------------------------------------------
    def offload_to_host(self, engines_unmapped: bool = False) -> dict:
        """Before rollout: weights and optimizer state to pinned host memory, gradients dropped.
        ``engines_unmapped``: every engine has let go of this trainer's memory (``unmap_trainer_memory``);
        while cuda_ipc may still have it mapped there, offloading (which frees it) is refused."""
        self.backend.refuse_while_chunks_open("offloading to host (a colocated hand-off)", "drops them")
        started_at = time.time()
        sender = self.transfer_sender
        if sender is not None and sender.mapped_elsewhere:
            if not engines_unmapped:
                raise RuntimeError(f"trainer rank {self.rank}: engines may still map this trainer's weights (cuda_ipc "
                                   "keeps them mapped between updates), and offloading frees them: call every "
                                   "engine's unmap_trainer_memory() first, then offload_to_host(engines_unmapped=True)")
            sender.receivers_unmapped()
        report = self.backend.offload_to_host()
        read_at = time.perf_counter()
        report = {**report, **gpu_memory(), "reading_seconds": time.perf_counter() - read_at}
        return {**report, "started_at": started_at, "finished_at": time.time()}  # where a slow hand-off spends it

    def reserve_host_memory(self) -> dict:
        """At the job's start (a colocated hand-off that may offload the trainer): the pinned host buffer
        for the whole state, made now so no step pays for it (``perf/handoff_setup_time``)."""
        return self.backend.reserve_host_memory()

    def transfer_setup(self, *args, **kwargs) -> None:
        super().transfer_setup(*args, **kwargs)
        # cuda_ipc on a GPU: engines keep our weights mapped between updates (offload_to_host guards)
        self.transfer_sender.keep_mapped_between_updates()

    def reload_from_host(self) -> dict:
        """Before training or an update: everything offloaded comes back, bit-exact."""
        return {**self.backend.reload_from_host(), **gpu_memory()}

    def gpu_memory(self, empty_cache: bool = False, reset_peak: bool = True) -> dict:
        """:func:`gpu_memory`; ``empty_cache``: the caching allocator's unused blocks go back to the driver
        first, so ``device_free_gb`` is what a colocated engine could take now."""
        if empty_cache:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return gpu_memory(reset_peak)

    def _require_resident(self, what: str) -> None:
        """Offloaded storages have size 0: reading them fails deep in CUDA ("invalid argument") or,
        worse, reads nothing. Refuse first, saying how a caller outside the job's phases gets them back."""
        if self.backend.offloaded_to_host:
            raise RuntimeError(f"trainer rank {self.rank}: {what} needs the trainer's weights, which are in host "
                               "memory (--offload-train, after a colocated hand-off to rollout): call "
                               "RLJob.prepare_update() or prepare_train() first")

    def hf_named_tensors(self) -> Iterable:
        # checked inside the stream: the sender turns a refusal there into an abort every engine sees
        def stream():
            self._require_resident("a weight update")
            yield from self.backend.iter_update_tensors(self.update_share)

        fault, self._update_fault = self._update_fault, None
        return stream() if fault is None else FaultyStream(stream(), *fault)

    def inject_update_fault(self, after_tensors: int = 1, message: str = "injected weight-source fault",
                            stall_s: float = 0.0) -> None:
        """Fault injection (tests and ``benchmarks/chaos_soak.py``): the next update's weight source fails after
        ``after_tensors`` tensors, as a failed gather would, or with ``stall_s`` pauses there that long and goes
        on (a slow gather: the moment an engine can be killed mid-update). The stream itself goes on
        underneath a failure, so the other trainer ranks' collectives finish."""
        self._update_fault = (int(after_tensors), str(message), float(stall_s))

    def stream_collectives(self) -> int | None:
        return self.backend.last_stream_collectives

    def hf_tensors_resident(self) -> bool:
        return bool(self.backend.yields_resident_tensors)

    def hf_update_shapes(self):
        return self.backend.update_hf_shapes  # None unless its tensors are resident

    def update_shares(self) -> list[tuple[str, int, int]]:
        """``(hf_name, bytes, sending rank)`` of every tensor an update sends when every rank sends
        (``TrainerBackend.update_shares``)."""
        return self.backend.update_shares()

    def gather_for_update(self) -> int:
        """Ranks other than 0: take part in the collective gathers of an update; returns tensors seen."""
        self._require_resident("a weight update")
        return sum(1 for _ in self.backend.iter_update_tensors(self.update_share))

    def hf_checksums(self, keys: "list[str] | None" = None) -> dict[str, str]:
        """Per-tensor checksums of the weights as the trainer holds them (collective). ``keys``: the checksums
        an engine holds (``received_checksums``), where a worker's slice is ``name[box]``
        (``transfer.shards.region_key``) and a sender's piece its piece name (``transfer.pieces``): those
        slices' checksums instead of the whole tensors'."""
        from rlplacement.transfer import shards
        from rlplacement.transfer.base import tensor_checksum

        self._require_resident("checksums")
        if keys is None:
            return {name: tensor_checksum(t) for name, t in self.backend.iter_hf_tensors()}
        from rlplacement.transfer.pieces import is_piece, piece_boxes

        wanted: dict[str, list] = {}
        for key in keys:
            name, box = shards.parse_region_key(key)
            if is_piece(name):  # a trainer rank's piece (transfer.pieces), or a worker's part of one
                name, box, _ = piece_boxes(name, box)
            wanted.setdefault(name, []).append((key, box))
        return {key: tensor_checksum(shards.cut(t, box)) for name, t in self.backend.iter_hf_tensors()
                for key, box in wanted.get(name, [])}

    def base_checksums(self) -> dict[str, tuple[str, str]]:
        """Under LoRA: ``name -> (checksum, dtype)`` of the frozen base as rank 0 gathers it (collective; the
        other ranks return {}); the engines' checkpoint is held against it once (``--check-weight-update-equal``
        with adapter-only updates)."""
        from rlplacement.transfer.base import tensor_checksum

        self._require_resident("checksums")
        return {name: (tensor_checksum(t), str(t.dtype).removeprefix("torch."))
                for name, t in self.backend.iter_base_tensors()}

    def save_hf_folder(self, out_dir: str, like_dir: str) -> str | None:
        """Write the current weights as a Hugging Face folder (collective; rank 0 writes), with the
        config and tokenizer files of ``like_dir``: a fresh engine started from it must behave
        exactly like an engine that received the same weights by transfer."""
        from pathlib import Path

        from safetensors.torch import save_file

        from rlplacement.hf_folder import SINGLE_NAME, copy_side_files

        self._require_resident("saving a folder")
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.backend.iter_hf_tensors()}
        if self.rank != 0:
            return None
        out = Path(out_dir)
        copy_side_files(like_dir, out)
        save_file(tensors, str(out / SINGLE_NAME), metadata={"format": "pt"})
        return str(out)

    def close(self) -> None:
        self.transfer_close()
        if self.backend is not None:
            self.backend.close()


def gpu_memory(reset_peak: bool = True) -> dict[str, float]:
    """GiB on this process's GPU: ``resident_gb`` (torch's reserved bytes now), ``peak_gb`` (the most
    since the last reset, then reset unless ``reset_peak`` is False: a reading that decides, not reports), ``device_used_gb`` (the whole device, every process on it: under
    --colocate, trainer and engines together), ``device_free_gb`` and ``device_total_gb``. Empty
    without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}
    gib = float(1 << 30)
    free, total = torch.cuda.mem_get_info()
    out = {"resident_gb": torch.cuda.memory_reserved() / gib, "peak_gb": torch.cuda.max_memory_reserved() / gib,
           "device_used_gb": (total - free) / gib, "device_free_gb": free / gib, "device_total_gb": total / gib}
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    return out


class FaultyStream:
    """An iterator over ``inner`` that, in place of item ``after``, raises ``RuntimeError(message)`` once (or,
    with ``stall_s``, sleeps that long once); iterating again goes on with the rest of ``inner`` (what a
    sender's drain after a failure does)."""

    def __init__(self, inner: Iterable, after: int, message: str, stall_s: float = 0.0):
        self.inner, self.after, self.message, self.stall_s, self.seen = iter(inner), after, message, stall_s, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.seen == self.after:
            self.seen += 1
            if self.stall_s <= 0:
                raise RuntimeError(self.message)
            time.sleep(self.stall_s)
        self.seen += 1
        return next(self.inner)
