"""The sending side of the framed wire: a trainer rank that cuts its tensors into buckets and sends each as a
BUCKET frame (header and manifest, broadcast in the group of all) followed by the mode's payload, then END;
an :class:`~rlplacement.transfer.wire.frames.AbortUpdate` raised while sending becomes an ABORT frame, any
other failure leaves the group broken until ``listen`` and ``connect`` run again. A mode subclasses
:class:`FramedSender` and sends one bucket's bytes its own way (``_send_payload``)."""

from __future__ import annotations

import abc
import json
import time
import uuid
from typing import TYPE_CHECKING, ClassVar, Iterable

from rlplacement.rendezvous import host_store
from rlplacement.transfer import group as groups
from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, BucketManifest, HFShapes, Instants, NamedTensor,
                                       TransferEndpoint, TransferError, UpdateAborted, UpdateRefused, UpdateReport,
                                       WeightSender, hf_shaped)
from rlplacement.transfer.bucket import FlatBuffers, GroupFn, fused_group_of, iter_buckets, plan_manifest
from rlplacement.transfer.wire.frames import KIND_ABORT, KIND_BUCKET, KIND_END, AbortUpdate, SentSoFar, guard, wire_device

if TYPE_CHECKING:
    import torch


class FramedSender(WeightSender):
    """A sending trainer rank: tensors -> buckets -> header + manifest frame, then the mode's payload per bucket."""

    sends_slices: ClassVar[bool] = False
    """Sends each receiver only the slices it keeps: reads every receiver's keeps at connect (``_positions``)."""
    groups_per_position: ClassVar[bool] = False
    """Payloads are broadcasts: one group per position where receivers keep different slices."""

    def __init__(self, bucket_bytes: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: "torch.device | str | None" = None, group_of: GroupFn = fused_group_of):
        import torch

        self.bucket_bytes, self.check_equal, self.timeout_s = bucket_bytes, check_equal, timeout_s
        self.device = torch.device(device) if device is not None else groups.default_device()
        self.backend = groups.backend_for(self.device)
        self.wire_device = wire_device(self.backend, self.device)
        self.group_of = group_of
        self.buffers = FlatBuffers(self.wire_device)
        self._store = self._endpoint = self._group = None
        self._broken: str | None = None
        self._in_flight: dict = {}  # slot -> work of a payload still on the wire (overlapping modes)
        self._sent_manifests: dict[int, bytes] = {}  # bucket index -> manifest the group already has
        self._positions: list = []  # (keeps, group ranks keeping them) per distinct keeps (shards.slice_positions)
        self._position_groups: list = []  # a group per position (groups_per_position, several positions), else []
        self.instants = Instants()  # of the last update
        self.fallback = ""  # of the last update: why a resident update did not go in place (UpdateReport.fallback)

    @property
    def transport(self) -> str:
        """The group's backend, which carries the payloads: ``nccl`` for CUDA tensors, ``gloo`` for CPU ones."""
        return self.backend

    @property
    def collectives(self) -> int:
        """Broadcasts and all-reduces this sender issued in its groups so far (0 before ``connect``): what the
        wire costs in round trips."""
        if self._group is None:
            return 0
        return self._group.collectives + sum(g.collectives for g in self._position_groups)

    def listen(self, world_size: int, *, host: str | None = None) -> TransferEndpoint:
        if world_size < 2:
            raise ValueError(f"world_size {world_size}: need the trainer plus at least one engine worker")
        host = host or groups.local_host()
        self._store, port = host_store(host, world_size, self.timeout_s)
        self._endpoint = TransferEndpoint(self.mode, host, port, world_size, self.backend,
                                          uuid.uuid4().hex[:12], self.timeout_s, self.check_equal, self._mode_info())
        return self._endpoint

    def _mode_info(self) -> dict:
        """The mode's own init record (``ModeSpec.init_record``) as the endpoint carries it."""
        return {}

    def connect(self) -> None:
        if self._endpoint is None:
            raise TransferError("connect() before listen(): call listen(world_size) first")
        e = self._endpoint
        self._close_position_groups()
        self._group = groups.TransferGroup(self._store, e.group_name, 0, e.world_size, e.backend,
                                           self.wire_device, e.timeout_s)
        self._broken = None
        self._sent_manifests = {}
        self._positions = []
        if self.sends_slices:
            from rlplacement.transfer.shards import keeps_from_json, keeps_key, position_key, slice_positions

            self._positions = slice_positions([keeps_from_json(self._store.get(keeps_key(e.group_name, r)).decode())
                                               for r in range(1, e.world_size)])
            if self.groups_per_position:
                self._store.set(position_key(e.group_name), json.dumps([ranks for _, ranks in self._positions]))
                if len(self._positions) > 1:
                    self._position_groups = [
                        groups.TransferGroup(self._store, f"{e.group_name}/position{i}", 0, len(ranks) + 1,
                                             e.backend, self.wire_device, e.timeout_s)
                        for i, (_, ranks) in enumerate(self._positions)]

    @property
    def _sliced(self) -> bool:
        """Some receiver keeps slices: buckets are cut per position (``shards.regions``)."""
        return any(keeps for keeps, _ in self._positions)

    def _payload_groups(self) -> list:
        """The group each position's payload is broadcast in (``_positions`` order)."""
        return self._position_groups or [self._group] * len(self._positions)

    def _close_position_groups(self) -> None:
        for group in self._position_groups:
            group.close()
        self._position_groups = []

    def update(self, version: int, named_tensors: Iterable[NamedTensor], *, resident: bool = False,
               hf_shapes: HFShapes | None = None) -> UpdateReport:
        if self._group is None:
            raise TransferError("update() before connect(): call listen() and connect() first")
        if self._broken:
            raise TransferError(f"the transfer group is broken ({self._broken}): listen() and connect() again")
        start = time.perf_counter()
        self.instants = Instants()
        self.instants.mark("start")
        self.fallback = ""
        try:
            num_tensors, num_buckets, nbytes, checksums, path = self._send_update(version, named_tensors, resident,
                                                                                hf_shapes)
        except AbortUpdate as exc:
            self._forget_sent()
            try:
                self._drain_quietly()
                self._send_frame(KIND_ABORT, version, str(exc).encode(), 0)
            except BaseException as wire_exc:
                self._broken = f"{type(wire_exc).__name__}: {wire_exc}"
                self._in_flight = {}
                raise
            raise UpdateAborted(f"update to version {version} aborted: {exc.describe()}") from exc.__cause__
        except UpdateRefused:
            raise  # the update ran to its end and the group is in step: usable as it is
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            self._in_flight = {}
            raise
        self.instants.mark("end")
        return UpdateReport(version, num_tensors, num_buckets, nbytes, time.perf_counter() - start, checksums, path,
                            dict(self.instants), fallback=self.fallback, transport=self.transport)

    def _send_update(self, version: int, named_tensors: Iterable[NamedTensor], resident: bool,
                     hf_shapes: HFShapes | None = None):
        """Every bucket, then END: ``(tensors, buckets, bytes, checksums or None, path)``. ``resident``
        (the tensors are the trainer's own memory) lets a mode read them in place; here it changes nothing
        but that the tensors of ``hf_shapes`` are packed in their HF shapes."""
        return self._send_buckets(version, self._buckets(named_tensors, hf_shapes), SentSoFar.none(self.check_equal))

    def _buckets(self, named_tensors: Iterable[NamedTensor], hf_shapes: HFShapes | None):
        """``(index, bucket)`` of this update, tensors of ``hf_shapes`` in their HF shapes, a failure of the
        trainer's source turned into :class:`SourceFailed`."""
        return enumerate(iter_buckets(guard(hf_shaped(named_tensors, hf_shapes)), self.bucket_bytes, self.group_of))

    def _send_buckets(self, version: int, buckets: Iterable[tuple[int, list[NamedTensor]]], sent: "SentSoFar"):
        """Each ``(index, bucket)`` as a BUCKET frame and its payload, then END; ``sent``: what this update
        already moved another way (a mode that replays its last buckets, then goes bucket by bucket)."""
        for index, bucket in buckets:
            manifest = plan_manifest(index, bucket, self.check_equal)
            prepared = self._prepare_payload(bucket, manifest)  # before the header: overlaps the last send
            self._send_frame(KIND_BUCKET, version, self._manifest_blob(manifest, prepared), manifest.nbytes)
            self._send_payload(bucket, manifest, prepared)
            sent.add(bucket, manifest, self._checksums_sent(prepared))
        self._drain()
        self._send_frame(KIND_END, version, b"", sent.num_tensors)
        if self.wire_device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.wire_device).synchronize()  # sent means off the wire
        return sent.num_tensors, sent.num_buckets, sent.nbytes, sent.checksums, "buckets"

    def _forget_sent(self) -> None:
        """After an abort, receivers may hold none of the manifests sent: send them whole again."""
        self._sent_manifests = {}

    def _send_frame(self, kind: int, version: int, blob: bytes, aux: int) -> None:
        import torch

        self._group.broadcast(torch.tensor([kind, version, len(blob), aux], dtype=torch.int64,
                                           device=self.wire_device))
        if blob:
            self._group.broadcast(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.wire_device))

    def _manifest_blob(self, manifest: BucketManifest, prepared) -> bytes:
        """The bucket's JSON, or b"" when the group already holds this exact manifest for this bucket
        index (steady state: same model, same buckets, no checksums), saving a frame and a parse."""
        blob = json.dumps(self._manifest_wire(manifest, prepared)).encode()
        if self._sent_manifests.get(manifest.index) == blob:
            return b""
        self._sent_manifests[manifest.index] = blob
        return blob

    def _manifest_wire(self, manifest: BucketManifest, prepared) -> dict:
        """The bucket's JSON frame, with the slices' checksums where receivers keep slices; modes may add a
        ``"payload"`` entry (e.g. an IPC handle)."""
        out = manifest.to_wire()
        sums = self._checksums_sent(prepared)
        if sums is not None:
            out["slice_checksums"] = sums
        return out

    def _prepare_payload(self, bucket: list[NamedTensor], manifest: BucketManifest):
        """Work done before the bucket's header goes out (packing, in overlapping modes)."""
        return None

    def _checksums_sent(self, prepared) -> dict[str, str] | None:
        """The checksums receivers check for a bucket, where a mode sends other bytes than the manifest's
        tensors (slices); None: the manifest's."""
        return None

    @abc.abstractmethod
    def _send_payload(self, bucket: list[NamedTensor], manifest: BucketManifest, prepared) -> None:
        """The bucket's bytes on their way (``prepared``: what :meth:`_prepare_payload` returned)."""

    def _drain(self) -> None:
        """Wait for payloads still in flight (modes that overlap packing with sending)."""

    def _drain_quietly(self) -> None:
        """``_drain`` on the abort path: wait for the wire, raise only on wire errors."""
        self._drain()

    def close(self) -> None:
        self._close_position_groups()
        if self._group is not None:
            self._group.close()
        self._group = self._store = self._endpoint = None
