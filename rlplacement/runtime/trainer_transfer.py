"""Trainer side of weight transfer inside a Ray actor: :class:`TrainerTransferMixin` is mixed into
the trainer worker (:mod:`rlplacement.runtime.trainer_worker`); the actor implements
``hf_named_tensors()`` (an iterator of full HF-named tensors, streamed; the backend may gather
lazily) and the driver (:mod:`rlplacement.runtime.transfer_driver`) calls the ``transfer_*`` methods.
Which options reach the sender is :func:`rlplacement.transfer.registry.sender_options`."""

from __future__ import annotations

import dataclasses

from typing import Iterable

from rlplacement.transfer import registry
from rlplacement.transfer.base import DEFAULT_TIMEOUT_S, HFShapes, NamedTensor, TransferError, UpdateReport
from rlplacement.transfer.spec import RANK0


class TrainerTransferMixin:
    transfer_sender = None
    update_share = RANK0
    """Who sends (``ModeSpec.who_sends``): what this rank's ``hf_named_tensors()`` yields of an update."""

    def hf_named_tensors(self) -> Iterable[NamedTensor]:
        raise NotImplementedError("the trainer actor must yield (hf_name, tensor) from hf_named_tensors()")

    def hf_tensors_resident(self) -> bool:
        """Whether ``hf_named_tensors()`` yields views of this process's own device parameters (no gather,
        cast or un-fusing), which stay put until an update returns: ``cuda_ipc`` then reads them in place."""
        return False

    def hf_update_shapes(self) -> HFShapes | None:
        """With resident tensors: those ``hf_named_tensors()`` yields in another shape than HF's (rows
        grouped as a fused parameter holds them), read in place by ``cuda_ipc``, reshaped by other modes."""
        return None

    def stream_collectives(self) -> int | None:
        """Collectives this rank issued in its TP/PP groups to stream the last update (None: not counted)."""
        return None

    def transfer_setup(self, mode: str, bucket_bytes: int, *, check_equal: bool = False,
                       timeout_s: float = DEFAULT_TIMEOUT_S, device: str | None = None, share: str = RANK0,
                       **mode_options) -> None:
        """``mode_options`` go to the mode's sender only (disk-delta: disk_dir, delta_encoding, base_dir,
        run_id, epoch). ``share``: who sends (``ModeSpec.who_sends``); where several ranks send, each is set
        up as a sender and ``hf_named_tensors()`` yields what this rank sends."""
        if self.transfer_sender is not None:
            self.transfer_sender.close()
        self.update_share = share
        self.transfer_sender = registry.sender_class(mode)(bucket_bytes, check_equal=check_equal,
                                                           timeout_s=timeout_s, device=device, **mode_options)

    def set_update_share(self, share: str) -> None:
        """A rank that sends nothing itself but takes part in an update's gathers (``gather_for_update``):
        what it streams depends on who sends (``ModeSpec.who_sends``)."""
        if self.transfer_sender is not None:
            self.transfer_sender.close()
            self.transfer_sender = None
        self.update_share = share

    def transfer_setup_from_config(self, transfer_config, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                                   device: str | None = None, base_dir: str | None = None, mode: str | None = None,
                                   check_equal: bool | None = None, run_id: str = "", epoch: int = 0,
                                   share: str = RANK0, sender_index: int | None = None) -> None:
        """Set up from ``rlplacement.config.TransferConfig``: the mode that runs (``cuda_ipc`` under
        --colocate) unless ``mode`` overrides it, with every option of that mode from the config
        (:func:`registry.sender_options`), so none is dropped on the way. ``base_dir``: the checkpoint the
        engines started from (disk-delta's version 0). ``run_id``/``epoch``: the run's identity and its
        resumes so far (disk-delta starts a new segment of its folder at each; "": a fresh run id).
        ``sender_index``: which of several senders this rank is (disk-delta: its own subfolder)."""
        mode = mode or transfer_config.mode
        check = transfer_config.check_equal if check_equal is None else check_equal
        self.transfer_setup(mode, transfer_config.bucket_bytes, check_equal=check, timeout_s=timeout_s, device=device,
                            share=share,
                            **registry.sender_options(transfer_config, mode, base_dir, run_id=run_id, epoch=epoch,
                                                     sender_index=sender_index))

    def transfer_listen(self, world_size: int, host: str | None = None) -> dict:
        if self.transfer_sender is None:
            raise TransferError("transfer_listen before transfer_setup(mode, bucket_bytes)")
        return self.transfer_sender.listen(world_size, host=host).to_dict()

    def transfer_connect(self) -> None:
        self.transfer_sender.connect()

    def transfer_send(self, version: int) -> UpdateReport:
        """One update of every tensor ``hf_named_tensors()`` yields."""
        if self.transfer_sender is None:
            raise TransferError("transfer_send before transfer_setup/listen/connect")
        tensors = iter(self.hf_named_tensors())
        try:
            report = self.transfer_sender.update(version, tensors, resident=self.hf_tensors_resident(),
                                                 hf_shapes=self.hf_update_shapes())
        except BaseException:
            # the other trainer ranks are inside the same per-tensor gathers (gather_for_update):
            # finish the stream with them, or they wait in a collective and the next step runs out of step
            for _ in tensors:
                pass
            raise
        collectives = self.stream_collectives()
        return report if collectives is None else dataclasses.replace(report, stream_collectives=collectives)

    def transfer_close(self) -> None:
        if self.transfer_sender is not None:
            self.transfer_sender.close()
            self.transfer_sender = None
