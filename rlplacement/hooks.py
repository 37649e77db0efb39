"""The small facade an RL loop calls: place, generate, train, update weights, close.

``RLJob.start(config, hf_dir)`` validates, places trainer ranks and engines on one Ray placement
group, builds the backend on every rank and joins rank 0 with every engine worker in the
transfer group. Then per step: :meth:`generate` (prompts spread over engines),
:meth:`log_probs` and :meth:`train` (the batch split over data-parallel ranks), and
:meth:`update_weights` (one version to every engine, all or nothing per engine). Under
``--colocate`` with ``--offload-train``/``--offload-rollout`` on a GPU, each of them first hands the
GPU to its side (``runtime.handoff``); ``prepare_*`` do that ahead, outside a loop's timed phases.

Nothing here is specific to the example loop; it only wires the layers together in one
direction: backend -> transfer -> engine.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Sequence

from rlplacement.args import Config
from rlplacement.errors import ConfigError
from rlplacement.runtime.waits import get_all

DEFAULT_ENGINE_KWARGS = {"dtype": "float32", "max_model_len": 256}


@dataclasses.dataclass
class RolloutSample:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    weight_version: int
    engine: int
    finished_at: float  # wall time this sample's last token was produced (the engine's per-request stats)
    first_token_at: float | None = None


def _check_transfer_mode(config: Config) -> str:
    from rlplacement.transfer import registry

    mode = config.transfer.effective_mode
    if mode not in registry.MODES:
        raise ConfigError(
            f"weight transfer {mode!r} (from --update-weight-transfer-mode"
            f"{' and --colocate' if config.transfer.colocate else ''}) is not available in this build: "
            f"use one of {', '.join(sorted(registry.MODES))}"
            f"{' in a split layout (drop --colocate)' if config.transfer.colocate else ''}.")
    return mode


@dataclasses.dataclass
class PendingRollout:
    """A rollout started by :meth:`RLJob.generate_async`; :meth:`RLJob.collect` returns its samples."""

    prompts: list[list[int]]
    refs: dict  # Ray ref -> (engine index, indices of its prompts)


class RLJob:
    def __init__(self, config: Config, placement, trainers: list, engines: list, hf_dir: str):
        self.config, self.placement, self.trainers, self.engines = config, placement, trainers, engines
        self.hf_dir = hf_dir  # what the engines started from: version 0, the base of the first delta
        self.version = 0
        self.check_equal = config.transfer.check_equal
        self.dp_ranks: list[int] = [0] * len(trainers)  # each trainer rank's share of a batch
        self.dp_size = 1
        self.timeout_s = 600.0  # every wait on an actor is bounded and names who did not answer
        self.trainer_names = [f"trainer rank {r}" for r in range(len(trainers))]
        self.handoff = None  # runtime.handoff.ColocatedHandOff under --colocate with --offload-* on a GPU
        self.compiled_update = False  # updates through a Ray Compiled Graph (runtime.update_graph)
        self._update_graph = None

    @classmethod
    def start(cls, config: Config, hf_dir: str, *, optim: dict[str, Any] | None = None,
              engine_kwargs: dict[str, Any] | None = None, backend_options: dict[str, Any] | None = None,
              timeout_s: float = 600.0, compiled_update: bool | None = None) -> "RLJob":
        """``compiled_update``: dispatch each update through a Ray Compiled Graph (~0.1 ms instead of
        ~2 ms of Ray per update, see ``runtime.update_graph``); None: where the trainer is on a GPU,
        the only place an update is short enough for that to show (compiling takes ~1 s, once)."""
        import ray

        from rlplacement.backends import preflight
        from rlplacement.engines.ray_engines import create_engine_actor
        from rlplacement.placement import ray_groups
        from rlplacement.runtime.trainer_worker import TrainerWorker

        mode = _check_transfer_mode(config)  # before any process starts
        backend_cfg = dataclasses.replace(config.backend, hf_checkpoint=config.backend.hf_checkpoint or hf_dir)
        preflight(backend_cfg)
        placement = ray_groups.place(config.placement)
        layout = placement.layout
        world = len(layout.trainer_gpus)
        worker_cls = ray.remote(TrainerWorker)
        trainers = [worker_cls.options(**placement.trainer_options(r)).remote(r, world) for r in range(world)]
        engines = [create_engine_actor(i, hf_dir, options=placement.engine_options(i),
                                       tensor_parallel_size=layout.gpus_per_engine,
                                       sleep_mode=config.placement.offload_rollout,
                                       **{**DEFAULT_ENGINE_KWARGS, **(engine_kwargs or {})})
                   for i in range(len(layout.engines))]
        job = cls(config, placement, trainers, engines, hf_dir)
        job.timeout_s = timeout_s
        try:
            addr, port = get_all([trainers[0].address.remote(timeout_s)], timeout_s, "trainer address", ["trainer rank 0"])[0]
            infos = get_all([t.setup.remote(addr, port, backend_cfg, optim or {}, backend_options) for t in trainers],
                            timeout_s, "trainer set-up", job.trainer_names)
            job.dp_ranks = [i["data_parallel_rank"] for i in infos]
            job.dp_size = infos[0]["data_parallel_size"]
            job.set_transfer(mode, check_equal=config.transfer.check_equal, timeout_s=timeout_s)
            job.handoff = job._make_handoff(infos[0]["device"])
            job.compiled_update = infos[0]["device"].startswith("cuda") if compiled_update is None else compiled_update
        except BaseException as exc:
            job.close()
            job._raise_with_offload_hint(exc)
            raise
        return job

    def _make_handoff(self, trainer_device: str):
        from rlplacement.runtime.handoff import ColocatedHandOff, skipped_reason

        p = self.config.placement
        reason = skipped_reason(p.offload_train, p.offload_rollout, trainer_device)
        if reason:
            print(reason, file=sys.stderr, flush=True)
            return None
        if not (p.offload_train or p.offload_rollout):
            return None
        return ColocatedHandOff(self.trainers, self.engines, offload_train=p.offload_train,
                                offload_rollout=p.offload_rollout, timeout_s=self.timeout_s,
                                trainer_names=self.trainer_names)

    def pop_handoff_metrics(self) -> dict[str, float]:
        """``perf/*`` keys of the colocated hand-offs since the last call (``runtime.handoff.KEYS``); {} without."""
        return self.handoff.pop_metrics() if self.handoff is not None else {}

    def _raise_with_offload_hint(self, exc: BaseException) -> None:
        """Out of GPU memory under --colocate with a hand-off turned off: say which flag frees it."""
        from rlplacement.runtime.handoff import GpuMemoryError, offload_hint

        hint = offload_hint(self.config.placement, str(exc))
        if hint:
            raise GpuMemoryError(f"{hint}\n(the error: {exc})") from exc

    # ---- rollout --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[list[int]], *, max_tokens: int | Sequence[int], temperature: float = 1.0,
                 seed: int = 0, stop_token_ids: list[int] | None = None,
                 exact_lengths: bool = False) -> list[RolloutSample]:
        """One sample per prompt (repeat a prompt for a group); prompts are dealt round-robin to engines.
        ``max_tokens``: one for all or one per prompt; ``exact_lengths``: completions exactly that long."""
        return self.collect(self.generate_async(prompts, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                stop_token_ids=stop_token_ids, exact_lengths=exact_lengths))

    def generate_async(self, prompts: Sequence[list[int]], *, max_tokens: int | Sequence[int],
                       temperature: float = 1.0, seed: int = 0, stop_token_ids: list[int] | None = None,
                       exact_lengths: bool = False) -> "PendingRollout":
        """Start generation and return at once (one-step-off: the trainer trains meanwhile).

        Each engine runs one call at a time, so an ``update_weights`` issued while this runs is
        applied after the batch, never inside it: every sample comes from one weight version.
        """
        self._hand_off("to_rollout")
        shares = [list(range(i, len(prompts), len(self.engines))) for i in range(len(self.engines))]
        lengths = list(max_tokens) if isinstance(max_tokens, Sequence) else [max_tokens] * len(prompts)
        refs = {e.generate.remote([prompts[j] for j in idx], max_tokens=[lengths[j] for j in idx],
                                  temperature=temperature, seed=seed + 100_003 * i, stop_token_ids=stop_token_ids,
                                  exact_lengths=exact_lengths): (i, idx)
                for i, (e, idx) in enumerate(zip(self.engines, shares)) if idx}
        return PendingRollout([list(p) for p in prompts], refs)

    def collect(self, pending: "PendingRollout") -> list[RolloutSample]:
        """The samples of a started rollout, waiting at most the job's timeout (naming late engines)."""
        import ray

        samples: list[RolloutSample | None] = [None] * len(pending.prompts)
        refs = dict(pending.refs)
        deadline = time.monotonic() + self.timeout_s
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = ", ".join(f"engine {i}" for i, _ in refs.values())
                raise TimeoutError(f"generation: {late} did not answer within {self.timeout_s:.0f}s")
            i, idx = refs.pop(done[0])
            seen = time.time()
            for j, out in zip(idx, ray.get(done[0], timeout=self.timeout_s)):
                # the engine stamps each request's own end; collected late (one-step-off), the driver's time would not
                samples[j] = RolloutSample(pending.prompts[j], out["token_ids"], out["logprobs"], out["finish_reason"],
                                           out["weight_version"], i, out.get("finished_at", seen),
                                           out.get("first_token_at"))
        return samples  # type: ignore[return-value]

    def engine_capacity(self) -> dict:
        """The smallest engine's ``kv_cache_tokens`` and ``max_num_seqs`` (what caps decoding concurrency)."""
        infos = get_all([e.info.remote() for e in self.engines], self.timeout_s, "engine info",
                        [f"engine {i}" for i in range(len(self.engines))])
        return {"kv_cache_tokens": min(i["kv_cache_tokens"] for i in infos),
                "max_num_seqs": min(i["max_num_seqs"] for i in infos)}

    # ---- training -------------------------------------------------------------------------------
    def _shards(self, batch: dict[str, list]) -> list[dict[str, list]]:
        """Each trainer rank's share: ranks of one tensor/pipeline-parallel group get the same one."""
        n = len(batch["advantages"])
        if n % self.dp_size:
            raise ConfigError(f"a batch of {n} samples does not split over {self.dp_size} data-parallel trainer "
                              f"ranks: use a multiple of {self.dp_size} samples per step")
        per = n // self.dp_size
        return [{k: v[r * per:(r + 1) * per] for k, v in batch.items()} for r in self.dp_ranks]

    def log_probs(self, batch: dict[str, list]) -> list[list[float]]:
        self._hand_off("to_train")
        parts = self._with_hint(get_all, [t.log_probs.remote(s) for t, s in zip(self.trainers, self._shards(batch))],
                                self.timeout_s, "trainer log-probs", self.trainer_names)
        first_of_share = {dp: part for dp, part in zip(self.dp_ranks, parts)}
        return [row for dp in range(self.dp_size) for row in first_of_share[dp]]

    def train(self, batch: dict[str, list]) -> list[dict]:
        """One optimizer step on ``batch`` (lists: input_ids [B][T], loss_mask [B][T], advantages [B])."""
        self._hand_off("to_train")
        return self._with_hint(get_all, [t.train_step.remote(s) for t, s in zip(self.trainers, self._shards(batch))],
                               self.timeout_s, "train step", self.trainer_names)

    def prepare_rollout(self) -> None:
        """Colocated hand-off to generation now (else the next ``generate`` does it): a loop that times
        its phases calls these first, so the hand-off is reported apart (``pop_handoff_metrics``)."""
        self._hand_off("to_rollout")

    def prepare_train(self) -> None:
        self._hand_off("to_train")

    def prepare_update(self) -> None:
        self._hand_off("before_update")

    def _hand_off(self, transition: str) -> None:
        if self.handoff is not None:
            self._with_hint(getattr(self.handoff, transition))

    def _with_hint(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised, with the flag to change when it is GPU memory
            self._raise_with_offload_hint(exc)
            raise

    # ---- weights --------------------------------------------------------------------------------
    def set_transfer(self, mode: str, *, check_equal: bool, buffer_size: int | None = None,
                     timeout_s: float = 600.0) -> None:
        """Rebuild the transfer group with another mode (benchmarks compare modes on one engine).

        Engines keep serving their current version; the next update continues the numbering.
        """
        from rlplacement.runtime import transfer_driver as driver

        t = self.config.transfer
        if buffer_size is not None:
            t = dataclasses.replace(t, buffer_size=buffer_size)
        get_all([self.trainers[0].transfer_setup_from_config.remote(t, timeout_s=timeout_s, base_dir=self.hf_dir,
                                                                     mode=mode, check_equal=check_equal)],
                timeout_s, "transfer set-up", ["trainer rank 0"])
        driver.connect(self.trainers[0], self.engines, timeout_s=timeout_s)
        self.check_equal = check_equal

    def update_weights(self, *, timeout_s: float = 600.0) -> dict:
        """Send the trainer's current weights to every engine as the next version."""
        from rlplacement.runtime import transfer_driver as driver

        version = self.version + 1
        self._hand_off("before_update")
        helpers = [t.gather_for_update.remote() for t in self.trainers[1:]]
        report = driver.run_update(self.trainers[0], self.engines, version, timeout_s=timeout_s,
                                   check_equal=self.check_equal, graph=self._graph_for_update(timeout_s))
        get_all(helpers, timeout_s, "trainer gathers", self.trainer_names[1:])
        self.version = version
        return report

    def _graph_for_update(self, timeout_s: float):
        """The compiled update graph of the current trainer and engines (built on first use, and again
        after it broke or an engine was replaced), or None for plain calls."""
        if not self.compiled_update:
            return None
        graph = self._update_graph
        if graph is None or not graph.serves(self.trainers[0], self.engines):
            from rlplacement.runtime.update_graph import CompiledUpdate

            if graph is not None:
                graph.close()
            self._update_graph = graph = None
            try:
                self._update_graph = graph = CompiledUpdate(self.trainers[0], self.engines, timeout_s=timeout_s)
            except Exception as exc:  # noqa: BLE001 - the same calls go plainly, ~2 ms slower per update
                self.compiled_update = False
                print(f"rlplacement: updates go through plain Ray calls: compiling the update graph failed "
                      f"({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        return graph

    def close(self) -> None:
        import ray

        graph, self._update_graph = self._update_graph, None
        if graph is not None:  # before its actors go: a graph's loops run on them
            graph.close()
        for actor in self.engines:
            try:
                ray.get(actor.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 - closing must not hide the error that led here
                pass
        for actor in self.trainers + self.engines:
            ray.kill(actor)
        self.placement.remove()
