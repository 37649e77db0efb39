"""RLJob, the small facade an RL loop calls: place, generate, train, update weights, close; this module is
its lifecycle (start, the state every part reads, close), composed with one part per thing a caller does:
``rollout_calls``, ``train_calls``, ``weight_updates``.

``RLJob.start(config, hf_dir)`` validates, places trainer ranks and engines on one Ray placement
group, builds the backend on every rank and joins rank 0 with every engine worker in the transfer
group, and returns the job whole. Then per step: :meth:`RLJob.generate` (prompts spread over the
engines), :meth:`RLJob.log_probs` and :meth:`RLJob.train` (a :class:`~rlplacement.train_io.Batch` of
tensors, split over the data-parallel ranks), and :meth:`RLJob.update_weights` (one version to every
engine, all or nothing per engine; an :class:`~rlplacement.transfer.base.UpdateResult`). Under
``--colocate`` with ``--offload-train``/``--offload-rollout`` on a GPU, each of them first hands the
GPU to its side (``runtime.handoff``); ``prepare_*`` do that ahead, outside a loop's timed phases.

Every wait on an actor is bounded by the one ``timeout_s`` given to :meth:`RLJob.start` and names who
did not answer. Nothing here is specific to the example loop or to one engine: the engines are Ray
actors of a ``engines.base.RolloutEngine`` kind (``engines.registry``), called only through that
protocol. The job wires the layers together in one direction (backend -> transfer -> engine); how
rollouts are spread and streamed is ``rollout``, how processes start and stop is ``job_start``.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING, Any, Callable

from rlplacement.config import Config, OptimConfig
from rlplacement.engines.registry import DEFAULT_ENGINE_KIND, engine_class
from rlplacement.job.rollout_calls import RolloutCalls
from rlplacement.job.train_calls import TrainCalls
from rlplacement.job.weight_updates import WeightUpdates
from rlplacement.job_start import make_handoff, raise_with_offload_hint, release, setup_trainers, start_actors
from rlplacement.runtime.waits import get_all

if TYPE_CHECKING:
    from rlplacement.runtime.handoff import ColocatedHandOff
    from rlplacement.runtime.update_dispatch import UpdateDispatch

__all__ = ["DEFAULT_TIMEOUT_S", "RLJob"]

DEFAULT_TIMEOUT_S = 600.0


class RLJob(RolloutCalls, TrainCalls, WeightUpdates):
    """A running job: trainer ranks, engines and the transfer group between them. Build it with
    :meth:`start`; use it as a context manager (or call :meth:`close`) so its actors and placement
    group are released whatever happens."""

    def __init__(self, *, config: Config, placement, trainers: list, engines: list, hf_dir: str,
                 timeout_s: float, data_parallel_ranks: list[int], data_parallel_size: int,
                 handoff: "ColocatedHandOff | None", updates: "UpdateDispatch", engine_info: list[dict],
                 engine_kind: str = DEFAULT_ENGINE_KIND):
        self.config = config
        self.placement = placement
        """The Ray placement group and the layout it realises (``placement.ray_groups.Placement``)."""
        self.trainers = trainers
        self.engines = engines
        self.hf_dir = hf_dir
        """What the engines started from: version 0, the base of the first disk-delta."""
        self.timeout_s = timeout_s
        """Bound of every wait on an actor; set once, at start."""
        self.start_timeout_s = max(timeout_s, DEFAULT_TIMEOUT_S)
        """Bound of a process's start (a trainer's set-up, an engine loading the model): :meth:`start` sets it."""
        self.data_parallel_ranks = data_parallel_ranks
        """Each trainer rank's share of a batch (ranks of one TP/PP group share one)."""
        self.data_parallel_size = data_parallel_size
        self.handoff = handoff
        """The colocated memory hand-off, or None (split layouts, CPU trainers, offload flags off)."""
        self.updates = updates
        self.version = 0
        """The version of the last update every engine took: what they all serve unless :attr:`stale`."""
        self.issued = 0
        """The highest version number sent to the engines, failed ones included: numbers are never reused
        for a set of engines (a failed update's number is burned), so an engine that took a version before
        its neighbour failed never sees that number again with other bytes."""
        self.stale: str | None = None
        """Why some engine may not serve the trainer's current weights (a failed update), else None: the next
        :meth:`update_weights` or rollout first brings every engine to them (:meth:`reconcile`)."""
        self.epoch = 0
        """Starts of this run from a checkpoint (a ``--load`` resume or a trainer restart): versions go back
        only across epochs, to the checkpoint's, and a disk-delta folder starts a new segment at each."""
        self.run_id = uuid.uuid4().hex
        """This run's identity across resumes (a resumed run keeps its checkpoint's)."""
        self.resumed_extra_state: dict[str, Any] = {}
        """The ``extra_state`` the checkpoint this run resumed from recorded (the caller's own position, e.g.
        its prompt sampler's), {} for a fresh run."""
        self.checkpoint_extra_state: Callable[[], dict[str, Any]] | None = None
        """Set by the caller: what every save not given ``extra_state`` records as it (the saves
        :meth:`train` makes every ``--save-interval`` included)."""
        self.check_equal = config.transfer.check_equal
        self._base_checked = False  # adapter-only LoRA: the engines' base held against the trainer's once
        self.transfer_mode = config.transfer.mode
        """The mode updates run in (``set_transfer`` changes it)."""
        self.trainer_names = [f"trainer rank {r}" for r in range(len(trainers))]
        self.train_calls = 0
        """Train calls so far in this job (``--save-interval`` counts them)."""
        # --train-during-rollout: each chunk's calls on every rank, not yet waited for
        self._chunk_calls: list[list] = []
        self.engine_info = engine_info
        """Each engine's ``RolloutEngine.info()`` at start: dtype, context length, KV cache capacity."""
        self._generate_calls = 0
        self._closed = False
        self._tokenizer = None
        self.engine_kind = engine_kind
        self.engine_class = engine_class(engine_kind)
        """The engines' kind (``engines.registry``): what sampling keys they take."""
        self.engine_args: dict[str, Any] = {}
        """Every engine's arguments as :meth:`start` resolved them (a restarted engine gets them again)."""
        self.trainer_setup: tuple | None = None
        """(backend config, optimizer, backend options) the trainer was built with (a restarted one again)."""
        self.ft = None
        """The job's repairs (``fault_tolerance.FaultTolerance``) under ``--use-fault-tolerance``, else None."""
        if config.fault_tolerance.enabled:
            from rlplacement.job.fault_tolerance import FaultTolerance

            self.ft = FaultTolerance(self, config.fault_tolerance)

    @classmethod
    def start(cls, config: Config, hf_dir: str, *, optim: OptimConfig | None = None,
              engine_kwargs: dict[str, Any] | None = None, backend_options: dict[str, Any] | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S, compiled_update: bool | None = None,
              engine_kind: str | None = None, start_timeout_s: float | None = None) -> "RLJob":
        """Start every process of the job and return it ready for the first step.

        ``optim``: the trainer's optimizer (default ``config.optim``, from the flags); ``engine_kwargs``: engine
        arguments over those the rollout settings make for the engine kind (``EngineSpec.engine_kwargs``: the
        model's dtype and context, CUDA graphs, and the kind's own, e.g. vLLM's prefix caching); ``backend_options``: keyword arguments of the
        backend's ``from_config`` (``stream_dtype`` defaults to the engines' dtype, resolved here from the
        model's config: the trainer serves what the engines hold, whatever it trains in); ``timeout_s``:
        bound of every wait on an actor, for the job's life; ``compiled_update``: dispatch each update
        through a Ray Compiled Graph (~0.1 ms instead of ~2 ms of Ray per update,
        ``runtime.update_dispatch``), None: where the trainer is on a GPU, the only place an update is
        short enough for that to show; ``engine_kind``: the rollout engine kind (``specs.engine``), None: ``config.rollout.engine_kind``
        (``--rollout-name``);
        ``start_timeout_s``: bound of a process's start (a trainer's set-up, an engine loading the model,
        here and at a restart), None: the larger of ``timeout_s`` and :data:`DEFAULT_TIMEOUT_S`, since
        loading a model takes longer than a fast failure of an update should. With
        ``--load`` of a training checkpoint the engines are sent its weights before this returns, as the
        version it recorded.
        """
        from rlplacement.console import StartLog
        from rlplacement.runtime.update_dispatch import UpdateDispatch

        engine_kind = config.rollout.engine_kind if engine_kind is None else engine_kind
        console = StartLog(config.rollout.verbosity)
        started = start_actors(config, hf_dir, engine_kind=engine_kind, engine_kwargs=engine_kwargs, console=console,
                               timeout_s=timeout_s)
        trainers, engines, trainer_names = started.trainers, started.engines, started.trainer_names
        backend_options = {"stream_dtype": started.engine_dtype, **(backend_options or {})}
        start_timeout_s = max(timeout_s, DEFAULT_TIMEOUT_S) if start_timeout_s is None else start_timeout_s
        try:
            infos = setup_trainers(trainers, started.backend_config, optim or config.optim, config.train,
                                   backend_options, start_timeout_s, trainer_names)
            device = infos[0]["device"]
            console.stage(f"trainer built: {config.backend.name} on {len(trainers)} rank(s), {device}")
            engine_info = get_all([e.info.remote() for e in engines], start_timeout_s, "engine start",
                                  [f"engine {i}" for i in range(len(engines))])
            console.stage(f"{len(engines)} {engine_kind} engine(s) loaded (they started beside the trainer)")
            job = cls(engine_info=engine_info, engine_kind=engine_kind, config=config, placement=started.placement, trainers=trainers,
                      engines=engines, hf_dir=hf_dir, timeout_s=timeout_s,
                      data_parallel_ranks=[i["data_parallel_rank"] for i in infos],
                      data_parallel_size=infos[0]["data_parallel_size"],
                      handoff=make_handoff(config, trainers, engines, device, timeout_s, trainer_names),
                      updates=UpdateDispatch(compiled=device.startswith("cuda") if compiled_update is None
                                             else compiled_update, timeout_s=timeout_s))
            job.trainer_setup = (started.backend_config, optim or config.optim, backend_options)
            job.engine_args, job.start_timeout_s = started.engine_args, start_timeout_s
            resumed = infos[0]["resumed"]
            if resumed is not None:  # before the transfer set-up: disk-delta's folder segment is (run, epoch)
                job.version = job.issued = resumed["weight_version"] - 1
                job.train_calls = resumed["train_calls"]
                saved = resumed.get("job_state") or {}  # {}: a checkpoint older than job states
                job._generate_calls = saved.get("generate_calls", 0)  # rollout seeds go on where the run stopped
                job.run_id = saved.get("run_id", job.run_id)
                job.epoch = saved.get("epoch", 0) + 1  # a resume is a new epoch of versions
                job.resumed_extra_state = dict(saved.get("extra_state") or {})
            job.set_transfer(config.transfer.mode, check_equal=config.transfer.check_equal)
            console.stage(f"weight transfer ready: {config.transfer.mode}"
                          + (", every update checked bit for bit" if config.transfer.check_equal else ""))
            if resumed is not None:  # the engines serve the checkpoint's weights, as the version it recorded
                job.update_weights(force=True)
                console.stage(f"engines serve the checkpoint's weights (version {job.version})")
            elif config.backend.lora.adapter_path:  # the engines start from the base alone: the adapters go now
                job.update_weights(force=True)
                console.stage(f"engines serve the adapters of --lora-adapter-path (version {job.version})")
            console.done("ready")
        except BaseException as exc:
            release(None, trainers, engines, started.placement)
            raise_with_offload_hint(config, exc)
            raise
        return job

    def __enter__(self) -> "RLJob":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def pop_handoff_metrics(self) -> dict[str, float]:
        """``perf/*`` keys of the colocated hand-offs since the last call (``runtime.handoff.KEYS``); {} without."""
        return self.handoff.pop_metrics() if self.handoff is not None else {}

    def _hand_off(self, transition: str) -> None:
        if self.handoff is not None:
            self._with_hint(getattr(self.handoff, transition))

    def _with_hint(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised, with the flag to change when it is GPU memory
            raise_with_offload_hint(self.config, exc)
            raise

    def setup_trainers(self, *, load: str | None) -> dict | None:
        """Build the backend on every (new) trainer rank from ``load`` (a ``--save`` folder, or None: the model
        folder); returns the checkpoint's saved state, else None. What a restarted trainer runs."""
        backend_config, optim, backend_options = self.trainer_setup
        backend_config = dataclasses.replace(backend_config, load=load)
        infos = setup_trainers(self.trainers, backend_config, optim, self.config.train, backend_options,
                               self.start_timeout_s, self.trainer_names)
        self.data_parallel_ranks = [i["data_parallel_rank"] for i in infos]
        return infos[0]["resumed"]

    def pop_ft_metrics(self) -> dict[str, float]:
        """``ft/*`` keys of the repairs since the last call (``fault_tolerance.KEYS``); {} without
        ``--use-fault-tolerance``."""
        return self.ft.pop_metrics() if self.ft is not None else {}

    def close(self) -> None:
        """Release the update graph, every actor and the placement group; a second call does nothing."""
        if not self._closed:
            self._closed = True
            release(self.updates, self.trainers, self.engines, self.placement)
