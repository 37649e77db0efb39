"""What a job prints on its console while it starts: one line per start-up stage with its seconds, on
stderr, so a newcomer sees within seconds that Ray is starting, the engines are loading or the trainer
is being built, instead of a silent minute.

Verbosity is one setting, ``--verbose [quiet|normal|info]`` (``RolloutConfig.verbosity``): ``quiet``
prints no stage lines (scripts), ``normal`` (the default) prints them, ``info`` prints them and lets
vLLM and Ray log at INFO. Warnings and errors show at every level.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

VERBOSITY = ("quiet", "normal", "info")

RAY_TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."
"""Ray says this at every ``ray.init()`` that starts a local cluster with its default token authentication,
which the job keeps on purpose (``placement.ray_groups.connect``): nothing for the user to do."""
VLLM_INPUT_LOGGER = "vllm.v1.engine.input_processor"
VLLM_LORA_TOKENIZER_NOTICE = "vLLM has deprecated support for supporting different tokenizers for different LoRAs."
"""vLLM says this at the first request naming an adapter; the live adapter is tensors alone, served with
the base model's tokenizer, so the notice never applies."""


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


class _DropNotices(logging.Filter):
    """Drops the records below ERROR whose message starts with one of ``prefixes``; passes every other."""

    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not str(record.msg).startswith(self.prefixes)


def drop_notices(logger_name: str, *prefixes: str) -> None:
    """In this process, drop the messages of logger ``logger_name`` that start with one of ``prefixes`` (each a
    named notice above; the logger's other messages still show). A logger's filter sees the records made on
    it, whatever handlers the library installs later. Installed once per logger and prefixes."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _DropNotices) and f.prefixes == prefixes for f in logger.filters):
        logger.addFilter(_DropNotices(prefixes))
