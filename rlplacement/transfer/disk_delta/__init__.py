"""Mode ``disk-delta``: the trainer writes each version as per-tensor byte deltas into a shared
folder; engines are told to load version N and read it from there.

Data flow: trainer tensors -> diff against the bytes the engines hold (``delta_codec``) ->
``DIR/weight_v{N:06d}/`` (:mod:`.folder_format`: written, fsynced, published by renames) ->
``DIR/latest`` -> each engine worker reads, verifies and stages the full new tensors -> commit.
A worker that keeps slices (``transfer.shards``) publishes them in the folder at join; the sender adds
each slice's checksum to every index, and the worker decodes, checks and holds only its slices (a payload
is decompressed a few rows at a time up to the slice's last row: ``delta_codec.decode_slice``). Other workers read and hold every tensor whole.
:mod:`.sender` is the trainer side, :mod:`.receiver` the engine side.

Coordination: ``transfer_driver.run_update`` starts the trainer's ``update`` and the engines'
receive at once; a receiver waits (bounded by the endpoint's timeout) for ``latest`` to reach its
version as published by its own sender, or for that sender's ``DIR/abort_v{N:06d}.json``, which a
sender whose weight source failed writes so the engines stop at once instead of timing out. Over
the endpoint, ``group_name`` carries the folder (vLLM's init info has a fixed set of fields),
``backend`` is ``"file"`` and ``mode_info`` is :class:`DiskDeltaInit`: the run, epoch and sender the
receivers wait for and the key that signs every index (it travels only over the control plane,
never through the folder).

This package registers the mode's spec and options; its classes are in :mod:`.sender` and
:mod:`.receiver`, the folder's format in :mod:`.folder_format`.
"""

from __future__ import annotations

import dataclasses
import os

from rlplacement.errors import ConfigError
from rlplacement.transfer.delta_codec import ENCODINGS
from rlplacement.transfer.registry import register_mode
from rlplacement.transfer.spec import DISK, SPLIT, ModeSpec, OptionsBase, flag_field

MODE = "disk-delta"


@dataclasses.dataclass(frozen=True)
class DiskDeltaOptions(OptionsBase):
    """``disk_dir`` None: a fresh folder under the system temp dir (one host only; a run from the flags
    must name one). Set by the job, not flags: ``base_dir``, the HF checkpoint the engines started from
    (version 0; None makes the first version a keyframe); ``run_id``, the run's identity across its
    resumes ("": the sender makes a fresh random one); ``epoch``, how many times the run was resumed
    (a ``--load`` resume or a trainer restart; 0 for a fresh run). A (run_id, epoch) is one segment of
    the folder (:mod:`.folder_format`). ``sender_index``: set by the job where several trainer ranks send
    (each its share): this sender publishes in ``disk_dir/sender{i}``, a folder of its own with its own
    pointer, segments and key, and each engine worker reads every sender's folder (None: ``disk_dir``)."""

    disk_dir: str | os.PathLike | None = flag_field(
        "--update-weight-disk-dir", None, type=str, help="disk-delta: the folder every engine reads versions from.")
    delta_encoding: str = flag_field(
        "--update-weight-delta-encoding", "xor", type=str, choices=ENCODINGS,
        help="disk-delta encoding: xor (apply exactly once) or overwrite (idempotent).")
    base_dir: str | os.PathLike | None = None
    run_id: str = ""
    epoch: int = 0
    sender_index: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str):
            raise ConfigError(f"disk-delta run_id {self.run_id!r} must be a string (\"\": a fresh random one)")
        if isinstance(self.epoch, bool) or not isinstance(self.epoch, int) or self.epoch < 0:
            raise ConfigError(f"disk-delta epoch {self.epoch!r} must be an int >= 0 (the run's resumes so far)")
        if self.sender_index is not None and (isinstance(self.sender_index, bool)
                                              or not isinstance(self.sender_index, int) or self.sender_index < 0):
            raise ConfigError(f"disk-delta sender_index {self.sender_index!r} must be an int >= 0 or None")
        if self.delta_encoding not in ENCODINGS:
            raise ConfigError(f"--update-weight-delta-encoding {self.delta_encoding!r} is unknown: use one of "
                              f"{', '.join(ENCODINGS)}")

    def resolved(self, unset: frozenset[str], *, this_host: bool) -> "DiskDeltaOptions":
        if not self.disk_dir:
            raise ConfigError("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir: set it to a "
                              "folder every engine can read.")
        from rlplacement.atomic_files import check_writable

        check_writable(str(self.disk_dir), "--update-weight-disk-dir")  # the trainer writes there, from the start
        return self


@dataclasses.dataclass(frozen=True)
class DiskDeltaInit:
    """What every receiver needs from its sender, carried as ``TransferEndpoint.mode_info``: the segment
    it publishes (``run_id``, ``epoch``), its own id (``sender``: the pointer and abort markers it
    writes carry it, so a receiver never takes another sender's for its own) and ``key`` (hex), the
    HMAC-SHA256 key that signs every index and abort marker it writes. The key crosses only the control
    plane (Ray, vLLM's RPC), never the folder: whoever can only write the folder cannot sign."""

    run_id: str
    epoch: int
    sender: str
    key: str


SPEC = register_mode(ModeSpec(
    name=MODE, sender="rlplacement.transfer.disk_delta.sender:DiskDeltaSender",
    receiver="rlplacement.transfer.disk_delta.receiver:DiskDeltaReceiver",
    summary="per-tensor byte deltas written to a shared folder; engines read and verify each version",
    options=DiskDeltaOptions, init_record=DiskDeltaInit, layouts=frozenset({SPLIT}), advisor_path=DISK,
    advisor_efficiency=1.0,
    moves_changed_bytes_only=True, every_rank_sends=True, bench=None, verl_backend="rlplacement_disk_delta", miles_factory="disk_delta"))
