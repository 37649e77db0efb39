"""Mode ``p2p``: the trainer writes each bucket straight into every engine worker's staging memory
with the Mooncake Transfer Engine (RDMA in production, TCP where RDMA is missing: the same protocol).
A worker that keeps slices (a tensor-parallel engine's, :mod:`rlplacement.transfer.shards`)
is written only its region of each bucket; every other worker the whole bucket.

Control runs over the private gloo group of ``group.py`` (as ``cuda_ipc``); bytes go by Mooncake.
Per bucket, in the same order on every rank:

1. the sender broadcasts the bucket's header and manifest (the ``broadcast`` wire);
2. every receiver takes its staging buffer for the bucket (kept across updates, registered with
   its TransferEngine once) and all ranks sum an int64 vector holding each receiver's address:
   the sender learns where to write (an engine restarted since registers fresh memory, and its
   new address is what gets written to: never a stale registration);
3. the sender issues one batched asynchronous write per receiver (the bucket in slices), packs the
   next bucket into its other registered slot while they fly, then waits for every write;
4. all ranks sum a status vector: the sender's entry is non-zero when a write failed or did not
   finish within ``--p2p-transfer-timeout``; it then sends ABORT, so every engine keeps its
   previous version and the trainer raises naming the engine worker and the bucket.

Replay (steady state, ``--update-weight-staging full``): an update after one that went bucket by bucket
starts with a REPLAY frame naming the last update's bucket count; every receiver that still holds each of
those buckets' staging buffer, registered and at the address it gave, accepts (one all-reduce of refusals).
Then the sender packs and writes each bucket whose layout (``layout_key``: names, dtypes, shapes, offsets)
is the last update's straight to the addresses learned then, with no collective per bucket, and sends END
once every write landed, carrying the bucket count and the checksums (if on). At the first bucket whose
layout differs, a REPLAYED frame closes the replayed part and the rest goes bucket by bucket. A refusal
(bucket staging, whose two buffers are reused as the model loads them; a buffer regrown or dropped) sends
the whole update bucket by bucket. An update is 4 collectives whatever its bucket count (REPLAY, the
refusals, END and its blob), against 3 per bucket.

Receivers verify checksums (``--check-weight-update-equal``) and commit through the same
stage-then-commit path as the other modes. Session ids (``ip:port``, metadata ``P2PHANDSHAKE``:
no metadata server) are exchanged once per group through the group's rendezvous store.

:mod:`.mooncake` wraps the TransferEngine, :mod:`.sender` and :mod:`.receiver` hold the two classes;
this package registers the spec, its options and its init record (the transport every receiver
initialises).
"""

from __future__ import annotations

import dataclasses
import json
import os

from rlplacement.errors import ConfigError
from rlplacement.transfer.registry import register_mode
from rlplacement.transfer.spec import LINK, SPLIT, UNSET, BenchSpec, ModeSpec, OptionsBase, flag_field

PROTOCOLS = ("tcp", "rdma")
KIND_REPLAY, KIND_REPLAYED = 7, 8
"""p2p's own frames beside the framed wire's: the offer to replay the last update's buckets (aux: their
count), and the end of a replay that goes on bucket by bucket (aux: tensors so far; blob: JSON bucket count
and checksums)."""


def layout_key(manifest) -> str:
    """A bucket's layout without its checksums: equal keys, equal bytes at equal places."""
    return json.dumps([manifest.index, manifest.nbytes,
                       [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in manifest.tensors]])
DEFAULT_TRANSFER_TIMEOUT_S = 30.0


def rdma_device_present() -> bool:
    """True when this host has an RDMA device (what ``--p2p-protocol`` defaults to ``rdma`` on)."""
    root = "/sys/class/infiniband"
    return os.path.isdir(root) and bool(os.listdir(root))


@dataclasses.dataclass(frozen=True)
class P2POptions(OptionsBase):
    """``protocol``: the Mooncake transport; ``transfer_timeout_s``: how long one bucket's writes may take."""

    protocol: str = flag_field(
        "--p2p-protocol", "tcp", type=str, choices=PROTOCOLS, flag_default=UNSET,
        help="Mooncake transport for p2p: rdma where this host has an RDMA device, else tcp (the default picks "
             "so; a value you set is kept, and rdma without a device is refused).")
    transfer_timeout_s: float = flag_field(
        "--p2p-transfer-timeout", DEFAULT_TRANSFER_TIMEOUT_S, type=float,
        help="Seconds one p2p bucket's writes may take before the update is failed.")

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"--p2p-protocol {self.protocol!r} is unknown: use one of {', '.join(PROTOCOLS)}")
        if self.transfer_timeout_s <= 0:
            raise ConfigError(f"--p2p-transfer-timeout must be positive, got {self.transfer_timeout_s}: set "
                              f"--p2p-transfer-timeout to a value above 0.")

    def resolved(self, unset: frozenset[str], *, this_host: bool) -> "P2POptions":
        if not this_host:
            return self
        if "protocol" in unset:
            return dataclasses.replace(self, protocol="rdma" if rdma_device_present() else "tcp")
        if self.protocol == "rdma" and not rdma_device_present():
            raise ConfigError("--p2p-protocol rdma: this host has no RDMA device (/sys/class/infiniband is empty): "
                              "use --p2p-protocol tcp, or run where the RDMA NICs are.")
        return self


@dataclasses.dataclass(frozen=True)
class P2PInit:
    """What every receiver needs from the sender: the Mooncake transport to initialise."""

    protocol: str = "tcp"


SPEC = register_mode(ModeSpec(
    name="p2p", sender="rlplacement.transfer.p2p.sender:P2PSender",
    receiver="rlplacement.transfer.p2p.receiver:P2PReceiver",
    summary="the trainer writes each bucket into every engine worker's staging memory with Mooncake (RDMA or TCP)",
    options=P2POptions, init_record=P2PInit, layouts=frozenset({SPLIT}), advisor_path=LINK, bucket_staging=True,
    every_rank_sends=True,
    # 0.82-0.85 of a raw Mooncake TCP write on CPU; no RDMA run yet: an estimate
    advisor_efficiency=0.5,
    bench=BenchSpec(ceiling="mooncake", device="cpu", transport={"cpu": "mooncake tcp", "cuda": "mooncake tcp"}),
    verl_backend="rlplacement_p2p", miles_factory="p2p"))
