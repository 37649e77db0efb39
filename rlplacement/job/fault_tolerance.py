"""The repairs a job makes by itself under ``--use-fault-tolerance`` (Miles' flags): a dead or hung engine is
killed, restarted in its own placement bundle and brought to the trainer's weights before it serves; with
``--ft-components train`` a dead trainer rank takes the whole trainer down and it is restarted from the last
``--save``, the engines kept and brought to the checkpoint's weights.

Invariants: an engine serves generation only once it holds the trainer's current weights (a restarted one
starts from the model folder, so the job sends it a fresh version before any rollout); version numbers are
never reused for a set of engines (``RLJob.issued``), so a restarted trainer's first update is numbered above
anything an engine has served, and the restart is a new epoch (``RLJob.epoch``); a repair that keeps failing
ends in one error after ``FaultToleranceConfig.max_restarts`` repairs of its kind within
``restart_window_s``, never a loop.

Health checks run between steps, never during a generate or an update: at most one per
``--rollout-health-check-interval`` seconds, none in the first ``--rollout-health-check-first-wait``
seconds. A check asks every engine which version it serves (a round trip through vLLM's engine core to every
worker); no answer within ``--rollout-health-check-timeout`` is a hung engine. Telemetry: ``ft/*`` keys
(:data:`KEYS`), through ``RLJob.pop_ft_metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from rlplacement.errors import EngineStuckError, PeerError, TransferError

if TYPE_CHECKING:
    from rlplacement.config import FaultToleranceConfig

log = logging.getLogger(__name__)

KEYS = ("ft/engine_restarts", "ft/trainer_restarts", "ft/recovery_time", "ft/steps_lost")
"""Per step: engines and trainers restarted, seconds spent repairing, optimizer calls the trainer lost to a
restart (trained since the checkpoint it restarted from)."""

DIED = "actor died"


class FaultToleranceExhausted(RuntimeError):
    """A repair was needed more often than ``FaultToleranceConfig.max_restarts`` allows."""


@dataclasses.dataclass(frozen=True)
class Recovery:
    """One repair: what was restarted, why, how long the repair took, and the trainer calls lost."""

    kind: str  # "engine" | "trainer"
    index: int | None
    why: str
    seconds: float
    steps_lost: int = 0
    at: float = dataclasses.field(default_factory=time.monotonic)
    """When the repair ended (``time.monotonic``)."""


def actor_died(failure: str) -> bool:
    """Whether a failure text from ``runtime.waits.cause_of`` says the actor's process is gone."""
    return failure.startswith(DIED) or "ActorDiedError" in failure or "RayActorError" in failure


