"""Weight-transfer flags: the ones every mode shares, then each registered mode's own (read from its
``ModeSpec.options``, so a mode's flags are defined once, where the mode is), and their validation."""

from __future__ import annotations

import argparse
import dataclasses

from rlplacement.args.common import TRANSFER_MODES, Flag, flag, get, require_choice, require_positive, size_in_bytes

MIB = 1 << 20
STAGING_CHOICES = ("auto", "full", "bucket")
SLICES_CHOICES = ("auto", "off")


def size_with_unit(text: str) -> int:
    """``--update-weight-buffer-size`` from the command line: a size with a unit, or a bare number of
    bytes of at least 1 MiB (a smaller bare number is a size written without its unit: ``512`` meant
    512 MiB, not 512 bytes). Values a program or a framework passes as ints are bytes, taken as they are."""
    value = size_in_bytes(text)
    if str(text).strip().isdigit() and value < MIB:
        raise argparse.ArgumentTypeError(
            f"{text} is {value} bytes, smaller than a bucket usefully is: write the unit, e.g. {text}MiB "
            f"(or {text}B if you mean bytes)")
    return value
from rlplacement.config import TransferConfig, default_of
from rlplacement.errors import ConfigError
from rlplacement.transfer import registry
from rlplacement.transfer.spec import ModeSpec, flag_dest

TITLE = "rlplacement: weight transfer"
SHARED_FLAGS = (
    flag("--update-weight-transfer-mode", type=str, default=default_of(TransferConfig, "requested_mode"),
         choices=TRANSFER_MODES,
         help="How weights reach the engines in a split layout. Under --colocate the "
              "in-GPU CUDA IPC path is used (broadcast modes only)."),
    flag("--update-weight-buffer-size", type=size_with_unit, default=default_of(TransferConfig, "bucket_bytes"),
         help="Bucket size with its unit (512MiB, 2GB, 64KiB); a bare number is bytes and must be at least 1 MiB. "
              "Where every trainer rank sends its share, each packs buckets of this size divided by the ranks "
              "(at least 1 MiB), so an engine worker holds the same bytes in flight whatever the senders."),
    flag("--update-weight-staging", type=str, default=default_of(TransferConfig, "staging"),
         choices=STAGING_CHOICES,
         help="What an engine worker holds of an update: full (the whole model; a failed update keeps the "
              "previous version served), bucket (two buckets, each loaded as it arrives; a failed update "
              "leaves the engine refusing to generate until a whole update lands), auto (full where it fits "
              "beside --vllm-gpu-memory-utilization, else bucket). Counted inside the engine's memory budget."),
    flag("--update-weight-slices", type=str, default=default_of(TransferConfig, "slices"), choices=SLICES_CHOICES,
         help="What each worker of a tensor-parallel engine receives: auto (only the slices its loader takes, "
              "where the mode and the model allow: p2p, broadcast, broadcast_packed and disk-delta, on GPU or CPU; "
              "whole tensors elsewhere), off (every tensor whole on every worker)."),
    flag("--check-weight-update-equal", action="store_true", default=default_of(TransferConfig, "check_equal"),
         help="After each update compare engine and trainer weights; raise on mismatch."),
)


def option_flag(field: dataclasses.Field) -> Flag:
    """The flag of one field of a mode's options (``spec.flag_field``)."""
    meta = field.metadata
    kwargs = {"type": meta["type"], "default": meta["flag_default"], "help": meta["help"]}
    if meta["choices"]:
        kwargs["choices"] = meta["choices"]
    return Flag((meta["flag"],), kwargs)


def flags() -> tuple[Flag, ...]:
    """The shared flags, then every registered mode's option flags, in registration order."""
    return SHARED_FLAGS + tuple(option_flag(f) for s in registry.specs().values() for f in s.option_fields)


def _mode_options(args: argparse.Namespace, spec: ModeSpec, *, resolve: bool, this_host: bool):
    """``spec``'s options from the flags, validated by its dataclass (every mode's flags are checked
    whichever mode runs); ``resolve``: the requested mode's, resolved for this run."""
    require_choice(args, tuple(flag_dest(f) for f in spec.option_fields if f.metadata["choices"]))
    given = {f.name: get(args, flag_dest(f)) for f in spec.option_fields}
    options = spec.build_options(given)
    if options is None or not resolve:
        return options
    return options.resolved(frozenset(name for name, value in given.items() if value is None), this_host=this_host)


def transfer_from_args(args: argparse.Namespace, *, this_host: bool = True) -> TransferConfig:
    require_positive(args, ("update_weight_buffer_size",))
    bucket_bytes = size_in_bytes(get(args, "update_weight_buffer_size"))
    require_choice(args, ("update_weight_transfer_mode",))
    mode = get(args, "update_weight_transfer_mode")
    colocate = bool(get(args, "colocate"))
    specs = registry.specs()
    if colocate and not specs[mode].named_under_colocate:
        usable = " or ".join(name for name, s in specs.items() if s.named_under_colocate)
        raise ConfigError(
            f"--update-weight-transfer-mode {mode} cannot be used with --colocate (the engines share the "
            f"trainer's GPUs and get weights by CUDA IPC): use {usable}, or drop --colocate.")
    options = None
    for name, spec in specs.items():
        built = _mode_options(args, spec, resolve=name == mode, this_host=this_host)
        if name == mode:
            options = built
    running = registry.colocated_mode() if colocate else mode
    return TransferConfig(mode=running, requested_mode=mode, bucket_bytes=bucket_bytes,
                          check_equal=bool(get(args, "check_weight_update_equal")),
                          staging=_staging(args, specs[running], colocate), slices=_slices(args), options=options)


def _slices(args: argparse.Namespace) -> str:
    require_choice(args, ("update_weight_slices",))
    return get(args, "update_weight_slices") or "auto"


def _staging(args: argparse.Namespace, spec: ModeSpec, colocate: bool) -> str:
    """``--update-weight-staging`` for the mode that runs: ``bucket`` refused by name where its receivers
    stage whole updates; ``auto`` there is ``full``."""
    require_choice(args, ("update_weight_staging",))
    staging = get(args, "update_weight_staging") or "auto"
    if spec.bucket_staging:
        return staging
    if staging == "bucket":
        able = ", ".join(n for n, s in registry.specs().items() if s.bucket_staging)
        why = (f"under --colocate the engines take updates through {spec.name}, which" if colocate
               else f"--update-weight-transfer-mode {spec.name}")
        raise ConfigError(f"--update-weight-staging bucket: {why} stages whole updates on each engine worker. "
                          f"Use --update-weight-staging full, or a split layout with one of: {able}.")
    return "full"
