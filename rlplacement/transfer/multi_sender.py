"""Several trainer ranks sending one update: an engine worker joins one group per sender and takes the
update from all of them at once; the sender reports merge into one.

Each sending trainer rank runs its mode's ordinary sender on its share of the tensors (the backend's
``iter_update_tensors(SHARES)``), in a group of its own with every engine worker: the groups
share nothing, so the senders never wait on one another and no byte is forwarded through rank 0.
The first sender's endpoint carries the others' (``TransferEndpoint.more_senders``).

Colocated (``OWN_GPU``, ``TransferEndpoint.sender_per_worker``), each sender's group is that trainer rank
and the one engine worker on its GPU, and the rank sends the whole update: a worker joins its own sender's
group only (:func:`own_sender`) with the mode's own receiver. Each engine still commits on all its workers
or none; engines in different groups may end a failed update on different versions (the job then sends the
next update to all of them).

:class:`MultiSenderReceiver` is one engine worker's side: one receiver of the mode per sender (a
*channel*), each run in its own thread, and every bucket handed to the engine's loader from the
calling thread, one at a time (vLLM's loaders keep thread-local state, and a bucketwise load is not
safe to enter twice). The update is one update: it is whole only when every channel reached its END,
and a failure on any channel fails it, raised once every channel is off the wire, so no sender stalls.
Under bucket staging the first failed bucket stops the loading on every channel.

Senders may send *pieces* (:mod:`rlplacement.transfer.pieces`: each FSDP rank its rows of every tensor, each
Megatron rank what its TP shards are of them): the buckets pass through a
:class:`~rlplacement.transfer.pieces.PieceAssembler` before the loader, which sees each tensor, or this
worker's slice of it, once every sender's piece of it arrived. Under full staging the assembled tensors are
the staged update (the channels' buffers hold the pieces besides: at most a worker's share twice); under
bucket staging a tensor's buffer is let go once it is loaded, and a channel's bucket is held (its channel
waits) until every tensor it brought pieces of is whole, so a sender that runs ahead of the others waits for
them instead of filling the worker with tensors it started. Each sender's bucket is then half its share of
``--update-weight-buffer-size`` (:func:`sender_bucket_size`): the channels' two buffers each hold one bucket
of that size, and the tensors assembling from the buckets held, while the senders keep pace, the other. A
fused group larger than half a bucket goes alone in each sender's bucket: a worker then holds up to three
times it (its pieces in the channels' two buffers, and the group assembling).

Why held buckets cannot deadlock: every sender sends its pieces in one order common to all senders (the
model's), and every worker receives each sender's buckets in the order sent. A held bucket waits only for
pieces later in another sender's order than what that sender has brought, so of all held buckets on all
workers, the one whose last tensor comes first in the model's order waits for nothing held: it is released.
Should every running channel of a worker be held (senders of another order, an update short of pieces),
all are released, and the update's end names any tensor left short.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

from rlplacement.transfer.base import (ApplyFn, NamedTensor, TransferEndpoint, TransferError, UpdateReport,
                                       WeightReceiver)
from rlplacement.transfer.pieces import PieceAssembler, is_piece, parse_piece
from rlplacement.transfer.staging import StagingReceiver

if TYPE_CHECKING:
    import torch

def sender_endpoints(endpoint: TransferEndpoint) -> list[TransferEndpoint]:
    """Every sender's endpoint, in trainer rank order: ``endpoint`` and those it carries."""
    return [dataclasses.replace(endpoint, more_senders=(), sender_per_worker=False)] + [
        TransferEndpoint.from_dict(d) for d in endpoint.more_senders]


def with_more_senders(endpoints: Sequence[dict], *, per_worker: bool = False) -> dict:
    """The endpoint engines join (plain data): the first sender's, carrying the others'; ``per_worker``: each
    sender's group holds one engine worker (:attr:`TransferEndpoint.sender_per_worker`)."""
    first = dict(endpoints[0])
    first["more_senders"] = [dict(e) for e in endpoints[1:]]
    first["sender_per_worker"] = per_worker
    return first