class FaultTolerance:
    """A job's repairs; ``RLJob`` (``job``, not imported here: it imports this module) calls
    :meth:`check_engines` between steps and :meth:`on_engine_failure`, :meth:`restart_trainer` on failure."""

    def __init__(self, job, config: "FaultToleranceConfig"):
        self.job, self.config = job, config
        self.started_at = time.monotonic()
        self._last_check = float("-inf")
        self.recoveries: list[Recovery] = []
        """Every repair of the job's life, in order."""
        self._unreported: list[Recovery] = []
        self.restarts_begun: list[tuple[str, float]] = []
        """(kind, ``time.monotonic``) of every restart begun, whether its repair completed or not: what
        ``max_restarts`` counts, so a repair that keeps failing is bounded too."""

    # ---- telemetry -------------------------------------------------------------------------------
    def pop_metrics(self) -> dict[str, float]:
        """:data:`KEYS` for the repairs since the last call (zeros when there were none)."""
        done, self._unreported = self._unreported, []
        return {"ft/engine_restarts": sum(r.kind == "engine" for r in done),
                "ft/trainer_restarts": sum(r.kind == "trainer" for r in done),
                "ft/recovery_time": sum(r.seconds for r in done),
                "ft/steps_lost": sum(r.steps_lost for r in done)}

    def _record(self, recovery: Recovery) -> None:
        self.recoveries.append(recovery)
        self._unreported.append(recovery)
        who = recovery.kind if recovery.index is None else f"{recovery.kind} {recovery.index}"
        log.warning("fault tolerance: %s restarted in %.1f s (%s)", who, recovery.seconds, recovery.why)

    def _count(self, kind: str) -> int:
        """Restarts of ``kind`` begun within the last ``restart_window_s``."""
        since = time.monotonic() - self.config.restart_window_s
        return sum(k == kind and at >= since for k, at in self.restarts_begun)

    # ---- engines ---------------------------------------------------------------------------------
    def check_engines(self, *, force: bool = False) -> list[int]:
        """Between steps: probe every engine when a check is due (or ``force``), restart each that died,
        hung or is stuck, then bring every engine to the trainer's weights once; returns the restarted
        indices. An engine found stuck only by that reconciling update (it was inside the failed update
        when probed) is restarted too, and the update tried once more; a second failure raises
        :class:`~rlplacement.errors.ReconcileError`."""
        if not self.config.repairs("rollout"):
            return []
        now = time.monotonic()
        if not force and (now - self.started_at < self.config.health_check_first_wait_s
                          or now - self._last_check < self.config.health_check_interval_s):
            return []
        self._last_check = now
        bad = self.unhealthy_engines()
        if not bad:
            return []
        started = {index: self._replace_engine(index, why) for index, why in bad.items()}
        try:
            self.job.reconcile()
        except TransferError:
            more = self.unhealthy_engines()
            if not more:
                raise
            started.update({index: self._replace_engine(index, why) for index, why in more.items()})
            bad.update(more)
            self.job.reconcile()
        for index, why in bad.items():
            self._record(Recovery("engine", index, why, time.monotonic() - started[index]))
        return sorted(bad)

    def unhealthy_engines(self) -> dict[int, str]:
        """Engines that died, did not answer a health check within ``--rollout-health-check-timeout`` (the
        check is a control call, answered beside a running update: no answer means the process is stopped
        or gone) or say a call into them was abandoned and holds them (stuck), with why. An engine that
        answers with an error is alive: the job reconciles it."""
        import ray

        from rlplacement.runtime.waits import cause_of

        refs = {e.health.remote(): i for i, e in enumerate(self.job.engines)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.config.health_check_timeout_s)
        bad = {i: f"no answer to a health check within {self.config.health_check_timeout_s:g} s "
                  f"(--rollout-health-check-timeout)" for ref, i in refs.items() if ref not in ready}
        for ref in ready:
            try:
                health = ray.get(ref, timeout=0)
            except Exception as exc:  # noqa: BLE001 - each engine's cause is kept
                why = cause_of(exc)
                if actor_died(why):
                    bad[refs[ref]] = why
                else:
                    self.job.stale = self.job.stale or f"engine {refs[ref]} answered a health check with {why}"
                continue
            if health.get("stuck"):
                bad[refs[ref]] = (f"{EngineStuckError.__name__}: {health['stuck']} overran its bound and still "
                                  f"holds the engine")
        return dict(sorted(bad.items()))

    def _replace_engine(self, index: int, why: str) -> float:
        """Kill engine ``index`` (whatever state it is in) and start it again in its own bundle, from the
        model folder: the job is stale until the next reconcile. Returns when the restart began."""
        import ray

        from rlplacement.job_start import start_engine
        from rlplacement.runtime.waits import get_all

        if self._count("engine") >= self.config.max_restarts:
            raise FaultToleranceExhausted(
                f"engine {index} needs a restart ({why}), but {self.config.max_restarts} engine restarts were made "
                f"within {self.config.restart_window_s:g} s already: a fault that comes back at every restart is "
                f"not one to repair; look at the engines' logs")
        start = time.monotonic()
        self.restarts_begun.append(("engine", start))
        job = self.job
        job.updates.close()  # a compiled update graph runs loops on the actor that goes
        ray.kill(job.engines[index], no_restart=True)
        _remove_shm_segments(job, index)
        engine = start_engine(job.config, job.hf_dir, job.placement, index, engine_kind=job.engine_kind,
                              engine_args=job.engine_args)
        info = get_all([engine.info.remote()], job.start_timeout_s, "restarted engine start", [f"engine {index}"])[0]
        job.engines[index], job.engine_info[index] = engine, info  # in place: the hand-off holds these lists
        job.stale = f"engine {index} was restarted ({why}) and serves the model folder's weights"
        return start

    def on_engine_failure(self, error: BaseException) -> bool:
        """After a generate or an update failed: restart the engines that died or hung; True when any was
        restarted (the caller may try again), False when the engines are all alive (the error stands)."""
        if not self.config.repairs("rollout") or not isinstance(error, PeerError | TransferError):
            return False
        return bool(self.check_engines(force=True))

    # ---- trainer ---------------------------------------------------------------------------------
    def trainer_died(self, error: BaseException) -> bool:
        """Whether ``error`` says a trainer rank's process is gone (and ``train`` is repaired)."""
        if not self.config.repairs("train") or not isinstance(error, PeerError):
            return False
        return any(who.startswith("trainer") and actor_died(why) for who, why in error.failures.items())

    def restart_trainer(self, why: str) -> Recovery:
        """Kill every trainer rank, start them again in their bundles from the last checkpoint under
        ``--save`` (from ``--hf-checkpoint`` when none was published yet), rebuild the transfer group and send
        the engines the checkpoint's weights as a fresh version, in a new epoch. The engines are kept."""
        import ray

        from rlplacement.job_start import start_trainers

        if self._count("trainer") >= self.config.max_restarts:
            raise FaultToleranceExhausted(
                f"the trainer needs a restart ({why}), but {self.config.max_restarts} trainer restarts were made "
                f"within {self.config.restart_window_s:g} s already: look at the trainer's logs")
        start = time.monotonic()
        self.restarts_begun.append(("trainer", start))
        job = self.job
        job.updates.close()
        for trainer in job.trainers:
            ray.kill(trainer, no_restart=True)
        job.trainers[:] = start_trainers(job.placement)  # in place: the hand-off holds this list
        resumed = job.setup_trainers(load=_published(job.config.train.save))
        lost = job.train_calls - (resumed["train_calls"] if resumed else 0)
        job.train_calls = resumed["train_calls"] if resumed else 0
        job.epoch += 1
        job.set_transfer(job.transfer_mode, check_equal=job.check_equal)
        job.stale = f"the trainer was restarted ({why})"
        job.reconcile()
        recovery = Recovery("trainer", None, why, time.monotonic() - start, steps_lost=lost)
        self._record(recovery)
        return recovery


def _remove_shm_segments(job, index: int) -> None:
    """What killed engine ``index`` kept in ``/dev/shm`` (its ``info``'s ``shm_segments``), removed on its
    node by a task that takes no resources: a SIGKILL leaves them, and each restart would add more."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlplacement.engines import shm_segments
    from rlplacement.runtime.waits import get_all

    names = (job.engine_info[index] or {}).get("shm_segments") or []
    if not names:
        return
    remove = ray.remote(num_cpus=0)(shm_segments.remove)
    node = job.placement.engine_node(index)
    get_all([remove.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(names)],
            60.0, "removing a killed engine's shared memory", [f"engine {index}"])


def _published(save: str | None) -> str | None:
    """``save`` when a checkpoint has been published there, else None (the trainer starts from the model)."""
    from rlplacement.backends.megatron.checkpoint_layout import is_training_checkpoint

    return save if save and is_training_checkpoint(save) else None
