"""Mode ``disk-delta``: the trainer writes each version as per-tensor byte deltas into a shared
folder; engines are told to load version N and read it from there.

Data flow: trainer tensors -> diff against the bytes the engines hold (``delta_codec``) ->
``DIR/weight_v{N:06d}/`` (:mod:`.folder_format`: written, fsynced, published by renames) ->
``DIR/latest`` -> each engine worker reads, verifies and stages the full new tensors -> commit.
:mod:`.sender` is the trainer side, :mod:`.receiver` the engine side.

Coordination: ``transfer_driver.run_update`` starts the trainer's ``update`` and the engines'
receive at once; a receiver waits (bounded by the endpoint's timeout) for ``latest`` to reach its
version, or for ``DIR/abort_v{N:06d}.json``, which a sender whose weight source failed writes so
the engines stop at once instead of timing out. Over the endpoint, ``group_name`` carries the
folder (vLLM's init info has a fixed set of fields) and ``backend`` is ``"file"``.

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
    must name one). ``base_dir``: the HF checkpoint the engines started from (version 0), set by the job,
    not a flag; None makes the first version a keyframe."""

    disk_dir: str | os.PathLike | None = flag_field(
        "--update-weight-disk-dir", None, type=str, help="disk-delta: the folder every engine reads versions from.")
    delta_encoding: str = flag_field(
        "--update-weight-delta-encoding", "xor", type=str, choices=ENCODINGS,
        help="disk-delta encoding: xor (apply exactly once) or overwrite (idempotent).")
    base_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
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


SPEC = register_mode(ModeSpec(
    name=MODE, sender="rlplacement.transfer.disk_delta.sender:DiskDeltaSender",
    receiver="rlplacement.transfer.disk_delta.receiver:DiskDeltaReceiver",
    summary="per-tensor byte deltas written to a shared folder; engines read and verify each version",
    options=DiskDeltaOptions, layouts=frozenset({SPLIT}), advisor_path=DISK, advisor_efficiency=1.0,
    moves_changed_bytes_only=True, bench=None, verl_backend="rlplacement_disk_delta", miles_factory="disk_delta"))
