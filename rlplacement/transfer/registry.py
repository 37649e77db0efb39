"""Mode name -> :class:`~rlplacement.transfer.spec.ModeSpec`. A mode's package registers its spec when
imported (:func:`register_mode`); the built-in packages are imported on the first lookup, in the
order ``--update-weight-transfer-mode`` offers them, then the modes of installed packages (the
``rlplacement.plugins`` entry points, :mod:`rlplacement.specs`). Unknown names raise ``ConfigError``,
listing the known ones: there is no default mode here (the flag's default lives in the config).

Torch-free: a mode package's ``__init__`` defines its spec and options and imports its sender and
receiver only when they are asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlplacement.specs import SpecRegistry
from rlplacement.transfer.spec import COLOCATE, SPLIT, ModeSpec

BUILTIN_PACKAGES = ("rlplacement.transfer.broadcast", "rlplacement.transfer.broadcast_packed",
                    "rlplacement.transfer.p2p", "rlplacement.transfer.disk_delta", "rlplacement.transfer.cuda_ipc")


def _check_layouts(spec: ModeSpec) -> None:
    if not spec.layouts or not spec.layouts <= {SPLIT, COLOCATE}:
        raise ValueError(f"transfer mode {spec.name!r}: layouts must be a non-empty subset of {{{SPLIT!r}, {COLOCATE!r}}}")


REGISTRY: SpecRegistry[ModeSpec] = SpecRegistry(
    "transfer mode", BUILTIN_PACKAGES, check=_check_layouts, module_of=lambda s: s.sender.partition(":")[0],
    unknown=lambda name, known: (f"transfer mode {name!r} is unknown: use one of {', '.join(known)} "
                                 f"(--update-weight-transfer-mode)"))
"""The modes: :mod:`rlplacement.specs`' rules (built-ins imported on the first lookup, then the
``rlplacement.plugins`` entry points; a taken name refused)."""
_SPECS = REGISTRY._specs  # the registered modes by name, as registered (tests remove one to see it refused)


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add ``spec`` (its package calls this where the spec is defined); a name taken already raises."""
    return REGISTRY.register(spec)


def unregister_mode(name: str) -> None:
    """Remove a mode (a plug-in's going away; a test's dummy mode after the test)."""
    REGISTRY.unregister(name)


def specs() -> dict[str, ModeSpec]:
    """Every registered mode: the built-in ones in :data:`BUILTIN_PACKAGES` order (whichever package was
    imported first), then the others in the order they registered."""
    return REGISTRY.specs()


def spec(mode: str) -> ModeSpec:
    return REGISTRY.get(mode)


def workers_take_slices(mode: str, engine_width: int, slices: str = "auto") -> bool:
    """Each worker of an ``engine_width``-wide engine receives only its slices under ``mode``: the mode's
    receivers take slices (``WeightReceiver.accepts_slices``), the engine is wider than one GPU and
    ``--update-weight-slices`` is ``auto``. An engine's own settings may still give whole tensors (pipeline or
    expert parallelism, a model the rules do not know: ``engines.vllm.vllm_backend``)."""
    return slices == "auto" and engine_width > 1 and receiver_class(mode).accepts_slices


def selectable_modes() -> tuple[str, ...]:
    """The modes a user may name with ``--update-weight-transfer-mode`` (those serving split layouts)."""
    return tuple(name for name, s in specs().items() if SPLIT in s.layouts)


def colocated_mode() -> str:
    """The mode ``--colocate`` runs (the one registered for colocated layouts)."""
    found = [name for name, s in specs().items() if COLOCATE in s.layouts]
    if len(found) != 1:
        raise ValueError(f"exactly one transfer mode must serve colocated layouts, found {found or 'none'}")
    return found[0]


def sender_class(mode: str) -> type:
    return spec(mode).sender_class()


def receiver_class(mode: str) -> type:
    return spec(mode).receiver_class()


def sender_options(transfer_config, mode: str, base_dir: str | None = None, *, run_id: str = "",
                   epoch: int = 0, sender_index: int | None = None) -> dict[str, Any]:
    """The keyword arguments ``mode``'s sender takes from a ``rlplacement.config.TransferConfig``: the
    fields of its options (a sender takes them by name and builds its options dataclass again, which
    validates them), from the flags, or the mode's defaults when the config was built for another mode;
    where the options have such fields, what the job knows and no flag says: ``base_dir`` (the
    checkpoint the engines started from), ``run_id`` (the run's identity across resumes; "" leaves the
    mode's own choice), ``epoch`` (how many times the run was resumed) and ``sender_index`` (which of
    several sending trainer ranks this is; None: the only one)."""
    s = spec(mode)
    if s.options is None:
        return {}
    options = transfer_config.options if isinstance(transfer_config.options, s.options) else s.options()
    kwargs = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    if base_dir is not None and "base_dir" in kwargs:
        kwargs["base_dir"] = base_dir
    if run_id and "run_id" in kwargs:
        kwargs["run_id"] = run_id
    if "epoch" in kwargs:
        kwargs["epoch"] = epoch
    if "sender_index" in kwargs:
        kwargs["sender_index"] = sender_index
    return kwargs
