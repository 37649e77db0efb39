"""Every rlplacement flag, defined once, and the one place they are validated.

``add_arguments(parser)`` adds the flags to any argparse parser (a Megatron or Miles
``extra_args_provider`` included) and skips flags the parser already has, so an RL codebase that
already defines ``--colocate`` keeps its own definition. ``config_from_args(args)`` turns parsed
args into the frozen configs of :mod:`rlplacement.config` and raises :class:`ConfigError` naming the
flag and what to change. Defaults are the configs' own (read from their fields), a transfer mode's
flags are its options' fields (``rlplacement.transfer.spec``), and the names a choice flag accepts
are read from its registry when asked, so a backend or transfer mode registered after import is
offered and accepted like the built-in ones.

One module per group of flags (:mod:`.placement`, :mod:`.transfer`, :mod:`.backend`, :mod:`.train`,
:mod:`.rollout`, :mod:`.optim`, :mod:`.tracking`, :mod:`.fault_tolerance`,
:mod:`.async_rollout`), each with its flags and its ``*_from_args``.

Invariant: validation never rewrites a value the user set. Values the user left unset are derived
(``--rollout-num-gpus`` under ``--colocate`` is the trainer's GPU count) and the derivation is
recorded in the config, not written back into ``args``.
"""

from __future__ import annotations

import argparse
from typing import Any

from rlplacement.args import async_rollout, backend, fault_tolerance, optim, placement, rollout, tracking, train, transfer
from rlplacement.args.async_rollout import async_rollout_from_args
from rlplacement.args.backend import backend_from_args
from rlplacement.args.fault_tolerance import fault_tolerance_from_args
from rlplacement.args.common import (TRAIN_BACKENDS, TRANSFER_MODES, ArgumentParser, Flag,  # noqa: F401
                                     RegistryChoices, size_in_bytes)
from rlplacement.args.optim import optim_from_args
from rlplacement.args.placement import placement_from_args
from rlplacement.args.rollout import rollout_from_args
from rlplacement.args.tracking import tracking_from_args
from rlplacement.args.train import train_from_args
from rlplacement.args.transfer import transfer_from_args
from rlplacement.config import Config
from rlplacement.errors import ConfigError
from rlplacement.transfer import registry as transfer_registry

__all__ = ["add_arguments", "add_flag", "build_parser", "flag_default", "config_from_args", "require_available",
           "placement_from_args", "transfer_from_args", "backend_from_args", "train_from_args", "optim_from_args",
           "rollout_from_args", "tracking_from_args", "fault_tolerance_from_args", "async_rollout_from_args"]


def flag_groups() -> tuple[tuple[str, tuple[Flag, ...]], ...]:
    """(group title, flags), in the order ``--help`` shows them. Names and defaults follow Miles so users
    need not relearn them. Built when asked: a transfer mode registered later brings its flags."""
    return ((placement.TITLE, placement.FLAGS), (transfer.TITLE, transfer.flags()), (backend.TITLE, backend.FLAGS),
            (train.TITLE, train.FLAGS), (rollout.TITLE, rollout.FLAGS), (optim.TITLE, optim.FLAGS),
            (tracking.TITLE, tracking.FLAGS), (fault_tolerance.TITLE, fault_tolerance.FLAGS),
            (async_rollout.TITLE, async_rollout.FLAGS))


def all_flags() -> tuple[Flag, ...]:
    return tuple(f for _, flags in flag_groups() for f in flags)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every rlplacement flag that ``parser`` does not already have; return ``parser``."""
    existing = set(parser._option_string_actions)  # argparse keeps no public view of this
    for title, flags in flag_groups():
        missing = [f for f in flags if not existing.intersection(f.names)]
        if not missing:
            continue
        group = parser.add_argument_group(title)
        for f in missing:
            group.add_argument(*f.names, **f.kwargs)
    return parser


def add_flag(parser: argparse.ArgumentParser, name: str, **overrides: Any) -> None:
    """Add one flag of the table to a subcommand's parser: its names, type and default stay the
    table's, so a flag shared with a subcommand (``convert``'s TP/PP sizes) is defined once;
    ``overrides`` may only reword how it is shown (``help``, ``metavar``)."""
    if set(overrides) - {"help", "metavar"}:
        raise ValueError(f"{name}: only help and metavar may differ from the flag table")
    found = next((f for f in all_flags() if name in f.names), None)
    if found is None:
        raise KeyError(f"{name} is not an rlplacement flag")
    parser.add_argument(*found.names, **{**found.kwargs, **overrides})


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    return add_arguments(ArgumentParser(prog=prog))


def flag_default(dest: str) -> Any:
    """The default of our flag whose dest is ``dest``."""
    for f in all_flags():
        if f.dest == dest:
            return f.kwargs.get("default")
    raise KeyError(dest)


def config_from_args(args: argparse.Namespace, *, this_host: bool = True) -> Config:
    """Validate parsed args and return frozen configs; raise ConfigError before any work starts.

    ``this_host=False`` (``rlplacement plan``, which describes a cluster from anywhere) skips the
    checks that read this machine: whether it has an RDMA device for ``--p2p-protocol``, whether wandb or a
    TensorBoard writer is installed for ``--use-wandb``/``--use-tensorboard``."""
    placement_config = placement_from_args(args)
    backend_config = backend_from_args(args, placement_config)
    train_config = train_from_args(args, placement_config, backend_config)
    return Config(placement=placement_config, transfer=transfer_from_args(args, this_host=this_host),
                  backend=backend_config, train=train_config, optim=optim_from_args(args),
                  rollout=rollout_from_args(args), tracking=tracking_from_args(args, this_host=this_host),
                  fault_tolerance=fault_tolerance_from_args(args, train_config),
                  async_rollout=async_rollout_from_args(args, placement_config))


def require_available(config: Config) -> None:
    """Refuse, before any process starts, a config whose transfer mode this build does not register (a
    config built by hand, or before a mode was unregistered); flags parsed here were checked already."""
    mode, colocate = config.transfer.mode, config.placement.colocate
    known = transfer_registry.specs()
    if mode not in known:
        raise ConfigError(
            f"weight transfer {mode!r} (from --update-weight-transfer-mode{' and --colocate' if colocate else ''}) "
            f"is not available in this build: use one of {', '.join(sorted(known))}"
            f"{' in a split layout (drop --colocate)' if colocate else ''}.")
