"""Noise among a run's lines, dropped by name and only that: Ray's notice that token authentication is on (the
job keeps it on), vLLM's notice on LoRA tokenizers (the live adapter has none of its own); every other message
of those loggers, and their errors, still show. `rlplacement --help` renders docstring markup plainly."""

import logging
import types

import pytest

from rlplacement.console import (RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_NOTICE, VLLM_INPUT_LOGGER, drop_notices)


@pytest.fixture
def recorded():
    """The records that pass a logger's filters, from a handler on the logger itself."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    made = []

    def on(name: str) -> list[logging.LogRecord]:
        logger = logging.getLogger(name)
        handler = Keep(level=logging.DEBUG)
        logger.addHandler(handler)
        made.append((logger, handler, list(logger.filters)))
        return records

    yield on
    for logger, handler, filters in made:
        logger.removeHandler(handler)
        logger.filters[:] = filters


def test_ray_token_notice_is_dropped_and_nothing_else(recorded):
    records = recorded(RAY_TOKEN_AUTH_LOGGER)
    drop_notices(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_NOTICE)
    drop_notices(RAY_TOKEN_AUTH_LOGGER, RAY_TOKEN_AUTH_NOTICE)  # once per logger: a second call adds nothing
    logger = logging.getLogger(RAY_TOKEN_AUTH_LOGGER)
    assert sum(f.__class__.__name__ == "_DropNotices" for f in logger.filters) == 1
    from ray._private.authentication import authentication_token_setup as ray_auth

    ray_auth._warn_token_auth_enabled()  # Ray's own call, as ray.init makes it
    ray_auth._warn_token_auth_disabled()  # another notice of the same logger still shows
    logger.error(RAY_TOKEN_AUTH_NOTICE + " (as an error)")
    said = [r.getMessage() for r in records]
    assert len(said) == 2 and said[0].startswith("Token authentication is disabled") and "as an error" in said[1]


def test_vllm_lora_tokenizer_notice_is_dropped_once_an_adapter_is_requested(recorded):
    from vllm.v1.engine.input_processor import InputProcessor

    from rlplacement.engines.vllm.live_lora import lora_request

    records = recorded(VLLM_INPUT_LOGGER)
    request = lora_request()
    stand_in = types.SimpleNamespace(lora_config=object(), tokenizer=object())  # LoRA on, a base tokenizer
    InputProcessor._validate_lora(stand_in, request)  # vLLM's own check, which says the notice
    logging.getLogger(VLLM_INPUT_LOGGER).warning("another vLLM warning")
    assert [r.getMessage() for r in records] == ["another vLLM warning"]


def test_help_shows_no_docstring_markup():
    from rlplacement.cli import build_parser

    for argv in ([], ["plan"], ["convert"], ["export-hf"]):
        text = build_parser(argv).format_help()
        assert "``" not in text, text
    assert "rlplacement plan | convert | export-hf | advise | bench" in build_parser([]).format_help()
