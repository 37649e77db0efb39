"""The contract every transfer mode implements, and the records that cross process boundaries.

Data flow of one update: the trainer's ``WeightSender.update(version, named_tensors)`` streams
buckets; each engine worker's ``WeightReceiver`` stages everything it receives (``begin`` ->
``receive``) and only then hands the complete, validated set to the engine's loader
(``commit``). A failure anywhere before ``commit`` leaves the engine serving its previous
version whole: that is the all-or-nothing invariant, and why modes stage instead of loading
bucket by bucket. Every mode has that shape: stage (receive broadcasts; copy out of the
trainer's shared bucket buffers in ``cuda_ipc``; read and verify a version folder in
``disk-delta``), then apply, with versions and per-tensor checksums.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Sequence

from rlplacement.errors import (  # noqa: F401  (part of this module's contract)
    TransferError, UpdateAborted, UpdateRefused, WeightMismatchError, WeightUpdateError)

if TYPE_CHECKING:
    import torch

NamedTensor = tuple[str, "torch.Tensor"]
ApplyFn = Callable[[list[NamedTensor]], None]
HFShapes = dict[str, tuple[int, ...]]
"""Name -> HF shape of the resident tensors held in another shape (a fused parameter's rows, grouped as
the trainer holds them): each such tensor's elements in C order are the HF tensor's."""

DEFAULT_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """One tensor's place in a bucket: raw bytes [offset, offset + nbytes) of the flat buffer."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: str | None = None

    def to_wire(self) -> list:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes, self.checksum]

    @classmethod
    def from_wire(cls, row: Sequence) -> "TensorMeta":
        name, dtype, shape, offset, nbytes, checksum = row
        return cls(name, dtype, tuple(shape), int(offset), int(nbytes), checksum)


@dataclasses.dataclass(frozen=True)
class BucketManifest:
    """What one bucket holds; sent before its bytes so the receiver can size and slice its buffer."""

    index: int
    nbytes: int  # bytes of the flat buffer, alignment padding included
    tensors: tuple[TensorMeta, ...]

    def to_wire(self) -> dict:
        return {"index": self.index, "nbytes": self.nbytes, "tensors": [t.to_wire() for t in self.tensors]}

    @classmethod
    def from_wire(cls, obj: dict) -> "BucketManifest":
        return cls(int(obj["index"]), int(obj["nbytes"]), tuple(TensorMeta.from_wire(r) for r in obj["tensors"]))


