"""What a loop calls on :class:`~rlplacement.job.RLJob` to move weights: updates to every engine, the
transfer group they run over, and bringing engines back to the trainer's weights after a failure.

:class:`WeightUpdates` is mixed into ``RLJob`` (``job.lifecycle``) and owns the version bookkeeping the job
holds (``version``, ``issued``, ``stale``): a version number is never reused for a set of engines, and an
update is all or nothing per engine (``docs/transfer``'s failure rule).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlplacement.placement.layout import colocated_sender_ranks
from rlplacement.runtime.waits import get_all
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

if TYPE_CHECKING:
    from rlplacement.transfer.base import UpdateResult


class WeightUpdates:
    """The weight-update side of ``RLJob``; see the module docstring."""

    def prepare_update(self) -> None:
        """Colocated hand-off ahead of an update now (else :meth:`update_weights` does it)."""
        self._hand_off("before_update")

    def set_transfer(self, mode: str, *, check_equal: bool, bucket_bytes: int | None = None) -> None:
        """Rebuild the transfer group with another mode (benchmarks compare modes on one engine).

        Engines keep serving their current version; the next update continues the numbering.
        """
        t = self.config.transfer
        if bucket_bytes is not None:
            t = dataclasses.replace(t, bucket_bytes=bucket_bytes)
        self.transfer_mode = mode
        share, ranks = self.update_share, set(self.sender_ranks)
        if share == SHARES:
            from rlplacement.transfer.multi_sender import sender_bucket_size

            from rlplacement.job_start import trainer_sends_pieces_for

            pieces = trainer_sends_pieces_for(self.config, share)
            t = dataclasses.replace(t, bucket_bytes=sender_bucket_size(t.bucket_bytes, len(ranks), pieces=pieces))
        refs = {f"trainer rank {r}": self.trainers[r].transfer_setup_from_config.remote(
                    t, timeout_s=self.timeout_s, base_dir=self.hf_dir, mode=mode, check_equal=check_equal,
                    run_id=self.run_id, epoch=self.epoch, share=share,
                    sender_index=r if share == SHARES else None) if r in ranks
                else self.trainers[r].set_update_share.remote(share) for r in range(len(self.trainers))}
        get_all(list(refs.values()), self.timeout_s, "transfer set-up", list(refs))
        self._connect()
        self.check_equal = check_equal

    @property
    def update_share(self) -> str:
        """Who sends an update (``ModeSpec.who_sends`` for the mode that runs, in this layout); rank 0 alone
        for a trainer of one rank."""
        from rlplacement.transfer import registry

        if len(self.trainers) == 1:
            return RANK0
        return registry.spec(self.transfer_mode).who_sends(colocate=self.config.placement.colocate)

    @property
    def sender_ranks(self) -> list[int]:
        """The trainer ranks that send an update: every rank, in rank order, where each sends its share
        (:data:`SHARES`); under :data:`OWN_GPU` the rank on each engine worker's GPU, in worker order
        (``placement.layout.colocated_sender_ranks``); else rank 0 alone."""
        share = self.update_share
        if share == SHARES:
            return list(range(len(self.trainers)))
        if share == OWN_GPU:
            return colocated_sender_ranks(self.placement.layout)
        return [0]

    @property
    def senders(self) -> list:
        """The actors of :attr:`sender_ranks`, in that order."""
        return [self.trainers[r] for r in self.sender_ranks]

    def _connect(self) -> None:
        """Build the transfer groups between :attr:`senders` and every engine worker."""
        from rlplacement.runtime import transfer_driver as driver

        driver.connect(self.senders, self.engines, timeout_s=self.timeout_s,
                       per_worker=self.update_share == OWN_GPU)

    def update_weights(self, *, force: bool = False) -> "UpdateResult | None":
        """Send the trainer's current weights to every engine as a fresh version number (:attr:`issued` + 1).

        ``--update-weights-interval K``: an update goes only when the train calls so far are a multiple of
        K (:meth:`update_due`); otherwise nothing is sent and this returns None, the engines serving the
        version they have. ``force``: send whatever the interval says.

        All or nothing per engine (``docs/transfer``'s failure rule). A failed update raises
        :class:`~rlplacement.errors.WeightUpdateError` naming who failed; its number is burned and the job
        is :attr:`stale`: the next update or rollout rebuilds the transfer group and sends the trainer's
        weights again under a new number, so a loop that catches the error goes on. Under
        ``--use-fault-tolerance`` the job first restarts what died or hangs (engines; the trainer with
        ``--ft-components train``) and tries once more itself, under a fresh number; a second failure raises.
        """
        if not (force or self.update_due()):
            return None
        self._hand_off("before_update")
        if self.ft is not None:
            self.ft.check_engines()
        try:
            return self._update_once()
        except Exception as exc:
            if self.ft is None:
                raise
            self._repair(exc)
            return self._update_once()

    def update_due(self) -> bool:
        """Whether :meth:`update_weights` sends now: every call under ``--update-weights-interval 1``; under K,
        once every K train calls (:attr:`train_calls`, restored by a resume, is a multiple of K), as
        Miles counts its rollouts. Also whenever the engines hold no weights (a colocated sleep that
        discarded them): they would wake to nothing."""
        interval = self.config.async_rollout.update_weights_interval
        if interval == 1 or self.train_calls % interval == 0:
            return True
        handoff = self.handoff
        return handoff is not None and handoff.engines_hold == "nothing" and not handoff.keep_engine_weights

    def _update_once(self) -> "UpdateResult":
        if self.stale is not None:
            self._reconnect()
        version = self.issued = self.issued + 1
        ranks = self.sender_ranks
        helpers = {f"trainer rank {r}": t.gather_for_update.remote() for r, t in enumerate(self.trainers)
                   if r not in ranks}
        if self.check_equal and self.config.backend.lora.adapter_updates and not self._base_checked:
            from rlplacement.runtime.transfer_driver import check_base

            check_base(self.trainers, self.engines, version, self.timeout_s)
            self._base_checked = True
        try:
            result = self.updates.run([self.trainers[r] for r in ranks], self.engines, version,
                                      check_equal=self.check_equal, whole_each=self.update_share == OWN_GPU)
        except BaseException as exc:
            self.stale = f"the update to version {version} failed ({type(exc).__name__}: {exc})"
            _wait_quietly(list(helpers.values()), self.timeout_s)  # a sender drains its stream on failure
            raise
        get_all(list(helpers.values()), self.timeout_s, "trainer gathers", list(helpers))
        self.version, self.stale = version, None
        return result

    def _repair(self, error: BaseException) -> None:
        """Under ``--use-fault-tolerance``: restart what ``error`` says died (the trainer), or the engines that
        died or hang; an engine that failed and still answers takes the next update as it is."""
        if self.ft.trainer_died(error):
            self.ft.restart_trainer(str(error))
        else:
            self.ft.on_engine_failure(error)

    def reconcile(self) -> "UpdateResult | None":
        """After a failed update or a restart: bring every engine to the trainer's current weights now (a
        fresh version); None when every engine serves them already. Raises
        :class:`~rlplacement.errors.ReconcileError` when that cannot be done, naming the engines and why."""
        if self.stale is None:
            return None
        why = self.stale
        try:
            return self._update_once()
        except Exception as exc:  # noqa: BLE001 - one error that says both what happened and what is left
            from rlplacement.errors import ReconcileError

            raise ReconcileError(why, exc) from exc

    def served_versions(self) -> list[int]:
        """The version each engine serves, in engine order, as the engines report it (each engine's workers
        agree, or it raises naming the engine)."""
        return get_all([e.weight_version.remote() for e in self.engines], self.timeout_s, "served versions",
                       [f"engine {i}" for i in range(len(self.engines))])

    def _reconnect(self) -> None:
        """A new transfer group with the same senders: after a failure the old one is unusable, and each
        mode starts the next update from what every engine can take (disk-delta: a keyframe)."""
        self.updates.close()
        self._connect()


def _wait_quietly(refs: list, timeout_s: float) -> None:
    """Wait for ``refs`` within ``timeout_s``, whatever they end in (the error that matters is raised)."""
    import ray

    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
