"""The framed wire four modes share (``broadcast``, ``broadcast_packed``, ``p2p``, ``cuda_ipc``): a
private group of one sending trainer rank + every engine worker (one group per sender where several
send: :mod:`rlplacement.transfer.multi_sender`), control frames as broadcasts from the sender, and
the frame loop on both sides. A mode subclasses :class:`FramedSender` and :class:`FramedReceiver` and
changes how one bucket's bytes travel (``_send_payload`` / ``_recv_payload``) and, where it must
answer per bucket, ``_take_bucket``.

Wire, per update and sender (every frame is a broadcast from the sender, the group's rank 0):

| frame | header int64[4] = (kind, version, manifest_len, aux) | then |
|---|---|---|
| :data:`KIND_BUCKET` | aux = the bucket's padded bytes | its JSON manifest as uint8 (empty when the group holds this very manifest for this bucket index), then the mode's payload |
| :data:`KIND_END` | aux = tensors sent | nothing: the update is off the wire |
| :data:`KIND_ABORT` | aux = 0 | the reason as UTF-8: the trainer's weight source failed, or a receiver said it could not stage |

Kinds 4-6 belong to ``cuda_ipc`` (its package docstring has them). Receivers drain to END even after
spotting a checksum mismatch, so one engine's refusal never stalls the group for the others; they
raise only once the update is fully off the wire. :class:`AbortUpdate` is how a sender stops an
update cleanly: every receiver gets an ABORT frame and the group stays usable.

Slices (:mod:`rlplacement.transfer.shards`): a receiver that keeps slices publishes them in the group's store
at join; a sender that sends slices (``sends_slices``) reads every receiver's at connect and groups the
receivers by what they keep (its *positions*). A mode that broadcasts payloads (``groups_per_position``) then
builds one more group per position, of the sender and that position's workers, and broadcasts each region
there; control frames stay in the group of all. Where all receivers keep the same (every worker whole), the
group of all carries the payloads as well.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, ClassVar, Iterable, Iterator

from rlplacement.rendezvous import host_store, join_store
from rlplacement.transfer import group as groups
from rlplacement.transfer.base import (DEFAULT_TIMEOUT_S, ApplyFn, BucketManifest, HFShapes, Instants, NamedTensor,
                                       TransferEndpoint, TransferError, UpdateAborted, UpdateRefused, UpdateReport,
                                       WeightSender, hf_shaped)
from rlplacement.transfer.bucket import FlatBuffers, GroupFn, fused_group_of, iter_buckets, plan_manifest, unpack
from rlplacement.transfer.staging import StagingReceiver

if TYPE_CHECKING:
    import torch

KIND_BUCKET, KIND_END, KIND_ABORT = 1, 2, 3


class AbortUpdate(Exception):
    """Stop this update cleanly: every receiver gets an ABORT frame and the group stays usable."""

    what = "update"

    def describe(self) -> str:
        return f"{self.what}: {self}"


class SourceFailed(AbortUpdate):
    """The trainer's tensor iterator raised."""

    what = "the trainer's weight source failed"


def guard(named_tensors: Iterable[NamedTensor]) -> Iterator[NamedTensor]:
    """``named_tensors`` with a failure of the trainer's source turned into :class:`SourceFailed`."""
    it = iter(named_tensors)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except Exception as exc:
            raise SourceFailed(f"{type(exc).__name__}: {exc}") from exc
        yield item


def wire_device(backend: str, device: "torch.device") -> "torch.device":
    """Where frames and payloads live: host memory for gloo, the tensors' device for NCCL."""
    import torch

    return torch.device("cpu") if backend == "gloo" else device


@dataclasses.dataclass
class SentSoFar:
    """What an update has moved so far: counts, bytes and, with checksums on, every tensor's checksum."""

    num_tensors: int = 0
    num_buckets: int = 0
    nbytes: int = 0
    checksums: dict[str, str] | None = None

    @classmethod
    def none(cls, check_equal: bool) -> "SentSoFar":
        return cls(checksums={} if check_equal else None)

    def add(self, bucket: list[NamedTensor], manifest: BucketManifest, checksums: dict[str, str] | None = None) -> None:
        """``checksums``: what the receivers check instead of the manifest's (slices', by ``shards.region_key``)."""
        self.num_buckets += 1
        self.num_tensors += len(bucket)
        self.nbytes += sum(m.nbytes for m in manifest.tensors)
        if self.checksums is not None:
            self.checksums.update(checksums if checksums is not None else
                                  ((m.name, m.checksum) for m in manifest.tensors))


