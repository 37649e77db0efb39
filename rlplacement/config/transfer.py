"""How weights reach the engines after every optimizer step: the settings every transfer mode shares."""

from __future__ import annotations

import dataclasses
from typing import Any


DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferConfig:
    """How weights reach the engines after every optimizer step: the settings every mode shares, and the
    requested mode's own options (its ``ModeSpec.options`` dataclass, ``rlplacement.transfer.spec``)."""

    mode: str
    """The transfer mode that runs: the colocated one (``cuda_ipc``) under ``--colocate``, else ``requested_mode``."""
    requested_mode: str = "broadcast"
    """What ``--update-weight-transfer-mode`` asked for (under ``--colocate`` a mode the colocated path
    replaces; a framework plug-in emitting a split layout uses it)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Bucket size in bytes: tensors are packed into buckets of at most this (a larger tensor goes alone)."""
    check_equal: bool = False
    """After every update, compare per-tensor checksums of trainer and engines; a mismatch fails the update."""
    staging: str = "auto"
    """What an engine worker holds of an update (``--update-weight-staging``): ``full``, the whole model,
    loaded only once it all arrived (a failed update leaves the previous version served); ``bucket``, two
    buckets, each loaded as it arrives (a failed update leaves the engine refusing to generate until a
    whole update lands); ``auto``, ``full`` where it fits beside the engine's budget, else ``bucket``, decided
    by each engine on its GPU (``engines.engine_settings.resolve_engine_memory``). ``auto`` with a mode whose
    receivers stage whole updates is ``full``."""
    slices: str = "auto"
    """What a worker of a tensor-parallel engine receives (``--update-weight-slices``): ``auto``, only the slices
    its loader takes where the mode, the model and the engine allow (``transfer.shards``: no pipeline stages,
    a family the plan knows; every load checks that the loader read exactly the slices,
    ``transfer.slice_tensor``); ``off``, every tensor whole (the way out should a loader read outside its
    slices)."""
    options: Any = None
    """``requested_mode``'s options (a frozen dataclass, validated and resolved for this run: disk-delta's
    folder, p2p's transport); None for a mode that has none."""
