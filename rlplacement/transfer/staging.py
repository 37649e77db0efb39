"""The engine side every mode shares: a receiver that stages a whole update before anything reaches
the model, so an engine serves its previous version whole until ``commit``.

:class:`StagingReceiver` owns the version plumbing (``begin`` refuses a version not newer than the
one served; ``receive`` stages and reports; ``commit`` hands the staged set to the engine's loader
and only then serves its version; ``abort`` and every failure inside ``receive`` drop the staged
set) and checksum verification. A mode implements one hook, :meth:`StagingReceiver._stage`: how
the bytes of one update arrive (broadcast frames, shared buffers, Mooncake writes, a version folder).
"""

from __future__ import annotations

import abc
import time
from typing import TYPE_CHECKING, Callable, ClassVar

from rlplacement.transfer.base import (ApplyFn, BucketManifest, Instants, NamedTensor, TransferEndpoint, TransferError,
                                       UpdateReport, WeightMismatchError, WeightReceiver, tensor_checksum)

if TYPE_CHECKING:
    import torch


class StagingReceiver(WeightReceiver):
    """begin -> receive (stage via :meth:`_stage`) -> commit | abort, with the served version."""

    mode: ClassVar[str]
    # why ``begin`` is refused before ``connect``, in the mode's words
    not_joined: ClassVar[str] = "the engine has not joined a transfer group"

    def __init__(self, device: "torch.device | str" = "cpu", *, version: int = 0):
        """``version`` is what the engine serves now (a receiver rebuilt after a reconnect keeps it)."""
        import torch

        self.device = torch.device(device)
        self._version = version
        self._pending: int | None = None
        self._rank: int | None = None
        self._staged: list[NamedTensor] | None = None
        self._received_bytes = 0
        self.instants = Instants()  # of the update begun last (``begin`` .. ``applied``)

    @property
    def version(self) -> int:
        return self._version

    @property
    def rank(self) -> int | None:
        return self._rank

    @property
    def received_bytes(self) -> int:
        return self._received_bytes

    @property
    def staged(self) -> list[NamedTensor] | None:
        """The complete update received by ``receive`` and not yet committed."""
        return self._staged

    @abc.abstractmethod
    def _joined(self) -> bool:
        """Whether ``connect`` has happened (and ``close`` has not)."""

    @abc.abstractmethod
    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        """Receive and validate version ``self._pending`` whole: ``(staged tensors, buckets or shards,
        bytes received)``. Raise on anything short of a complete, verified update."""

    def _check_endpoint(self, endpoint: TransferEndpoint, rank: int) -> None:
        if endpoint.mode != self.mode:
            raise TransferError(f"endpoint is for mode {endpoint.mode!r}, receiver is {self.mode!r}")
        if not 0 < rank < endpoint.world_size:
            raise TransferError(f"receiver rank {rank} outside 1..{endpoint.world_size - 1}")
        self._rank = rank

    def begin(self, version: int) -> None:
        if not self._joined():
            raise TransferError(f"begin() before connect(): {self.not_joined}")
        if version <= self._version:
            raise TransferError(f"update version {version} is not newer than the served version {self._version}")
        self.abort()
        self._pending = version
        self.instants = Instants()
        self.instants.mark("begin")

    def receive(self) -> UpdateReport:
        if self._pending is None:
            raise TransferError("receive() without begin(version)")

        def stage() -> tuple[list[NamedTensor], int, int, int]:
            staged, num_buckets, nbytes = self._stage()
            return staged, len(staged), num_buckets, nbytes

        return self._received(stage)

    def receive_bucketwise(self, apply_bucket: ApplyFn) -> UpdateReport:
        if self._pending is None:
            raise TransferError("receive_bucketwise() without begin(version)")
        if not self.bucketwise:
            return super().receive_bucketwise(apply_bucket)
        # nothing kept: every bucket is in the model, and commit only serves the version
        return self._received(lambda: ([], *self._stream(apply_bucket)))

    def _received(self, run: Callable[[], tuple[list[NamedTensor], int, int, int]]) -> UpdateReport:
        """``run()`` -> (what is staged, tensors, buckets, bytes) kept as the staged set and reported; a
        failure drops everything staged."""
        start = time.perf_counter()
        try:
            staged, num_tensors, num_buckets, nbytes = run()
        except BaseException:
            self.abort()
            raise
        self._staged, self._received_bytes = staged, nbytes
        self.instants.mark("staged")
        return UpdateReport(self._pending, num_tensors, num_buckets, nbytes, time.perf_counter() - start,
                            self.verified_checksums, self.last_path, dict(self.instants))

    def _stream(self, apply_bucket: ApplyFn) -> tuple[int, int, int]:
        """Receive version ``self._pending``, each bucket to ``apply_bucket`` as it arrives: ``(tensors,
        buckets, bytes)``. Only receivers that are :attr:`bucketwise` implement it."""
        raise NotImplementedError

    def commit(self, apply: ApplyFn) -> int:
        """Hand the staged update to ``apply`` (the engine's loader); on success serve its version. After
        :meth:`receive_bucketwise` the staged set is empty: the buckets are in the model already."""
        if self._staged is None or self._pending is None:
            raise TransferError("commit() without a fully received update")
        staged, version = self._staged, self._pending
        self._staged = self._pending = None
        apply(staged)
        self.instants.mark("applied")
        self.on_committed(version)
        return version

    def on_committed(self, version: int) -> None:
        """Serve ``version``: the bytes this receiver staged for it reached the model (through :meth:`commit`,
        or as one channel of an update several senders sent, ``multi_sender.MultiSenderReceiver``). A mode
        that keeps state per served version (disk-delta's held bytes) extends it."""
        self._version = version

    def abort(self) -> None:
        self._staged = self._pending = None

    @staticmethod
    def first_mismatch(manifest: BucketManifest, tensors: list[NamedTensor], where: str) -> WeightMismatchError | None:
        """The first tensor whose checksum differs from the one the trainer sent (None: all equal or unchecked)."""
        for meta, (name, tensor) in zip(manifest.tensors, tensors):
            if meta.checksum is not None:
                got = tensor_checksum(tensor)
                if got != meta.checksum:
                    return WeightMismatchError(name, meta.checksum, got, where)
        return None