class FramedSender(WeightSender):
    """A sending trainer rank: tensors -> buckets -> header + manifest frame, then the mode's payload per bucket."""

    sends_slices: ClassVar[bool] = False
    """Sends each receiver only the slices it keeps: reads every receiver's keeps at connect (``_positions``)."""
    groups_per_position: ClassVar[bool] = False
    """Payloads are broadcasts: one group per position where receivers keep different slices."""

    def __init__(self, buffer_size: int, *, check_equal: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
                 device: "torch.device | str | None" = None, group_of: GroupFn = fused_group_of):
        import torch

        self.buffer_size, self.check_equal, self.timeout_s = buffer_size, check_equal, timeout_s
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
        return enumerate(iter_buckets(guard(hf_shaped(named_tensors, hf_shapes)), self.buffer_size, self.group_of))

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


class FramedReceiver(StagingReceiver):
    """One engine worker: stage every bucket into kept buffers, verify, hand over on commit; or, bucketwise,
    hand each verified bucket to the loader as it arrives, in two buffers taken in turn.

    The frame loop (:meth:`_stage`) is every framed mode's; a mode changes how a bucket's bytes arrive
    (:meth:`_recv_payload`) and, where it must answer per bucket, :meth:`_take_bucket`. A checksum
    mismatch is deferred (``self._failure``) so the receiver drains to END and never stalls the group
    for the others.
    """

    bucketwise = True
    groups_per_position: ClassVar[bool] = False
    """Payloads arrive by broadcast: a worker keeping slices joins its position's group (the sender's
    ``groups_per_position``)."""

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        import torch

        super().__init__(device, version=version)
        self.buffers: FlatBuffers | None = None
        self._group = None
        self._payload_group = None  # where payloads arrive: this worker's position group, else the group of all
        self._endpoint: TransferEndpoint | None = None
        self._wire = torch.device("cpu")  # where control frames (headers, manifests) live
        self._payload_info: dict | None = None  # the current bucket's "payload" entry, if the mode sends one
        self._manifests: dict[int, tuple[BucketManifest, dict | None, dict | None]] = {}  # as sent, per bucket
        # index: the manifest, its "payload" entry and its slices' checksums (``shards.region_key``)
        self._views: dict[int, tuple] = {}  # bucket index -> (buffer, manifest, typed views) of the last update
        self._regions: dict[int, tuple] = {}  # bucket index -> (manifest, slice sums, region, boxes) last derived
        self._sliced: dict[str, tuple] = {}  # of the update staged last: name -> (box, HF shape)
        self._slice_data: list[tuple[str, "torch.Tensor"]] = []  # (region key, the slice's bytes) of that update
        self._failure: BaseException | None = None  # the first failure of this update, raised once drained

    def _joined(self) -> bool:
        return self._group is not None

    def _where(self) -> str:
        return f"receiver rank {self.rank}"

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        self._check_endpoint(endpoint, rank)
        self.close()
        store = join_store(endpoint.host, endpoint.port, endpoint.world_size, endpoint.timeout_s)
        wire = wire_device(endpoint.backend, self.device)
        self._group = self._payload_group = groups.TransferGroup(store, endpoint.group_name, rank,
                                                                 endpoint.world_size, endpoint.backend, wire,
                                                                 endpoint.timeout_s)
        if self.accepts_slices:
            from rlplacement.transfer.shards import keeps_key, keeps_to_json, position_key

            store.set(keeps_key(endpoint.group_name, rank), keeps_to_json(self.keeps))
            if self.groups_per_position:
                table = json.loads(store.get(position_key(endpoint.group_name)))
                if len(table) > 1:
                    i = next(i for i, ranks in enumerate(table) if rank in ranks)
                    self._payload_group = groups.TransferGroup(
                        store, f"{endpoint.group_name}/position{i}", table[i].index(rank) + 1, len(table[i]) + 1,
                        endpoint.backend, wire, endpoint.timeout_s)
        self._wire = wire
        self._manifests = {}
        if self.buffers is None or self.buffers.device != wire:
            self.buffers = FlatBuffers(wire)
        self._endpoint = endpoint

    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        self._start_update()
        return self._stage_buckets(self._recv_frame())

    def _stream(self, apply_bucket: ApplyFn) -> tuple[int, int, int]:
        self._start_update()
        _, num_tensors, num_buckets, nbytes = self._receive_buckets(self._recv_frame(), apply_bucket)
        return num_tensors, num_buckets, nbytes

    def _start_update(self) -> None:
        self._failure = None
        self._sliced, self._slice_data = {}, []
        self.verified_checksums = None

    @property
    def sliced(self) -> dict[str, tuple]:
        return self._sliced

    def _region(self, manifest: BucketManifest, sums: dict | None = None) -> tuple[BucketManifest, tuple]:
        """The bucket of ``manifest`` as this worker receives it (``shards.region_manifest``: its slices, or
        ``manifest`` itself when it keeps none and ``sums`` is None), and each tensor's box."""
        from rlplacement.transfer import shards

        if not self.keeps and sums is None:
            return manifest, (None,) * len(manifest.tensors)
        cached = self._regions.get(manifest.index)
        if cached is not None and cached[0] is manifest and cached[1] is sums:
            return cached[2], cached[3]
        region, boxes = shards.region_manifest(manifest, self.keeps, sums)
        self._regions[manifest.index] = (manifest, sums, region, boxes)
        return region, boxes

    def _as_loaded(self, tensors: list[NamedTensor], manifest: BucketManifest, boxes: tuple,
                   hash_now: bool = False) -> list[NamedTensor]:
        """``tensors`` (a region's, in manifest order) as the loader takes them: a slice as a tensor of the HF
        shape over the slice's bytes (``slice_tensor.as_whole``), noted in :attr:`sliced`; a whole tensor as it is. ``hash_now``: the
        region's buffer is reused before the update ends (bucket staging), so its checksums are taken now."""
        if not self.keeps:
            return tensors
        from rlplacement.transfer import shards
        from rlplacement.transfer.base import tensor_checksum
        from rlplacement.transfer.slice_tensor import as_whole

        out = []
        for (name, t), meta, box in zip(tensors, manifest.tensors, boxes):
            key = shards.region_key(name, box)
            self._slice_data.append((key, tensor_checksum(t) if hash_now and self._endpoint.check_equal else t))
            if box is None:
                out.append((name, t))
            else:
                self._sliced[name] = (box, meta.shape)
                out.append((name, as_whole(t, box, meta.shape, name)))
        return out

    def _slices_landed(self) -> None:
        """The whole update is off the wire: with checks on, this worker's own checksums of the slices it
        received stand for what it serves (the staged tensors hold other bytes outside their boxes)."""
        if self.keeps and self._endpoint.check_equal:
            from rlplacement.transfer.base import tensor_checksum

            self.verified_checksums = {key: t if isinstance(t, str) else tensor_checksum(t) for key, t in self._slice_data}
        self._slice_data = []

    def _stage_buckets(self, frame: tuple[int, int, bytes]) -> tuple[list[NamedTensor], int, int]:
        """Stage buckets until END, starting with ``frame`` (the update's first, already received)."""
        staged, _, num_buckets, nbytes = self._receive_buckets(frame, None)
        return staged, num_buckets, nbytes

    def _receive_buckets(self, frame: tuple[int, int, bytes], apply_bucket: ApplyFn | None,
                         before: tuple[list[NamedTensor], int, int, int] | None = None):
        """Buckets until END, starting with ``frame``: ``(staged, tensors, buckets, bytes)``. Without
        ``apply_bucket`` each bucket stays in its own kept buffer and is staged; with it, buckets take two
        buffers in turn (a bucket's views are handed over before the one after next lands in them) and go
        to ``apply_bucket`` as they arrive, until the first failure (kept in ``self._failure``).
        ``before``: what this update staged already another way (its buckets are the first positions)."""
        staged, num_tensors, num_buckets, nbytes = before if before is not None else ([], 0, 0, 0)
        while True:
            kind, version, blob = frame
            if kind == KIND_ABORT:
                self._on_abort_frame(version, blob)
            if kind == KIND_END:
                break
            if kind != KIND_BUCKET:
                raise TransferError(f"unexpected frame kind {kind} from the trainer")
            manifest = self._parse_manifest(blob, num_buckets)
            region, boxes = self._region(manifest, self._manifests[manifest.index][2])
            slot = manifest.index if apply_bucket is None else num_buckets % 2
            tensors = self._as_loaded(self._take_bucket(self.buffers.get(slot, region.nbytes), region), manifest,
                                      boxes, hash_now=apply_bucket is not None)
            if apply_bucket is None:
                staged.extend(tensors)
            elif self._failure is None:
                try:
                    apply_bucket(tensors)
                    if self.device.type == "cuda":  # a later bucket lands in this buffer: the loader's copies first
                        import torch

                        torch.cuda.current_stream(self.device).synchronize()
                except Exception as exc:  # noqa: BLE001 - raised once drained, so no peer stalls
                    self._failure = exc
            num_tensors += len(tensors)
            nbytes += sum(m.nbytes for m in region.tensors)
            num_buckets += 1
            frame = self._recv_frame()
        self._after_end(num_tensors)
        self._slices_landed()
        self.buffers.trim(num_buckets if apply_bucket is None else 2)
        return staged, num_tensors, num_buckets, nbytes

    def _take_bucket(self, buf: "torch.Tensor", manifest: BucketManifest) -> list[NamedTensor]:
        """The bucket's bytes into ``buf``, as typed views; the first mismatch is kept, not raised."""
        self._recv_payload(buf, manifest)
        tensors = self._unpack(buf, manifest)
        if self._failure is None:
            self._failure = self.first_mismatch(manifest, tensors, self._where())
        return tensors

    def _on_abort_frame(self, version: int, blob: bytes) -> None:
        raise UpdateAborted(f"trainer aborted update to version {version}: {blob.decode()}")

    def _after_end(self, num_staged: int) -> None:
        """The update is off the wire: refuse a short one, then raise the failure kept while draining."""
        if self._end_count != num_staged:
            raise TransferError(f"trainer sent {self._end_count} tensors, receiver staged {num_staged}")
        if self._failure is not None:
            raise self._failure

    def _parse_manifest(self, blob: bytes, position: int) -> BucketManifest:
        """The manifest of the bucket at ``position`` in this update: parsed from ``blob``, or the one
        this group received for that position before when the sender sent none (unchanged)."""
        if blob:
            obj = json.loads(blob)
            manifest = BucketManifest.from_wire(obj)
            self._manifests[manifest.index] = (manifest, obj.get("payload"), obj.get("slice_checksums"))
        elif position in self._manifests:
            manifest = self._manifests[position][0]
        else:
            raise TransferError(f"the trainer referred to the manifest of bucket {position}, which this receiver "
                                f"never received; rebuild the transfer group")
        if manifest.index != position:
            raise TransferError(f"bucket {manifest.index} arrived at position {position}")
        self._payload_info = self._manifests[position][1]
        return manifest

    def _unpack(self, buf: "torch.Tensor", manifest: BucketManifest) -> list[NamedTensor]:
        """Typed views of the bucket; the same list objects as last update when nothing moved."""
        cached = self._views.get(manifest.index)
        if cached is not None and cached[0] is buf and cached[1] is manifest:
            return list(cached[2])
        views = unpack(buf, manifest)
        self._views[manifest.index] = (buf, manifest, views)
        return list(views)

    def _recv_frame(self) -> tuple[int, int, bytes]:
        import torch

        header = torch.empty(4, dtype=torch.int64, device=self._wire)
        self._group.broadcast(header)
        kind, version, blob_len, aux = (int(x) for x in header.tolist())
        if version != self._pending:
            raise TransferError(f"trainer is sending version {version}, receiver expected {self._pending}")
        blob = b""
        if blob_len:
            raw = torch.empty(blob_len, dtype=torch.uint8, device=self._wire)
            self._group.broadcast(raw)
            blob = raw.cpu().numpy().tobytes()
        self._end_count = aux
        return kind, version, blob

    @property
    def staging_bytes(self) -> int:
        return self.buffers.nbytes if self.buffers is not None else 0

    def release_staging(self) -> int:
        """Let the kept staging buffers go (a sleeping colocated engine); the next update allocates
        them again. Returns the bytes let go. Only between updates: nothing staged may be pending."""
        if self.buffers is None or self._staged is not None:
            return 0
        freed = self.buffers.nbytes
        self.buffers = FlatBuffers(self.buffers.device)
        self._views = {}
        return freed

    @abc.abstractmethod
    def _recv_payload(self, buf: "torch.Tensor", manifest: BucketManifest) -> None:
        """The bucket's bytes into ``buf`` (its staging buffer)."""

    def close(self) -> None:
        if self._payload_group is not None and self._payload_group is not self._group:
            self._payload_group.close()
        if self._group is not None:
            self._group.close()
        self._group = self._payload_group = None
