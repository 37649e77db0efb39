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

This package exposes the two classes the registry names and the folder format's public names.
"""

from rlplacement.transfer.disk_delta.folder_format import (  # noqa: F401
    INDEX_NAME, MODE, abort_marker, index_checksum, read_checkpoint_bytes, read_pointer, read_safetensors_bytes,
    version_folder)
from rlplacement.transfer.disk_delta.receiver import DiskDeltaReceiver  # noqa: F401
from rlplacement.transfer.disk_delta.sender import DeltaUpdateReport, DiskDeltaSender  # noqa: F401
