"""``rlplacement plan | convert | export-hf | advise | bench``.

Each subcommand lives in the module that owns its work and exposes ``add_parser(subparsers)``
and ``main(args) -> int``; they are imported only when chosen, so ``plan`` needs neither Ray
nor torch. A :class:`ConfigError` (or a ``CliError``) exits 2 with its message, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from rlplacement.args.common import ArgumentParser
from rlplacement.errors import CliError, ConfigError

# subcommand -> module holding add_parser(subparsers) and main(args)
SUBCOMMANDS = {
    "plan": "rlplacement.plan_cli",
    "convert": "rlplacement.convert.cli",
    "export-hf": "rlplacement.convert.export_cli",
    "advise": "rlplacement.advisor.cli",
    "bench": "rlplacement.bench",
}


def plain(text: str) -> str:
    """Docstring markup shown as plain text in ``--help``: reST's double backquotes around code dropped."""
    return re.sub(r"``([^`]+)``", r"\1", text)


def _chosen(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="rlplacement", description=plain(__doc__.splitlines()[0]))
    sub = parser.add_subparsers(dest="command", required=True, metavar="|".join(SUBCOMMANDS))
    chosen = _chosen(argv)
    for name, module in SUBCOMMANDS.items():
        if name == chosen:
            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=f"see `rlplacement {name} --help`")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return int(module.main(args) or 0)
    except (ConfigError, CliError) as exc:
        print(f"rlplacement {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
