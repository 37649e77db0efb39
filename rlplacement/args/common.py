"""The flag table's building blocks and the checks every group's validation shares.

``get`` reads a flag's value, falling back to the table's default where another parser owns the
namespace and lacks the flag; ``require_positive``/``require_choice``/``require_set`` refuse a value
naming the flag, since a framework's namespace or options dict reaches us without argparse's checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
from typing import Any, Callable, Iterable

from rlplacement.errors import ConfigError
from rlplacement.specs import backend as backend_registry
from rlplacement.transfer import registry as transfer_registry


class RegistryChoices:
    """A choice flag's accepted names, read from a registry each time argparse (or validation) asks."""

    def __init__(self, names: Callable[[], Iterable[str]]):
        self._names = names

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, value: object) -> bool:
        return value in tuple(self._names())


# registered modes a user may name (those serving split layouts; --colocate picks the colocated one)
TRANSFER_MODES = RegistryChoices(transfer_registry.selectable_modes)
TRAIN_BACKENDS = RegistryChoices(backend_registry.known_backends)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag: its names (the first is the canonical one) and argparse's keywords."""

    names: tuple[str, ...]
    kwargs: dict[str, Any]

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")


def flag(*names: str, **kwargs: Any) -> Flag:
    return Flag(names, kwargs)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser that answers a misspelled flag with the flag it most resembles ("did you
    mean"), its subcommands' parsers too (argparse makes them of this class)."""

    def error(self, message: str):
        hints = []
        if "unrecognized arguments:" in message:
            known = sorted(_option_strings(self))
            for given in re.findall(r"(?<!\S)(--?[A-Za-z][\w-]*)", message.partition("unrecognized arguments:")[2]):
                close = difflib.get_close_matches(given, known, n=1, cutoff=0.75)
                if close:
                    hints.append(f"{given}: did you mean {close[0]}?")
        super().error("; ".join([message, *hints]))


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    names = set(parser._option_string_actions)  # argparse keeps no public view of this
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= _option_strings(sub)
    return names


def size_in_bytes(text: str | int) -> int:
    """A byte count from the command line: a bare number is bytes (Miles' own flag takes bytes); a unit
    may follow: B, KB, MB, GB (powers of 1000) or KiB, MiB, GiB (powers of 1024), e.g. ``512MiB``."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.I)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write bytes with a unit, e.g. 512MiB or 2GB")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}[unit]
    return int(number * scale)


def get(args: argparse.Namespace, dest: str) -> Any:
    """Flags another parser owns may be missing from ``args``; fall back to our default."""
    if hasattr(args, dest):
        return getattr(args, dest)
    from rlplacement.args import flag_default

    return flag_default(dest)


def require_positive(args: argparse.Namespace, dests: Iterable[str]) -> None:
    for dest in dests:
        value = get(args, dest)
        if value is not None and value <= 0:
            name = "--" + dest.replace("_", "-")
            least = "1 or more" if isinstance(value, int) else "a value above 0"
            raise ConfigError(f"{name} must be positive, got {value}: set {name} to {least}.")


def require_choice(args: argparse.Namespace, dests: Iterable[str]) -> None:
    """argparse checks ``choices`` only in parsers we built; a foreign parser or a framework's
    options dict reaches us unchecked."""
    from rlplacement.args import all_flags

    for f in all_flags():
        if f.dest in dests and "choices" in f.kwargs:
            value = get(args, f.dest)
            if value is not None and value not in f.kwargs["choices"]:
                raise ConfigError(f"{f.names[0]} {value!r} is unknown: use one of {', '.join(f.kwargs['choices'])}.")


def require_set(args: argparse.Namespace, dest: str) -> Any:
    """A value the run cannot do without: a foreign parser may define the flag with no default (Megatron's
    ``--lr`` is None); say what to set instead of failing later."""
    value = get(args, dest)
    if value is None:
        name = "--" + dest.replace("_", "-")
        raise ConfigError(f"{name} is unset (the parser that defines it gives it no default): set {name}.")
    return value
