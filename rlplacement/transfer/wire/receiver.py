"""The receiving side of the framed wire: one engine worker that reads frames until END, staging every bucket
(or handing each to the loader as it arrives), and raises what went wrong only once the update is off the wire,
so one engine's refusal never stalls the group for the others. A mode subclasses :class:`FramedReceiver` and
receives one bucket's bytes its own way (``_recv_payload``)."""

from __future__ import annotations

import abc
import json
from typing import TYPE_CHECKING, ClassVar

from rlplacement.rendezvous import join_store
from rlplacement.transfer import group as groups
from rlplacement.transfer.base import ApplyFn, BucketManifest, NamedTensor, TransferEndpoint, TransferError, UpdateAborted
from rlplacement.transfer.bucket import FlatBuffers, unpack
from rlplacement.transfer.staging import StagingReceiver
from rlplacement.transfer.wire.frames import KIND_ABORT, KIND_BUCKET, KIND_END, wire_device

if TYPE_CHECKING:
    import torch


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