def own_sender(endpoint: TransferEndpoint, rank: int) -> tuple[TransferEndpoint, int]:
    """The group an engine worker of group rank ``rank`` joins, and its rank there: ``endpoint`` as it is, or,
    where each sender serves one worker (:attr:`TransferEndpoint.sender_per_worker`), worker ``rank - 1``'s
    sender, at rank 1."""
    if not endpoint.sender_per_worker:
        return endpoint, rank
    endpoints = sender_endpoints(endpoint)
    if not 1 <= rank <= len(endpoints):
        raise TransferError(f"engine worker rank {rank}: the endpoint has senders for worker ranks 1 to "
                            f"{len(endpoints)}")
    return endpoints[rank - 1], 1


def receiver_for(mode_class: type, endpoint: TransferEndpoint, device, *, version: int) -> WeightReceiver:
    """A receiver of ``mode_class`` for ``endpoint``: the mode's own for one sender (or a sender of its own,
    :func:`own_sender`), else one channel per sender."""
    if endpoint.more_senders and not endpoint.sender_per_worker:
        return MultiSenderReceiver(mode_class, len(endpoint.more_senders) + 1, device, version=version)
    return mode_class(device, version=version)


MIN_SENDER_BUCKET = 1 << 20


def sender_bucket_size(bucket_bytes: int, num_senders: int, *, pieces: bool = False) -> int:
    """Each sender's bucket when ``num_senders`` share an update: ``--update-weight-buffer-size`` divided
    among them (at least 1 MiB), so an engine worker under bucket staging, which holds two buckets per
    sender in flight, holds two of ``bucket_bytes`` whatever the number of senders. ``pieces``: the senders
    send pieces (``transfer.pieces``), which the worker assembles into tensors beside the channels' buffers
    (a tensor is up to ``num_senders`` times one sender's piece of it, while the buckets bringing its pieces
    are held): half that share, so the channels' buffers take one of the two buckets and, while the senders
    keep pace (a sender ahead of the others waits for them), the tensors assembling the other. A tensor
    larger than a bucket still goes alone, as with one sender."""
    if num_senders <= 1:
        return bucket_bytes
    return max(MIN_SENDER_BUCKET, bucket_bytes // (num_senders * (2 if pieces else 1)))


def merge_sender_reports(reports: Sequence[UpdateReport], *, whole_each: bool = False) -> UpdateReport:
    """One update's trainer report from every sender's (in sender order): the slowest sender's time, checksums
    merged, the first sender's instants, and each sender's bytes in ``bytes_per_sender``. Counts and bytes are
    summed over the shares, or, with ``whole_each`` (every sender sent the whole update to the workers of its
    group), the update's own, which every sender's checksums must then agree on."""
    if len(reports) == 1:
        return reports[0]
    first = reports[0]
    checksums = None
    if all(r.checksums is not None for r in reports):
        checksums = {}
        for r in reports:
            if whole_each and r.checksums != first.checksums:
                name = next(n for n in first.checksums if r.checksums.get(n) != first.checksums[n])
                raise TransferError(f"the senders streamed different bytes for {name!r}: every trainer rank must "
                                    f"hold the same weights")
            checksums.update(r.checksums)
    collectives = [r.stream_collectives for r in reports if r.stream_collectives is not None]
    count = max if whole_each else sum
    return dataclasses.replace(
        first, num_tensors=count(r.num_tensors for r in reports), num_buckets=count(r.num_buckets for r in reports),
        bytes=count(r.bytes for r in reports), seconds=max(r.seconds for r in reports), checksums=checksums,
        stream_collectives=max(collectives) if collectives else None,
        fallback=next((r.fallback for r in reports if r.fallback), ""),
        bytes_per_sender=tuple(r.bytes for r in reports), **first.merged_fields(reports))


class MultiSenderReceiver(StagingReceiver):
    """One engine worker's receiver of an update sent by several trainer ranks: a channel (the mode's own
    receiver) per sender, run concurrently; the update is staged, verified and committed as one."""

    mode: ClassVar[str] = ""

    def __init__(self, mode_class: type, num_senders: int, device: "torch.device | str" = "cpu", *,
                 version: int = 0):
        super().__init__(device, version=version)
        self.mode = mode_class.mode
        self.bucketwise = mode_class.bucketwise
        self.accepts_slices = mode_class.accepts_slices
        self.channels: list[StagingReceiver] = [mode_class(device, version=version) for _ in range(num_senders)]
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._joined_all = False
        self._check_equal = False
        self._staged_pieces = PieceAssembler(None, keep_buffers=True)  # full staging's assembled tensors
        self._assembler = self._staged_pieces  # the last update's
        self._piece_sums: dict[str, str] | None = None  # checksums of what arrived whole, where no slice is kept

    def _joined(self) -> bool:
        return self._joined_all

    def connect(self, endpoint: TransferEndpoint, rank: int) -> None:
        endpoints = sender_endpoints(endpoint)
        if len(endpoints) != len(self.channels):
            raise TransferError(f"the endpoint names {len(endpoints)} senders, this receiver was made for "
                                f"{len(self.channels)}")
        self._check_endpoint(endpoints[0], rank)
        self._joined_all = False
        self._check_equal = endpoints[0].check_equal
        for channel, e in zip(self.channels, endpoints):  # every member joins the groups in this order
            channel.connect(e, rank)
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(len(self.channels), thread_name_prefix="rlp-channel")
        self._joined_all = True

    def keep_slices(self, keeps: dict | None) -> None:
        super().keep_slices(keeps)
        for channel in self.channels:
            channel.keep_slices(keeps)

    @property
    def sliced(self) -> dict[str, tuple]:
        """HF name -> (kept box, whole shape) of every tensor that reached the loader as a slice."""
        out = {}
        for channel in self.channels:
            for name, where in channel.sliced.items():
                if is_piece(name):
                    base, _, shape = parse_piece(name)
                    name, where = base, (self.keeps[base], shape)
                out[name] = where
        return out

    @property
    def hashes_arrivals(self) -> bool:
        """With checks on, a worker keeping no slices sums every tensor and piece as it arrives (below)."""
        return bool(self.keeps) or self._check_equal

    @property
    def verified_checksums(self) -> dict[str, str] | None:
        """Every channel's own checksums where each has them (channels that keep slices do); at a worker
        keeping no slices, with checks on, the checksum of every tensor and piece as it arrived (what the
        senders' reports hold: where pieces came, no sender had a whole tensor to sum)."""
        if self._piece_sums is not None:
            return dict(self._piece_sums)
        sums = [channel.verified_checksums for channel in self.channels]
        return None if any(s is None for s in sums) else {k: v for s in sums for k, v in s.items()}

    def begin(self, version: int) -> None:
        super().begin(version)
        for channel in self.channels:
            channel.begin(version)

    def abort(self) -> None:
        super().abort()
        for channel in self.channels:
            channel.abort()

    def on_committed(self, version: int) -> None:
        """Every channel's share reached the model with the whole: each serves ``version`` too (disk-delta's
        channels then hold the bytes their next delta applies to)."""
        super().on_committed(version)
        for channel in self.channels:
            channel.on_committed(version)

    def _stage(self) -> tuple[list[NamedTensor], int, int]:
        self._assembler = self._begin_pieces(self._staged_pieces)
        results = self._run_all(lambda channel, _: channel._stage())
        staged = self._assembler.feed([pair for r in results for pair in r[0]])
        self._assembler.finish()
        return staged, sum(r[1] for r in results), sum(r[2] for r in results)

    def _stream(self, apply_bucket: ApplyFn) -> tuple[int, int, int]:
        assembler = self._assembler = self._begin_pieces(PieceAssembler(self.keeps, keep_buffers=False))

        def apply_assembled(tensors: list[NamedTensor]) -> set[str]:
            ready = assembler.feed(tensors)
            if ready:
                apply_bucket(ready)
            return assembler.waiting_on(tensors)

        results = self._run_all(lambda channel, relay: channel._stream(relay), apply_assembled, assembler)
        assembler.finish()
        return tuple(sum(r[i] for r in results) for i in range(3))

    def _begin_pieces(self, assembler: PieceAssembler) -> PieceAssembler:
        """``assembler`` set for this update: this worker's keeps, and, with checks on where the channels keep
        no slices (they then check nothing themselves), a fresh dict for the checksums of what arrives."""
        assembler.keeps = self.keeps or {}
        self._piece_sums = {} if self._check_equal and not self.keeps else None
        assembler.begin(self._piece_sums)
        return assembler

    def _run_all(self, job: Callable[[StagingReceiver, ApplyFn], tuple], apply_bucket: Callable | None = None,
                 assembler: PieceAssembler | None = None) -> list:
        """``job(channel, relay)`` for every channel at once, where ``relay`` queues a bucket here and waits
        until this thread handed it to ``apply_bucket``, and, where that returns the names of tensors the bucket
        brought pieces of that are not whole yet, until ``assembler`` has them whole (the module's docstring
        says why this cannot deadlock). Returns the results in channel order, or, once every channel finished,
        raises the first bucket the loader refused, else the first channel's failure."""
        requests: queue.Queue = queue.Queue()
        stopped: list[BaseException] = []  # the first failed apply: later buckets are received, not applied

        def relay(tensors: list[NamedTensor]) -> None:
            done, outcome = threading.Event(), []
            requests.put((tensors, done, outcome))
            done.wait()
            if outcome:
                raise outcome[0]

        futures = [self._pool.submit(job, channel, relay) for channel in self.channels]
        for future in futures:
            future.add_done_callback(lambda _: requests.put(None))
        running = len(futures)
        held: list[tuple[set[str], threading.Event]] = []  # buckets waiting for their tensors to be whole
        while running:
            request = requests.get()  # each channel's own group bounds how long it can take
            if request is None:
                running -= 1
            else:
                tensors, done, outcome = request
                waiting = None
                try:
                    if stopped:
                        raise TransferError(f"not loaded: an earlier bucket of this update failed ({stopped[0]})")
                    waiting = apply_bucket(tensors)
                except BaseException as exc:  # noqa: BLE001 - raised in the channel, which defers it to its END
                    if not stopped:
                        stopped.append(exc)
                    outcome.append(exc)
                if waiting:
                    held.append((waiting, done))
                else:
                    done.set()
            if held:
                still = [h for h in held if any(map(assembler.is_pending, h[0]))]
                failed = any(f.done() and f.exception() is not None for f in futures)
                if stopped or failed or len(still) >= running:  # nothing left to make them whole: let all go
                    still = []
                for names, done in held:
                    if not any(done is d for _, d in still):
                        done.set()
                held = still
        failures = [f.exception() for f in futures if f.exception() is not None]
        if failures:  # the refused bucket itself, not the "not loaded" of the buckets after it
            raise stopped[0] if stopped else failures[0]
        return [f.result() for f in futures]

    @property
    def assembly_peak_bytes(self) -> int:
        """The most the tensors assembling from pieces held at once in the last update."""
        return self._assembler.peak_bytes

    @property
    def staging_bytes(self) -> int:
        return sum(c.staging_bytes for c in self.channels) + self._staged_pieces.nbytes

    def release_staging(self) -> int:
        return sum(c.release_staging() for c in self.channels) + self._staged_pieces.release()

    def close(self) -> None:
        self._joined_all = False
        for channel in self.channels:
            channel.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