@dataclasses.dataclass(frozen=True)
class TransferEndpoint:
    """Where and how receivers join a sender; plain data so it crosses Ray and vLLM RPCs as a dict.

    ``world_size`` counts the sender (rank 0 of the group) and every engine worker; an engine's workers take
    ranks ``rank_offset .. rank_offset + workers - 1``.
    """

    mode: str
    host: str
    port: int
    world_size: int
    backend: str  # torch.distributed backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    group_name: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    check_equal: bool = False
    mode_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The mode's own init record (its ``ModeSpec.init_record``, e.g. p2p's Mooncake transport) as plain
    data; every other field is every mode's."""
    more_senders: tuple[dict[str, Any], ...] = ()
    """The other senders' endpoints (plain data, trainer rank order) when several trainer ranks send an
    update: a worker joins each one's group too, at the same rank (:mod:`rlplacement.transfer.multi_sender`)."""
    sender_per_worker: bool = False
    """Each sender's group is that sender and one engine worker (colocated: the trainer rank on the worker's
    GPU); worker ``i`` (group rank ``i + 1`` of the whole) joins sender ``i``'s group, at rank 1 there."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransferEndpoint":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True)
class UpdateReport:
    """What one side did in one update; ``checksums`` only when equality checking is on."""

    version: int
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float
    checksums: dict[str, str] | None = None
    path: str = ""  # how the bytes went, where a mode has more than one way ("buckets", "direct")
    instants: dict[str, float] = dataclasses.field(default_factory=dict)  # see Instants
    stream_collectives: int | None = None  # the trainer's collectives in its TP/PP groups to stream the weights
    fallback: str = ""  # why a resident update did not take the mode's in-place path ("" when it did or has none)
    transport: str = ""
    """What carried the bytes (the sender's :attr:`WeightSender.transport`); "" on a receiver's report."""
    bytes_per_sender: tuple[int, ...] = ()
    """Bytes each trainer rank sent, in rank order, when several sent this update (``()``: one sender, all of
    ``bytes``)."""

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    @property
    def metrics(self) -> dict[str, Any]:
        """The telemetry keys this update contributes to a step's row (a mode may add its own).
        ``transfer_transport`` is what carried the bytes: the advisor names the link from it, since
        the layout alone cannot tell NCCL over NVLink from gloo through host memory."""
        out: dict[str, Any] = {"perf/update_weights_bytes": self.bytes}
        if self.stream_collectives is not None:
            out["perf/update_collectives"] = self.stream_collectives
        if self.transport:
            out["transfer_transport"] = self.transport
        senders = self.bytes_per_sender or (self.bytes,)
        out["perf/update_weights_senders"] = len(senders)
        out["perf/update_weights_max_sender_bytes"] = max(senders)
        return out

    def merged_fields(self, reports: "Sequence[UpdateReport]") -> dict[str, Any]:
        """A mode's own fields of one update's report from its senders' (``reports``, this one first), where
        several trainer ranks each sent a share (``multi_sender.merge_sender_reports``); {}: none."""
        return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineUpdateReport:
    """One engine's side of one update: it serves ``version`` now (a failed update raises instead)."""

    engine_index: int
    version: int
    receive: float
    """Seconds its slowest worker spent receiving and staging."""
    load: float
    """Seconds its slowest worker spent loading the staged tensors into the served model."""
    instants: dict[str, float] = dataclasses.field(default_factory=dict)
    """The engine actor's :class:`Instants`."""
    worker_instants: tuple[dict[str, float], ...] = ()
    """Each worker's :class:`Instants`, in worker rank order."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateResult:
    """One version delivered to every engine: the trainer's report and each engine's, in engine order."""

    version: int
    trainer: UpdateReport
    engines: tuple[EngineUpdateReport, ...]
    checked: bool = False
    """Every engine's received checksums were compared with the trainer's and equal
    (``--check-weight-update-equal``): ``perf/update_weights_checked`` in telemetry."""


class Instants(dict):
    """Named instants of one update on one side, on the host's monotonic clock: ``time.monotonic``
    reads CLOCK_MONOTONIC, which every process of a Linux host shares, so the driver, the trainer and
    the engine workers of a colocated update line up on one axis and a benchmark can say where the
    time between them went. A mark costs well under a microsecond, so every update takes them."""

    def mark(self, name: str) -> None:
        self[name] = time.monotonic()


def tensor_checksum(tensor: "torch.Tensor") -> str:
    """xxh3-64 of the tensor's raw bytes in C order, as 16 hex digits.

    The same function runs on the trainer and in the engine, over the same bytes in the same
    order, so equal checksums mean equal bytes whatever the device, strides or dtype (bf16, fp8
    and bool included: bytes are hashed, not values). A GPU tensor streams to the hash through a
    reused pinned double buffer (xxh3's streaming digest equals its one-shot digest): a fresh
    pageable ``.cpu()`` copy per tensor is several times slower (benchmarks/README.md).
    """
    import torch
    import xxhash

    flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    if flat.device.type == "cuda":
        return _streamed_checksum(flat)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return xxhash.xxh3_64_hexdigest(flat.numpy().data)


CHECKSUM_CHUNK_BYTES = 64 * 1024 * 1024
_pinned_chunks: list = []  # two pinned host buffers per process, made on first use
_pinned_lock = threading.Lock()  # one checksum at a time uses them (a sender and a receiver may share a process)


def _streamed_checksum(flat: "torch.Tensor") -> str:
    """Copy chunk k+1 device -> pinned host while chunk k is hashed; a buffer is refilled only
    after its chunk was hashed (two buffers, strictly alternating)."""
    import torch
    import xxhash

    digest = xxhash.xxh3_64()
    stream = torch.cuda.current_stream(flat.device)
    pending = None  # (host buffer, length, event) copied but not hashed yet
    with _pinned_lock, torch.cuda.device(flat.device):
        if not _pinned_chunks:
            _pinned_chunks.extend(torch.empty(CHECKSUM_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                                  for _ in range(2))
        for k, start in enumerate(range(0, flat.numel(), CHECKSUM_CHUNK_BYTES)):
            length = min(CHECKSUM_CHUNK_BYTES, flat.numel() - start)
            host = _pinned_chunks[k % 2]
            host[:length].copy_(flat[start:start + length], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
            if pending is not None:
                _hash_pending(digest, pending)
            pending = (host, length, copied)
        if pending is not None:
            _hash_pending(digest, pending)
    return digest.hexdigest()


def _hash_pending(digest, pending) -> None:
    host, length, copied = pending
    copied.synchronize()
    digest.update(host[:length].numpy().data)


def hf_shaped(named_tensors: Iterable[NamedTensor], hf_shapes: HFShapes | None) -> Iterable[NamedTensor]:
    """The tensors in their HF shapes: those named in ``hf_shapes`` reshaped (a copy where the grouping
    is not a view), lazily, so a stream stays a stream."""
    if not hf_shapes:
        return named_tensors
    return ((n, t.reshape(hf_shapes[n]) if n in hf_shapes else t) for n, t in named_tensors)


class WeightSender(abc.ABC):
    """Trainer side: lives in a trainer rank holding the full HF-named tensors it sends (rank 0 alone, or each
    rank with its share where the mode spreads the sending: :mod:`rlplacement.transfer.multi_sender`).

    ``listen`` -> (engines join with the returned endpoint) ``connect`` -> ``update`` per step
    -> ``close``. ``update`` consumes ``named_tensors`` lazily, so a backend can gather and
    free bucket by bucket.
    """

    mode: ClassVar[str]

    @property
    @abc.abstractmethod
    def transport(self) -> str:
        """What carries this sender's bytes to the engines (its reports' ``UpdateReport.transport``, the
        telemetry's ``transfer_transport``): ``nccl`` (GPU to GPU), ``gloo`` (host memory over TCP), ``cuda
        ipc`` (a handle on the same GPU), ``shared memory`` (a /dev/shm mapping on the same host), ``mooncake
        tcp`` or ``mooncake rdma``, or ``file`` (a shared folder). The names are those of the modes'
        ``BenchSpec.transport``, so a bench row and a telemetry row of the same transfer agree."""

    @abc.abstractmethod
    def listen(self, world_size: int, *, host: str | None = None) -> TransferEndpoint: ...

    def keep_mapped_between_updates(self) -> bool:
        """Let receivers keep what they map of this process's memory from one update to the next (a
        trainer whose memory moves only at a hand-off, which first asks every engine to ``unmap``).
        True where this mode maps the trainer's memory and will do so; False (the default): nothing of
        this process is mapped elsewhere, so there is nothing to keep."""
        return False

    @property
    def mapped_elsewhere(self) -> bool:
        """Receivers may hold mappings of this process's memory now: freeing or moving it first needs
        every receiver's ``unmap`` and then :meth:`receivers_unmapped`."""
        return False

    def receivers_unmapped(self) -> None:
        """Every receiver has let go of its mappings (each called ``unmap``): the memory may move."""

    @abc.abstractmethod
    def connect(self) -> None: ...

    @abc.abstractmethod
    def update(self, version: int, named_tensors: Iterable[NamedTensor], *, resident: bool = False,
               hf_shapes: HFShapes | None = None) -> UpdateReport:
        """Send every tensor as version ``version``. ``resident``: the tensors are views of the
        trainer's own device memory that stays allocated and unchanged until this returns, so a mode
        may read them in place (``cuda_ipc``) instead of copying them first. ``hf_shapes``: resident
        tensors not in their HF shape (:data:`HFShapes`); a mode that does not read them in place
        sends them reshaped (:func:`hf_shaped`), so engines always receive HF shapes."""

    @abc.abstractmethod
    def close(self) -> None: ...


class WeightReceiver(abc.ABC):
    """Engine side, one per engine worker: join, then per update ``begin``/``receive``/``commit``.

    ``receive`` returns only when the whole update is staged and validated; nothing reaches the
    model before ``commit``. ``abort`` drops a staged update. ``version`` is what is served.

    Where the receiver is :attr:`bucketwise`, :meth:`receive_bucketwise` replaces ``receive``: each
    bucket goes to the engine's loader as it arrives and its memory is reused two buckets later, so a
    worker holds two buckets instead of the whole model; ``commit`` then only serves the version. The
    model is written before the update is known whole: an update that fails part-way leaves the
    engine's weights a mix, which the engine records and refuses to serve (``--update-weight-staging``).
    """

    mode: ClassVar[str]
    bucketwise: ClassVar[bool] = False
    """Can hand each bucket to the loader as it arrives (:meth:`receive_bucketwise`); agrees with its
    mode's ``ModeSpec.bucket_staging``."""
    last_path: str = ""
    """How the last update's bytes arrived, where a mode has more than one way (``cuda_ipc``: ``buckets``
    or ``direct``); also the ``path`` of :meth:`receive`'s report."""
    verified_checksums: dict[str, str] | None = None
    """This receiver's own checksums of the last update where they stand for the bytes the engine will
    serve (a checked direct ``cuda_ipc`` update reads the trainer's memory, which cannot change before
    the update is released); None: the engine hashes what was staged. Also the ``checksums`` of
    :meth:`receive`'s report."""

    @property
    def hashes_arrivals(self) -> bool:
        """Whether, with checks on, :attr:`verified_checksums` will hold what this update delivers as it
        arrived, so an engine loading it bucket by bucket need not hash the buckets it is handed: a worker
        keeping slices checks those."""
        return bool(self.keeps)

    accepts_slices: ClassVar[bool] = False
    """Can take only the slice of each tensor this worker keeps (:meth:`keep_slices`): the sender writes each
    worker its own bytes. Modes whose bytes reach every worker of a group at once (a broadcast) cannot."""
    keeps: "dict | None" = None
    """The slices this worker keeps (:data:`rlplacement.transfer.shards.Keeps`); None: every tensor whole."""

    @abc.abstractmethod
    def connect(self, endpoint: TransferEndpoint, rank: int) -> None: ...

    def keep_slices(self, keeps: "dict | None") -> None:
        """Receive only ``keeps``' slices from the next :meth:`connect` on (None: whole tensors); the receiver
        tells its sender at connect. Refused by modes that cannot (:attr:`accepts_slices`)."""
        if keeps and not self.accepts_slices:
            raise TransferError(f"mode {self.mode!r} sends every worker whole tensors; it cannot send slices")
        self.keeps = keeps or None

    @property
    def sliced(self) -> "dict[str, tuple]":
        """Tensors of the update staged last that arrived as this worker's slice: name -> (box, HF shape). The
        staged tensor has the HF shape, but only its box holds the tensor's bytes
        (:func:`rlplacement.transfer.slice_tensor.as_whole`)."""
        return {}

    @property
    def received_bytes(self) -> int:
        """Bytes of the last update that reached this receiver (its slices only, where it keeps slices)."""
        return 0

    @property
    def read_from(self) -> dict[str, int]:
        """Bytes of the last update this receiver read out of another process's memory, by the GPU that
        memory is on (:func:`~rlplacement.transfer.group.gpu_identity`; ``cuda_ipc``); empty in modes whose
        bytes are sent to it."""
        return {}

    @property
    def rank(self) -> int | None:
        """This receiver's rank in the transfer group (None before ``connect``)."""
        return None

    @property
    def mapped_allocations(self) -> int:
        """Allocations of the trainer the last update read in place (a direct ``cuda_ipc`` update); 0 for
        every update whose bytes were copied into this receiver's own buffers."""
        return 0

    def unmap(self) -> int:
        """Let go of the trainer's memory kept mapped between updates (before the trainer frees it);
        returns how many allocations were mapped. Only between updates; 0 where a mode maps nothing."""
        return 0

    @property
    def staging_bytes(self) -> int:
        """Bytes of staging memory this receiver keeps between updates (0 where a mode keeps none)."""
        return 0

    def release_staging(self) -> int:
        """Let kept staging buffers go before the engine sleeps (the next update allocates them again);
        returns the bytes let go. A mode that keeps none between updates has nothing to free."""
        return 0

    @abc.abstractmethod
    def begin(self, version: int) -> None: ...

    @abc.abstractmethod
    def receive(self) -> UpdateReport: ...

    def receive_bucketwise(self, apply_bucket: ApplyFn) -> UpdateReport:
        """Receive the update begun, handing each bucket's tensors to ``apply_bucket`` once it arrived and
        verified; nothing is kept. A bucket that fails its check, and every bucket after a failed
        ``apply_bucket``, is received but not applied, and the failure is raised once the update is off
        the wire (so no peer stalls)."""
        raise TransferError(f"mode {self.mode!r} stages whole updates: use --update-weight-staging full with it")

    @abc.abstractmethod
    def commit(self, apply: ApplyFn) -> int: ...

    @abc.abstractmethod
    def abort(self) -> None: ...

    @property
    @abc.abstractmethod
    def version(self) -> int: ...

    @property
    def staged_hf_shapes(self) -> HFShapes:
        """Staged tensors not in their HF shapes (:data:`HFShapes`), as the trainer holds them: only a
        direct ``cuda_ipc`` update stages such tensors; the engine copies them group by group."""
        return {}

    @abc.abstractmethod
    def close(self) -> None: ...
