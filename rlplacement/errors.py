"""User-facing errors every layer may raise; a leaf module (imports nothing) so no subcommand,
backend or library module has to import the CLI root or the flag table to raise one.

Both are printed by ``rlplacement`` without a traceback, exit status 2.
"""


class ConfigError(ValueError):
    """A flag combination that cannot run; the message names the flag and what to change."""


class CliError(Exception):
    """A user-facing error of a subcommand (bad subcommand-only input)."""
