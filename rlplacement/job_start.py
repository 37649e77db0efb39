"""Starting a job's processes and tearing them down: the wiring behind ``RLJob.start`` and ``RLJob.close``.

Order of start: flags checked and the backend's preflight (before any process starts), the placement
group, the trainer actors, the engine actors (of the engine kind chosen, ``engines.registry``), the
trainers' set-up and the engines' ``info`` (both bounded by the job's timeout), the colocated hand-off,
the update dispatch. Whatever fails, every actor started and the placement group are released, and a
GPU out-of-memory error under ``--colocate`` names the offload flag that would free the memory.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from rlplacement.errors import GpuMemoryError

if TYPE_CHECKING:
    from rlplacement.config import Config
    from rlplacement.console import StartLog
    from rlplacement.runtime.handoff import ColocatedHandOff
    from rlplacement.runtime.update_dispatch import UpdateDispatch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StartedActors:
    """What :func:`start_actors` started: the placement group, the trainer ranks and the engines."""

    placement: Any
    trainers: list
    engines: list
    trainer_names: list[str]
    backend_config: Any
    engine_args: dict[str, Any]
    """Every engine's arguments, resolved (dtype, the job's timeout): what a restarted engine gets again."""

    @property
    def engine_dtype(self) -> str:
        return self.engine_args["dtype"]


def start_actors(config: "Config", hf_dir: str, *, engine_kind: str,
                 engine_kwargs: dict[str, Any] | None, console: "StartLog",
                 timeout_s: float | None = None) -> StartedActors:
    """Check the flags, place the job and start every trainer rank and engine (returning at once: Ray
    starts them in the background). ``engine_kwargs``: over the keywords the rollout settings make for the
    engine kind (``EngineSpec.engine_kwargs``);
    ``console``: where each stage says it is done; ``timeout_s``: the job's bound, given to every engine
    as the bound of its own waits (None: the engine's default)."""
    import ray

    from rlplacement.args import require_available
    from rlplacement.backends import preflight
    from rlplacement.engines.engine_settings import resolve_dtype
    from rlplacement.engines.registry import engine_class, engine_spec
    from rlplacement.placement import ray_groups
    from rlplacement.runtime.trainer_worker import TrainerWorker

    require_available(config)  # before any process starts
    backend_cfg = dataclasses.replace(config.backend, hf_checkpoint=config.backend.hf_checkpoint or hf_dir)
    # without --hf-checkpoint the trainer starts from hf_dir, named as the caller passed it (not as a flag)
    preflight(config.backend, hf_dir, hf_dir_label="hf_dir (RLJob.start's argument)")
    if config.backend.load:  # its files whole and of this model, named if not, before any process starts
        from rlplacement.backends.checkpoint_files import check_load

        check_load(config.backend.load, backend_cfg.hf_checkpoint)
    engine_class(engine_kind)  # an unknown kind is refused before any process starts
    verbose = config.rollout.verbose
    # the rollout settings as the kind's own keywords (EngineSpec.engine_kwargs), the caller's over them
    engine_args = {**engine_spec(engine_kind).call("engine_kwargs", config.rollout), **(engine_kwargs or {})}
    engine_args["dtype"] = resolve_dtype(hf_dir, engine_args.get("dtype", "auto"))
    engine_args.setdefault("update_weight_staging", config.transfer.staging)
    engine_args.setdefault("update_weight_slices", config.transfer.slices)
    engine_args.setdefault("update_weight_mode", config.transfer.mode)
    engine_args.setdefault("update_weight_pieces", trainer_sends_pieces_for(config))
    engine_args.setdefault("update_weight_buffer_size", config.transfer.bucket_bytes)
    engine_args.setdefault("verbose", verbose)
    if config.backend.moe.rollout_routing_replay:
        engine_args["enable_return_routed_experts"] = True
    if config.backend.lora.adapter_updates:
        engine_args["live_lora"] = config.backend.lora.live_spec()
    if config.async_rollout.fully_async:  # updates land while requests run, in the mode asked
        engine_args["pause_generation_mode"] = config.async_rollout.pause_generation_mode
    if timeout_s is not None:
        engine_args.setdefault("timeout_s", float(timeout_s))
    p = config.placement
    console.say(f"starting Ray and placing {p.trainer_num_gpus} trainer GPU(s) and {p.num_engines} engine(s) of "
                f"{p.rollout_num_gpus_per_engine} GPU ({'colocated' if p.colocate else 'split'})")
    placement = ray_groups.place(config.placement, verbose=verbose)
    console.stage("Ray up, placement group placed")
    layout = placement.layout
    world = len(layout.trainer_gpus)
    worker_cls = ray.remote(TrainerWorker)
    trainers = [worker_cls.options(**placement.trainer_options(r)).remote(r, world) for r in range(world)]
    engines = [start_engine(config, hf_dir, placement, i, engine_kind=engine_kind, engine_args=engine_args)
               for i in range(len(layout.engines))]
    return StartedActors(placement, trainers, engines, [f"trainer rank {r}" for r in range(world)], backend_cfg,
                         engine_args)


def make_handoff(config: "Config", trainers: list, engines: list, trainer_device: str, timeout_s: float,
                 trainer_names: list[str]) -> "ColocatedHandOff | None":
    """The colocated hand-off the flags ask for, its host memory reserved; None where it does not run."""
    from rlplacement.runtime.handoff import ColocatedHandOff, skipped_reason

    p = config.placement
    reason = skipped_reason(p.offload_train, p.offload_rollout, trainer_device)
    if reason:
        log.warning(reason)
        return None
    if not p.colocate or (p.offload_train is False and p.offload_rollout is False):
        return None
    handoff = ColocatedHandOff(trainers, engines, offload_train=p.offload_train, offload_rollout=p.offload_rollout,
                               # adapter-only updates never resend the base: a sleeping engine must keep it
                               keep_engine_weights=p.offload_rollout_keep_weights or config.backend.lora.adapter_updates,
                               timeout_s=timeout_s,
                               trainer_names=trainer_names)
    handoff.reserve_host_memory()
    return handoff


def raise_with_offload_hint(config: "Config", exc: BaseException) -> None:
    """Out of GPU memory under --colocate with a hand-off turned off: say which flag frees it."""
    from rlplacement.runtime.handoff import offload_hint

    hint = offload_hint(config.placement, str(exc))
    if hint:
        raise GpuMemoryError(f"{hint}\n(the error: {exc})") from exc


def release(updates: "UpdateDispatch | None", trainers: list, engines: list, placement) -> None:
    """Tear down what a job started; never raises, so it cannot hide the error that led here. Each engine
    is shut down before it is killed (its ``shutdown`` ends vLLM's worker processes and unlinks their
    shared memory, which a kill alone leaves in /dev/shm), all at once and bounded."""
    import ray

    if updates is not None:  # before its actors go: a graph's loops run on them
        try:
            updates.close()
        except Exception as exc:  # noqa: BLE001 - a teardown past its bound: the kills below end its loops
            log.warning("closing the update dispatch: %s", exc)
    shutdowns = []
    for actor in engines:
        try:
            shutdowns.append(actor.shutdown.remote())
        except Exception:  # noqa: BLE001 - closing must not hide the error that led here
            pass
    if shutdowns:
        try:
            ray.wait(shutdowns, num_returns=len(shutdowns), timeout=60)
        except Exception:  # noqa: BLE001 - closing must not hide the error that led here
            pass
    for actor in trainers + engines:
        ray.kill(actor)
    placement.remove()


def trainer_sends_pieces_for(config: "Config", who: str | None = None) -> bool:
    """``transfer.pieces.trainer_sends_pieces`` for the job's flags; ``who``: who sends the mode that runs
    (default: ``--update-weight-transfer-mode``'s)."""
    from rlplacement.transfer import registry
    from rlplacement.transfer.pieces import trainer_sends_pieces

    if who is None:
        who = registry.spec(config.transfer.mode).who_sends(colocate=config.placement.colocate)
    return trainer_sends_pieces(config.backend.name, config.placement.trainer_num_gpus, who,
                                lora=config.backend.lora.enabled)


def start_engine(config: "Config", hf_dir: str, placement, index: int, *, engine_kind: str,
                 engine_args: dict[str, Any]):
    """Engine ``index`` in its own placement bundle with ``engine_args`` (:attr:`StartedActors.engine_args`):
    what :func:`start_actors` starts, and what a restarted engine is (``fault_tolerance``). Returns the
    actor at once (Ray starts it)."""
    from rlplacement.engines.ray_engines import create_engine_actor
    from rlplacement.engines.registry import engine_class

    return create_engine_actor(index, hf_dir, kind=engine_kind, options=placement.engine_options(index),
                               env=engine_class(engine_kind).process_env(config.rollout.verbose),
                               tensor_parallel_size=placement.layout.gpus_per_engine,
                               sleep_mode=config.placement.offload_rollout is not False, **engine_args)


def start_trainers(placement) -> list:
    """Every trainer rank again, each in its own placement bundle: what a restarted trainer is."""
    import ray

    from rlplacement.runtime.trainer_worker import TrainerWorker

    world = len(placement.layout.trainer_gpus)
    worker_cls = ray.remote(TrainerWorker)
    return [worker_cls.options(**placement.trainer_options(r)).remote(r, world) for r in range(world)]


def setup_trainers(trainers: list, backend_config, optim, train, backend_options: dict[str, Any], timeout_s: float,
                   trainer_names: list[str]) -> list[dict]:
    """Rank 0's rendezvous, then every rank joins it and builds its backend (collective); each rank's info:
    device, data-parallel rank and size, and ``resumed`` (a ``--load`` checkpoint's saved state, else None)."""
    from rlplacement.runtime.waits import get_all

    addr, port = get_all([trainers[0].address.remote(timeout_s)], timeout_s, "trainer address", trainer_names[:1])[0]
    return get_all([t.setup.remote(addr, port, backend_config, optim, train, backend_options, timeout_s)
                    for t in trainers], timeout_s, "trainer set-up", trainer_names)
