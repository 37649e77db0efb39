"""The rollout-engine kinds, by name: where the job's choice of engine is made. A new kind is one module
with a :class:`~rlplacement.engines.base.RolloutEngine` subclass, plus its line here."""

from __future__ import annotations

import importlib

from rlplacement.errors import ConfigError

ENGINE_KINDS = {"vllm": ("rlplacement.engines.vllm.vllm_engine", "VllmRolloutEngine")}
"""kind -> (module, class); the module is imported only when its kind is used."""

DEFAULT_ENGINE_KIND = "vllm"


def engine_class(kind: str = DEFAULT_ENGINE_KIND):
    """The ``RolloutEngine`` subclass of ``kind``; an unknown kind is refused naming the known ones."""
    from rlplacement.engines.base import RolloutEngine

    if kind not in ENGINE_KINDS:
        raise ConfigError(f"no rollout engine kind {kind!r}: use one of {', '.join(sorted(ENGINE_KINDS))}")
    module, name = ENGINE_KINDS[kind]
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise TypeError(f"{module}.{name} (engine kind {kind!r}) is not a RolloutEngine subclass")
    return cls
