"""What a job prints on its console while it starts: one line per start-up stage with its seconds, on
stderr, so a newcomer sees within seconds that Ray is starting, the engines are loading or the trainer
is being built, instead of a silent minute.

Verbosity is one setting, ``--verbose [quiet|normal|info]`` (``RolloutConfig.verbosity``): ``quiet``
prints no stage lines (scripts), ``normal`` (the default) prints them, ``info`` prints them and lets
vLLM and Ray log at INFO. Warnings and errors show at every level.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

VERBOSITY = ("quiet", "normal", "info")


class StartLog:
    """Stage lines of one job's start: ``stage(text)`` prints ``rlplacement: text (S.s s)`` with the seconds
    since the previous line (the first: since this log was made), and ``done`` the total."""

    def __init__(self, verbosity: str = "normal", stream: TextIO | None = None):
        self.enabled = verbosity != "quiet"
        self.stream = stream if stream is not None else sys.stderr
        self.started = self.last = time.monotonic()

    def say(self, text: str) -> None:
        """A line with no timing (what is about to happen)."""
        if self.enabled:
            print(f"rlplacement: {text}", file=self.stream, flush=True)

    def stage(self, text: str) -> None:
        now = time.monotonic()
        self.say(f"{text} ({now - self.last:.1f} s)")
        self.last = now

    def done(self, text: str) -> None:
        self.say(f"{text} after {time.monotonic() - self.started:.1f} s")
