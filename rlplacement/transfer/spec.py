"""What a transfer mode is, for every layer that must know: one frozen :class:`ModeSpec` per mode,
registered by the mode's package where it is defined (``rlplacement.transfer.registry``).

The flags (``rlplacement.args``), the config, ``plan --emit verl|miles``, the verl and Miles plug-ins,
the advisor and ``rlplacement bench`` read the specs and keep no per-mode tables, so a new mode is one
package under ``transfer/``. A mode's own options are a frozen dataclass whose fields carry their flag
(:func:`flag_field`): the flag table is built from them, and a framework's per-backend options use the
same names with underscores.

Torch-free: ``rlplacement.args`` and ``rlplacement plan`` import it without torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

LINK, DISK, IPC = "link", "disk", "ipc"
"""The advisor's paths: the cluster's links (NVLink inside a node, the network across nodes), a shared
disk, or a CUDA IPC handle on the same GPU."""

SPLIT, COLOCATE = "split", "colocate"
"""Layouts a mode serves (``ModeSpec.layouts``)."""

RANK0, SHARES, OWN_GPU = "rank 0", "shares", "own gpu"
"""Who sends an update (:meth:`ModeSpec.who_sends`): trainer rank 0 sends every tensor to every engine worker
(the other ranks help it gather); every rank sends its share, each in a group of its own with every worker
(:mod:`rlplacement.transfer.multi_sender`); or each rank with an engine worker on its own GPU hands that
worker the whole update (colocated), so no engine reads another GPU's trainer memory."""

