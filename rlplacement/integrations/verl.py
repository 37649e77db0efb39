"""Every split-layout transfer mode of ours as a verl checkpoint-engine backend (verl 0.9.1).

Registered with verl's ``CheckpointEngineRegistry`` on import, under :data:`BACKENDS`' names.
verl imports this module on its own, with no code change on the user's side, through either

- ``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=rlplacement.integrations.verl``
  (imported on the driver, the actor and the rollout workers before the engine is built), or
- the ``verl.plugins`` entry point this package declares (loaded on every ``import verl``; verl
  logs a failed load only at DEBUG, so the first path is the one that fails loudly).

How verl drives a backend, every weight update (``CheckpointEngineManager.update_weights``):
``prepare()`` on every trainer rank and rollout worker -> ``build_topology`` on the driver from
those results -> ``init_process_group(**kwargs)`` on every worker at once -> ``send_weights``
(every trainer rank, each with its own generator) beside ``receive_weights`` (every rollout
worker) -> ``finalize()`` everywhere. Trainer rank 0 (``is_master``) is our sender; the other
trainer ranks drain their generators, because producing a tensor is a collective among them.

Invariants:
- The transfer group is built once and kept across updates (like verl's NCCL backend without
  ``rebuild_group``): ``prepare()`` reports the group each worker is in, and ``build_topology``
  rebuilds only when one of them differs (a restarted rollout worker, a failed update), so a
  fresh process never joins a half-formed group. ``rebuild_group=True`` rebuilds every update.
- Versions come from trainer rank 0 (one more than its last update), so every receiver stages
  the same version; verl's ``global_steps`` is reported in the metrics, not used as a version
  (verl passes None on some paths and repeats a step on others).
- ``receive_weights`` yields only after the whole update is staged and verified (checksums
  with ``check_weight_update_equal``), so verl's loader never sees a mix of two versions. The
  yielded tensors are views of our staging buffers and stay valid until the next update.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import uuid
from typing import Any, ClassVar, Iterable

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from rlplacement.integrations.options import transfer_config
from rlplacement.transfer import registry
from rlplacement.transfer.base import DEFAULT_TIMEOUT_S, NamedTensor, TransferEndpoint, TransferError

# verl backend name -> our transfer mode (every mode whose spec names a verl backend)
BACKENDS = {s.verl_backend: name for name, s in registry.specs().items() if s.verl_backend}
VERL_KWARGS = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs"
# options of this adapter itself, beside our transfer flags
ADAPTER_KEYS = ("rebuild_group", "timeout_s", "hf_checkpoint")


def _endpoint_key(token: str) -> str:
    return f"rlplacement/verl/endpoint/{token}"


class RlplacementCheckpointEngine(CheckpointEngine):
    """One of our modes behind verl's interface; subclasses fix :attr:`mode` and :attr:`backend`."""

    mode: ClassVar[str]
    backend: ClassVar[str]

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any):
        """``bucket_size``: verl's ``update_weights_bucket_megabytes`` in bytes (our buffer size);
        ``engine_kwargs``: our transfer flags' names with underscores, plus :data:`ADAPTER_KEYS`.
        Validated here, before any process joins anything."""
        adapter = {k: engine_kwargs.pop(k) for k in ADAPTER_KEYS if k in engine_kwargs}
        where = f"{VERL_KWARGS}.{self.backend}"
        self.config = transfer_config(self.mode, bucket_size, engine_kwargs, where=where, owned_elsewhere={
            "update_weight_buffer_size": "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"})
        self.is_master = bool(is_master)
        self.rebuild_group = bool(adapter.get("rebuild_group", False))
        self.timeout_s = float(adapter.get("timeout_s", DEFAULT_TIMEOUT_S))
        self.base_dir = adapter.get("hf_checkpoint")
        self._rendezvous = None  # trainer rank 0: the store receivers read the endpoint from
        self._sender = self._receiver = None
        self._group: str | None = None  # token of the group this worker is in (None: in none)
        self._world_size = 0
        self._version = 0  # trainer rank 0: last version sent; a receiver: last version staged
        self._next_version = 0
        self._rank = -1

    # -- verl's protocol
    def prepare(self) -> dict[str, Any]:
        meta = {"backend": self.backend, "is_master": self.is_master, "group": self._group,
                "version": self._version, "world_size": self._world_size}
        if self.is_master:
            host, port = self._rendezvous_address()
            meta.update(host=host, port=port)
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list], dict[str, list]]:
        trainer_meta, rollout_meta = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        masters = [i for i, m in enumerate(trainer_meta) if m.get("is_master")]
        if masters != [0]:
            raise TransferError(f"{cls.backend}: trainer rank 0 must be the only master, got ranks {masters} "
                                f"(verl builds the engine with is_master=(rank == 0))")
        master = trainer_meta[0]
        world_size = 1 + rollout_world_size
        keep = (master["group"] is not None and master["world_size"] == world_size
                and all(m["group"] == master["group"] for m in rollout_meta))
        shared = {"world_size": world_size, "host": master["host"], "port": master["port"],
                  "group": master["group"] if keep else uuid.uuid4().hex[:12], "keep": keep,
                  "version": master["version"] + 1}
        trainer_kwargs = {"rank": [0] + [-1] * (actor_wg_world_size - 1),
                          **{k: [v] * actor_wg_world_size for k, v in shared.items()}}
        rollout_kwargs = {"rank": list(range(1, world_size)), **{k: [v] * rollout_world_size for k, v in shared.items()}}
        return trainer_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, host: str, port: int, group: str, keep: bool,
                           version: int) -> None:
        self._rank, self._next_version = rank, version
        if rank < 0 or (keep and self._group == group):
            return
        self._leave_group()
        if rank == 0:
            self._join_as_sender(world_size, group)
        else:
            self._join_as_receiver(rank, host, port, group)
        self._group, self._world_size = group, world_size

    async def send_weights(self, weights: Iterable[NamedTensor], global_steps: int | None = None) -> dict:
        if self._rank != 0:
            for _ in weights:  # the gathers behind each tensor are collectives among trainer ranks
                pass
            return {}
        version = self._next_version
        try:
            report = self._sender.update(version, weights)
        except BaseException:
            self._leave_group()  # abort our side now; the next prepare() asks for a fresh group
            raise
        self._version = version
        return self._metrics(report, global_steps)

    async def receive_weights(self, global_steps: int | None = None):
        receiver = self._receiver
        if receiver is None or self._rank <= 0:
            raise TransferError(f"{self.backend}: receive_weights before init_process_group gave this "
                                f"rollout worker a rank")
        receiver.begin(self._next_version)
        try:
            await asyncio.to_thread(receiver.receive)  # the whole update, staged and verified
        except BaseException:
            receiver.abort()
            self._leave_group()
            raise
        staged: list[NamedTensor] = []
        self._version = receiver.commit(staged.extend)
        for item in staged:
            yield item

    def finalize(self) -> None:
        if self.rebuild_group:
            self._leave_group()

    # -- internals
    def _rendezvous_address(self) -> tuple[str, int]:
        from rlplacement.rendezvous import host_store
        from rlplacement.transfer.group import local_host

        if self._rendezvous is None:
            host = local_host()
            store, port = host_store(host, 2, self.timeout_s)
            self._rendezvous = (store, host, port)
        return self._rendezvous[1], self._rendezvous[2]

    def _join_as_sender(self, world_size: int, group: str) -> None:
        if self._sender is None:  # one sender for the engine's life: disk-delta keeps its history
            options = registry.sender_options(self.config, self.mode, self.base_dir)
            self._sender = registry.sender_class(self.mode)(
                self.config.bucket_bytes, check_equal=self.config.check_equal, timeout_s=self.timeout_s, **options)
        store, host, _ = self._rendezvous
        endpoint = self._sender.listen(world_size, host=host)
        store.set(_endpoint_key(group), json.dumps(endpoint.to_dict()))
        self._sender.connect()

    def _join_as_receiver(self, rank: int, host: str, port: int, group: str) -> None:
        from rlplacement.rendezvous import join_store
        from rlplacement.transfer.group import default_device

        store = join_store(host, port, 2, self.timeout_s)
        try:
            store.wait([_endpoint_key(group)], datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise TransferError(f"{self.backend}: rollout rank {rank} got no endpoint from trainer rank 0 at "
                                f"{host}:{port} within {self.timeout_s:g} s ({type(exc).__name__})") from exc
        endpoint = TransferEndpoint.from_dict(json.loads(store.get(_endpoint_key(group))))
        if self._receiver is None:
            self._receiver = registry.receiver_class(self.mode)(default_device(), version=self._version)
        self._receiver.connect(endpoint, rank)

    def _leave_group(self) -> None:
        """Close (NCCL: abort) this worker's side at once; never waits for a peer."""
        if self._sender is not None and self._group is not None:
            self._sender.close()
        if self._receiver is not None:
            self._receiver.close()
        self._group, self._world_size = None, 0

    def _metrics(self, report, global_steps: int | None) -> dict[str, float]:
        """Scalars only: verl merges these into the step's logged metrics."""
        metrics = {"version": report.version, "bytes": report.bytes, "seconds": report.seconds,
                   "gbps": report.gbps, "num_tensors": report.num_tensors, "num_buckets": report.num_buckets}
        for extra in ("wire_bytes", "density"):  # disk-delta: only the changed bytes travel
            if hasattr(report, extra):
                metrics[extra] = getattr(report, extra)
        if global_steps is not None:
            metrics["global_steps"] = global_steps
        return {f"rlplacement/{k}": float(v) for k, v in metrics.items()}


def _register(backend: str, mode: str) -> type[RlplacementCheckpointEngine]:
    cls = type(f"Rlplacement{''.join(p.title() for p in mode.replace('-', '_').split('_'))}CheckpointEngine",
               (RlplacementCheckpointEngine,), {"mode": mode, "backend": backend, "__module__": __name__,
                                                "__doc__": f"Our mode {mode!r} as verl backend {backend!r}."})
    return CheckpointEngineRegistry.register(backend)(cls)


ENGINES = {backend: _register(backend, mode) for backend, mode in BACKENDS.items()}
