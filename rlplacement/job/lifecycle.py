"""RLJob, the small facade an RL loop calls: place, generate, train, update weights, close.

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
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from rlplacement.job import rollout
from rlplacement.config import Config, OptimConfig
from rlplacement.engines.registry import DEFAULT_ENGINE_KIND, engine_class
from rlplacement.errors import ConfigError
from rlplacement.job_start import make_handoff, raise_with_offload_hint, release, setup_trainers, start_actors
from rlplacement.placement.layout import colocated_sender_ranks
from rlplacement.job.rollout import PendingRollout, RolloutSample
from rlplacement.runtime.waits import get_all
from rlplacement.transfer.spec import OWN_GPU, RANK0, SHARES

if TYPE_CHECKING:
    import torch

    from rlplacement.runtime.handoff import ColocatedHandOff
    from rlplacement.runtime.update_dispatch import UpdateDispatch
    from rlplacement.train_io import Batch, TrainStepReport
    from rlplacement.transfer.base import UpdateResult

__all__ = ["DEFAULT_TIMEOUT_S", "PendingRollout", "RLJob", "RolloutSample"]

DEFAULT_TIMEOUT_S = 600.0


class RLJob:
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
              engine_kind: str = DEFAULT_ENGINE_KIND, start_timeout_s: float | None = None) -> "RLJob":
        """Start every process of the job and return it ready for the first step.

        ``optim``: the trainer's optimizer (default ``config.optim``, from the flags); ``engine_kwargs``: engine
        arguments over ``config.rollout.engine_kwargs()`` (the model's dtype and context, CUDA graphs, and
        the engine kind's own, e.g. vLLM's prefix caching); ``backend_options``: keyword arguments of the
        backend's ``from_config`` (``stream_dtype`` defaults to the engines' dtype, resolved here from the
        model's config: the trainer serves what the engines hold, whatever it trains in); ``timeout_s``:
        bound of every wait on an actor, for the job's life; ``compiled_update``: dispatch each update
        through a Ray Compiled Graph (~0.1 ms instead of ~2 ms of Ray per update,
        ``runtime.update_dispatch``), None: where the trainer is on a GPU, the only place an update is
        short enough for that to show; ``engine_kind``: the rollout engine (``engines.registry``);
        ``start_timeout_s``: bound of a process's start (a trainer's set-up, an engine loading the model,
        here and at a restart), None: the larger of ``timeout_s`` and :data:`DEFAULT_TIMEOUT_S`, since
        loading a model takes longer than a fast failure of an update should. With
        ``--load`` of a training checkpoint the engines are sent its weights before this returns, as the
        version it recorded.
        """
        from rlplacement.console import StartLog
        from rlplacement.runtime.update_dispatch import UpdateDispatch

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
                job.update_weights()
                console.stage(f"engines serve the checkpoint's weights (version {job.version})")
            elif config.backend.lora.adapter_path:  # the engines start from the base alone: the adapters go now
                job.update_weights()
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

    # ---- rollout --------------------------------------------------------------------------------
    def sampling_defaults(self) -> dict[str, Any]:
        """The sampling keys every generate starts from: the ``--rollout-*`` flags."""
        return rollout.sampling_defaults(self.config)

    def generate(self, prompts: Sequence[Sequence[int] | str], sampling: dict[str, Any] | None = None, *,
                 n_samples_per_prompt: int | None = None, max_tokens: int | Sequence[int] | None = None,
                 seed: int | None = None, exact_lengths: bool = False,
                 include_aborted: bool = False) -> list[RolloutSample]:
        """The samples of :meth:`generate_async`'s arguments, in index order, once all have finished. Under
        ``--use-fault-tolerance`` an engine that dies or hangs meanwhile is restarted and the call runs again
        with the same seeds (so the same samples)."""
        calls = self._generate_calls
        for attempt in (0, 1):
            self._generate_calls = calls  # a repeat draws the same seeds
            try:
                return self.collect(self.generate_async(prompts, sampling, n_samples_per_prompt=n_samples_per_prompt,
                                                        max_tokens=max_tokens, seed=seed,
                                                        exact_lengths=exact_lengths),
                                    include_aborted=include_aborted)
            except Exception as exc:
                if attempt or self.ft is None or not self.ft.on_engine_failure(exc):
                    raise
        raise AssertionError("unreachable")

    def _tokenize(self, text: str) -> list[int]:
        """Text prompts through the model's own tokenizer (loaded from the engines' folder on first use)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.hf_dir)
        return self._tokenizer.encode(text)

    def generate_async(self, prompts: Sequence[Sequence[int] | str], sampling: dict[str, Any] | None = None, *,
                       n_samples_per_prompt: int | None = None, max_tokens: int | Sequence[int] | None = None,
                       seed: int | None = None, exact_lengths: bool = False) -> PendingRollout:
        """Start ``n_samples_per_prompt`` (default ``--n-samples-per-prompt``) samples of every prompt and
        return at once (one-step-off: the trainer trains meanwhile).

        ``prompts``: token ids (lists of ints) or text (tokenized with the model's tokenizer; the samples'
        ``prompt_ids`` hold the ids); ``sampling``: sampling keys over :meth:`sampling_defaults`
        (``engines.base.SAMPLING_KEYS``, or the engine's own, e.g. any ``vllm.SamplingParams`` keyword; any
        other key is refused naming the nearest one); ``max_tokens``: one for all or one per
        sample (overrides ``sampling``'s); ``seed``: sample j samples with ``seed + j`` (default:
        ``--rollout-seed`` plus 1,000,003 per generate call of this job, so steps differ and a rerun
        repeats them); ``exact_lengths``: every sample exactly ``max_tokens`` long. The samples of a prompt
        go to one engine as separate requests (its prefix cache shares their prompt, each stops at its own
        length); prompts are balanced over engines by tokens (``runtime.rollout_shares``). A request that
        cannot fit the engines' context is refused first.

        An engine applies an ``update_weights`` issued meanwhile only once its requests have finished:
        every sample comes from one weight version.
        """
        rollout.check_sampling_keys(sampling, self.engine_class.sampling_keys)
        prompts = rollout.prompt_ids(prompts, self._tokenize)
        if self.ft is not None:
            self.ft.check_engines()
        request = rollout.rollout_request(self.config, prompts, sampling, n_samples_per_prompt=n_samples_per_prompt,
                                          max_tokens=max_tokens, seed=seed, exact_lengths=exact_lengths,
                                          call_index=self._generate_calls,
                                          context=min(info["max_model_len"] for info in self.engine_info))
        self._generate_calls += 1
        self.reconcile()  # a rollout never runs on weights a failed update left behind
        self._hand_off("to_rollout")
        return self._with_hint(rollout.submit, self.engines, request, self.timeout_s)

    def stream(self, pending: PendingRollout) -> Iterator[RolloutSample]:
        """Yield ``pending``'s samples as each finishes (any order; ``RolloutSample.index`` says which),
        waiting at most the job's timeout for the next (naming the engines that did not answer)."""
        return rollout.stream(self.engines, pending, self.timeout_s)

    def collect(self, pending: PendingRollout, *, include_aborted: bool = False) -> list[RolloutSample]:
        """Every sample of ``pending`` in index order once all have ended; samples an :meth:`abort` cut
        short are left out unless ``include_aborted``."""
        for _ in self.stream(pending):
            pass
        return [s for s in pending.samples if s is not None and (include_aborted or not s.aborted)]

    def abort(self, pending: PendingRollout | None = None) -> list[RolloutSample]:
        """End ``pending``'s requests still generating (every rollout's: None, e.g. before shutting down);
        returns ``pending``'s partial samples, marked ``aborted``. The engines stay ready for the next
        generate, serving the same version."""
        return rollout.abort(self.engines, pending, self.timeout_s)

    def fully_async(self, prompts, **options):
        """Continuous generation for a ``--fully-async`` job: ``prompts(n)`` gives the next ``n`` prompts;
        ``next_groups`` hands out completed groups, ``update_weights`` updates while the engines generate
        (returns a :class:`~rlplacement.job.fully_async.FullyAsyncRollout`, which ``options`` go to; the import runs
        here, one way: fully_async builds on the job)."""
        from rlplacement.job.fully_async import FullyAsyncRollout

        return FullyAsyncRollout(self, prompts, **options)

    def one_step_off(self, prompts, prompts_per_step: int, **options):
        """Rollout for a ``--one-step-off`` job: ``next_samples()`` returns a step's samples after starting the
        next step's batch, which generates while the caller trains (returns a
        :class:`~rlplacement.job.one_step_off.OneStepOffRollout`, which ``options`` go to)."""
        from rlplacement.job.one_step_off import OneStepOffRollout

        return OneStepOffRollout(self, prompts, prompts_per_step, **options)

    def engine_capacity(self) -> dict:
        """The smallest engine's ``kv_cache_tokens`` and ``max_num_seqs`` (what caps decoding concurrency)."""
        return {"kv_cache_tokens": min(i["kv_cache_tokens"] for i in self.engine_info),
                "max_num_seqs": min(i["max_num_seqs"] for i in self.engine_info)}

    # ---- training -------------------------------------------------------------------------------
    def _shards(self, batch: "Batch") -> list["Batch"]:
        """Each trainer rank's share: ranks of one tensor/pipeline-parallel group get the same one. With
        ``--global-batch-size`` G, optimizer step j trains on samples ``j*G .. (j+1)*G - 1`` of ``batch``
        whatever the number of ranks: a rank's share is its slice of each step's samples, in step order."""
        cfg = self.config.train
        n, dp = len(batch), self.data_parallel_size
        per_step = cfg.global_batch_size or n
        from rlplacement.train_io import refuse_unreplayed_routes

        replay = self.config.backend.moe.rollout_routing_replay
        if replay and batch.routed_experts is None:
            raise ConfigError("the job replays rollout routing (--use-rollout-routing-replay) and the batch has no "
                              "routed_experts: build it with rlplacement.routed_experts_of(samples)")
        refuse_unreplayed_routes(batch, replay)
        if n % dp:
            raise ConfigError(f"a batch of {n} samples does not split over {dp} data-parallel trainer "
                              f"ranks: use a multiple of {dp} samples per step")
        if n % per_step:
            raise ConfigError(f"a batch of {n} samples is not a whole number of optimizer steps of "
                              f"--global-batch-size {per_step}: send a multiple of {per_step} samples per step")
        share = per_step // dp
        if cfg.micro_batch_size and cfg.micro_batch_size > share:
            raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} is larger than a rank's share of an "
                              f"optimizer step ({per_step} samples over {dp} data-parallel ranks = {share}): lower "
                              f"--micro-batch-size to {share} or less, or send more samples per step")
        if cfg.use_dynamic_batch_size:
            longest = max(batch.sample_lengths(), default=0)
            if longest > cfg.max_tokens_per_gpu:
                raise ConfigError(f"--max-tokens-per-gpu {cfg.max_tokens_per_gpu} is below one sample's length "
                                  f"({longest} tokens): raise --max-tokens-per-gpu to {longest} or more")
        batch.check_lengths()
        steps = range(0, n, per_step)
        return [batch.rows([i for start in steps for i in range(start + r * share, start + (r + 1) * share)])
                if len(steps) > 1 else batch.rows(slice(r * share, (r + 1) * share))
                for r in self.data_parallel_ranks]

    def log_probs(self, batch: "Batch") -> "torch.Tensor":
        """``[B, T]`` float32 log-probs of ``batch`` under the trainer's current weights (see
        ``backends.base`` for the layout: ``lp[:, t]`` is the log-prob of token t, ``lp[:, 0] = 0``)."""
        import torch

        self._hand_off("to_train")
        parts = self._on_trainers("trainer log-probs", lambda t, s: t.log_probs.remote(s), self._shards(batch))
        first_of_share = {dp: part for dp, part in zip(self.data_parallel_ranks, parts)}
        return torch.cat([first_of_share[dp] for dp in range(self.data_parallel_size)])

    def train(self, batch: "Batch") -> list["TrainStepReport"]:
        """Optimizer steps on ``batch`` (one, or one per ``--global-batch-size`` samples); each trainer rank's
        report, in rank order. Every ``--save-interval`` calls the training state is saved (``--save``)."""
        if self.config.train.use_tis and (batch.rollout_logprobs is None or batch.old_logprobs is None):
            raise ConfigError("--use-tis weighs each token by the trainer's log-prob over the engine's: give the batch "
                              "rollout_logprobs (the samples' engine log-probs) and old_logprobs (job.log_probs(batch) "
                              "before the step), or drop --use-tis")
        shards = self._shards(batch)  # bad sizes refused before any rank starts
        self._hand_off("to_train")
        if self.handoff is not None:
            self.handoff.train_step_runs()
        reports = self._on_trainers("train step", lambda t, s: t.train_step.remote(s), shards)
        self.train_calls += 1
        cfg = self.config.train
        if cfg.save and cfg.save_interval and self.train_calls % cfg.save_interval == 0:
            self.save_checkpoint()
        return reports

    def save_checkpoint(self, extra_state: dict[str, Any] | None = None) -> str:
        """Save the training state under ``--save`` now (collective over the trainer ranks); the weights are
        recorded as the version the next update serves them as. Returns the published folder.

        The checkpoint also records this job's generate calls (the next rollout's seeds), epoch and run id,
        and ``extra_state`` (default: :attr:`checkpoint_extra_state`'s, else {}): a small JSON-able dict of
        the caller's, e.g. its prompt sampler's position, given back as :attr:`resumed_extra_state` by a
        run started with ``--load``. Together a resumed run generates what the uninterrupted one would
        have: same prompts, same seeds, same weights."""
        if not self.config.train.save:
            raise ConfigError("RLJob.save_checkpoint: no --save folder was given: set --save")
        if extra_state is None:
            extra_state = self.checkpoint_extra_state() if self.checkpoint_extra_state is not None else {}
        job_state = {"generate_calls": self._generate_calls, "epoch": self.epoch, "run_id": self.run_id,
                     "extra_state": dict(extra_state)}
        self._hand_off("to_train")
        return get_all([t.save_checkpoint.remote(self.config.train.save, self.version + 1, job_state)
                        for t in self.trainers], self.timeout_s, "saving a checkpoint", self.trainer_names)[0]

    def prepare_rollout(self) -> None:
        """Colocated hand-off to generation now (else the next ``generate`` does it): a loop that times
        its phases calls these first, so the hand-off is reported apart (``pop_handoff_metrics``)."""
        self._hand_off("to_rollout")

    def prepare_train(self) -> None:
        self._hand_off("to_train")

    def prepare_update(self) -> None:
        self._hand_off("before_update")

    def _on_trainers(self, what: str, call, shards: list) -> list:
        """``call(trainer, shard)`` on every rank, waited for by name. With ``--ft-components train`` a rank that
        died takes the trainer down: it restarts from the last ``--save`` and the call runs once more."""
        for attempt in (0, 1):
            try:
                return self._with_hint(get_all, [call(t, s) for t, s in zip(self.trainers, shards)],
                                       self.timeout_s, what, self.trainer_names)
            except Exception as exc:
                if attempt or self.ft is None or not self.ft.trainer_died(exc):
                    raise
                self.ft.restart_trainer(str(exc))
                self._hand_off("to_train")
        raise AssertionError("unreachable")

    def _hand_off(self, transition: str) -> None:
        if self.handoff is not None:
            self._with_hint(getattr(self.handoff, transition))

    def _with_hint(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised, with the flag to change when it is GPU memory
            raise_with_offload_hint(self.config, exc)
            raise

    # ---- weights --------------------------------------------------------------------------------
    def set_transfer(self, mode: str, *, check_equal: bool, buffer_size: int | None = None) -> None:
        """Rebuild the transfer group with another mode (benchmarks compare modes on one engine).

        Engines keep serving their current version; the next update continues the numbering.
        """
        t = self.config.transfer
        if buffer_size is not None:
            t = dataclasses.replace(t, buffer_size=buffer_size)
        self.transfer_mode = mode
        share, ranks = self.update_share, set(self.sender_ranks)
        if share == SHARES:
            from rlplacement.transfer.multi_sender import sender_bucket_size

            from rlplacement.job_start import trainer_sends_pieces_for

            pieces = trainer_sends_pieces_for(self.config, share)
            t = dataclasses.replace(t, buffer_size=sender_bucket_size(t.buffer_size, len(ranks), pieces=pieces))
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

    def update_weights(self) -> "UpdateResult":
        """Send the trainer's current weights to every engine as a fresh version number (:attr:`issued` + 1).

        All or nothing per engine (``docs/transfer``'s failure rule). A failed update raises
        :class:`~rlplacement.errors.WeightUpdateError` naming who failed; its number is burned and the job
        is :attr:`stale`: the next update or rollout rebuilds the transfer group and sends the trainer's
        weights again under a new number, so a loop that catches the error goes on. Under
        ``--use-fault-tolerance`` the job first restarts what died or hangs (engines; the trainer with
        ``--ft-components train``) and tries once more itself, under a fresh number; a second failure raises.
        """
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

    def close(self) -> None:
        """Release the update graph, every actor and the placement group; a second call does nothing."""
        if not self._closed:
            self._closed = True
            release(self.updates, self.trainers, self.engines, self.placement)


def _wait_quietly(refs: list, timeout_s: float) -> None:
    """Wait for ``refs`` within ``timeout_s``, whatever they end in (the error that matters is raised)."""
    import ray

    if refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