UNSET = object()
"""A flag default of :func:`flag_field` meaning: the flag is unset unless given, and the mode resolves
the value on each host (``OptionsBase.resolved``), not from the dataclass default."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """How ``rlplacement bench`` measures a mode against the raw transfer of the same bytes."""

    ceiling: str
    """The raw transfer that is the mode's ceiling: ``broadcast`` (one flat broadcast on the same
    transport), ``copy`` (one raw copy on the sender's device) or ``mooncake`` (one raw Mooncake batch
    write between the same processes)."""
    device: str = "wire"
    """Where the sender's tensors live: ``wire`` (the broadcast device: NCCL GPU to GPU with two GPUs,
    else gloo), ``same`` (the receiver on the sender's own device, as colocated) or ``cpu``."""
    transport: dict[str, str] = dataclasses.field(default_factory=lambda: {"cpu": "gloo", "cuda": "nccl"})
    """What a row measured, by the sender's device type."""
    resident: bool = False
    """Send the bench's tensors as resident (a mode may read them in place)."""
    copies_at_commit: bool = False
    """The receiver commits into tensors of its own, as an engine loads its parameters (a mode whose
    one copy happens at commit would otherwise time no bytes)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """One transfer mode: its classes, options, layouts, and what the advisor, ``bench`` and the
    verl/Miles plug-ins need of it."""

    name: str
    """The mode's name: a ``--update-weight-transfer-mode`` value, or the colocated path's own."""
    sender: str
    """``"module:Class"`` of its :class:`~rlplacement.transfer.base.WeightSender`, imported when used."""
    receiver: str
    """``"module:Class"`` of its :class:`~rlplacement.transfer.base.WeightReceiver`, imported when used."""
    summary: str
    """One line for the flag's help and the docs."""
    options: type | None = None
    """Its own options: a frozen dataclass of :func:`flag_field` fields (None: the mode has none)."""
    init_record: type | None = None
    """A dataclass of what receivers need from the sender beyond every mode's endpoint fields, carried as
    ``TransferEndpoint.mode_info`` (None: nothing)."""
    layouts: frozenset[str] = frozenset({SPLIT})
    """Layouts it serves: :data:`SPLIT` (named by the flag) and/or :data:`COLOCATE` (picked by ``--colocate``)."""
    named_under_colocate: bool = False
    """May be named with ``--colocate``: the colocated path runs instead, and a plug-in that emits a split
    layout uses the named mode. Other split modes are refused with ``--colocate``."""
    advisor_path: str = LINK
    """The path the advisor models its bytes on: :data:`LINK`, :data:`DISK` or :data:`IPC`."""
    advisor_efficiency: float = 0.5
    """Achieved share of that path's bandwidth, an estimate (the measured run's own figure wins)."""
    measured_efficiency: tuple[tuple[str, float], ...] = ()
    """Achieved share of a link kind's datasheet rate where a GPU run measured it, as ``(kind, share)``
    pairs (kinds of :mod:`rlplacement.transfer.plan.simulate`: ``nvlink``, ``network``, ``ipc``); the
    transfer simulator uses them before :attr:`advisor_efficiency`."""
    bucket_staging: bool = False
    """Its receivers can commit each bucket into the served weights as it arrives
    (``--update-weight-staging bucket``: an engine worker holds two buckets, not the whole model);
    its receiver class says the same (``WeightReceiver.bucketwise``)."""
    every_rank_sends: bool = False
    """A trainer of several ranks sends with every rank, each its share in a group of its own
    (:mod:`rlplacement.transfer.multi_sender`); False: trainer rank 0 sends the whole update."""
    reads_own_gpu: bool = False
    """Colocated with a trainer of several ranks, each engine worker takes the update from the trainer rank
    on its own GPU, which holds every tensor in turn; False: every worker reads trainer rank 0's memory."""
    moves_changed_bytes_only: bool = False
    """Only the bytes that changed since the last version travel (the advisor scales by the density)."""
    bench: BenchSpec | None = None
    """How ``rlplacement bench`` measures it; None: no bench row."""
    verl_backend: str | None = None
    """Its verl checkpoint-engine backend name (None: not offered to verl)."""
    miles_factory: str | None = None
    """Its factory's name in ``rlplacement.integrations.miles`` (None: not offered to Miles)."""

    def who_sends(self, *, colocate: bool) -> str:
        """:data:`SHARES` in split layouts of a mode that :attr:`every_rank_sends`, :data:`OWN_GPU` under
        ``--colocate`` for a mode that :attr:`reads_own_gpu`, else :data:`RANK0` (also what a one-rank
        trainer does whatever this says). What runs (``RLJob.senders``) and what the simulator prices as
        running (``plan.for_layout.plans_for``) both ask this."""
        if colocate:
            return OWN_GPU if self.reads_own_gpu else RANK0
        return SHARES if self.every_rank_sends else RANK0

    def sender_class(self) -> type:
        return _load(self.sender)

    def receiver_class(self) -> type:
        return _load(self.receiver)

    @property
    def option_fields(self) -> tuple[dataclasses.Field, ...]:
        """The fields of :attr:`options` that are flags."""
        if self.options is None:
            return ()
        return tuple(f for f in dataclasses.fields(self.options) if "flag" in f.metadata)

    def build_options(self, given: dict[str, Any]) -> Any:
        """Its options from flag values by field name (None: unset, the field's default), validated by
        the dataclass; None for a mode without options."""
        if self.options is None:
            return None
        return self.options(**{k: v for k, v in given.items() if v is not None})


def _load(path: str) -> type:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def flag_field(flag: str, default: Any, *, help: str, type: Callable | None = None,
               choices: tuple | None = None, flag_default: Any = None) -> Any:
    """A field of a mode's options that is the flag ``flag``: its default, help, argparse type and
    choices. ``flag_default`` :data:`UNSET`: the flag's own default is None and the mode resolves an
    unset value itself (``OptionsBase.resolved``)."""
    metadata = {"flag": flag, "help": help, "type": type, "choices": choices,
                "flag_default": None if flag_default is UNSET else default}
    return dataclasses.field(default=default, metadata=metadata)


def flag_dest(field: dataclasses.Field) -> str:
    """The argparse dest of an options field's flag (``--p2p-protocol`` -> ``p2p_protocol``)."""
    return field.metadata["flag"].lstrip("-").replace("-", "_")


class OptionsBase:
    """What a mode's options dataclass may add to plain validation (in its ``__post_init__``)."""

    def resolved(self, unset: frozenset[str], *, this_host: bool) -> "OptionsBase":
        """The options as this run uses them, checked against what only a run needs (a required
        folder) and with unset fields (``unset``: field names whose flag was not given) resolved on
        this host where ``this_host``; raise ``ConfigError`` naming the flag. The default: as given."""
        return self
