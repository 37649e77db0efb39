"""Rollout engine kinds by name: where the job's choice of engine is made. The registry of
:class:`~rlplacement.specs.engine.EngineSpec` is :mod:`rlplacement.specs.engine` (below the transfer plan and
the advisor, which read it too); this module is the same names plus :func:`engine_class`."""

from __future__ import annotations

from rlplacement.specs.engine import (BUILTIN_MODULES, DEFAULT_ENGINE_KIND, REGISTRY, EngineSpec,  # noqa: F401
                                      engine_spec, known_engines, register_engine, unregister_engine)


def engine_class(kind: str = DEFAULT_ENGINE_KIND):
    """The ``RolloutEngine`` subclass of ``kind``; an unknown kind is refused naming the known ones."""
    from rlplacement.engines.base import RolloutEngine

    spec = engine_spec(kind)
    cls = spec.engine_class()
    if not (isinstance(cls, type) and issubclass(cls, RolloutEngine)):
        raise TypeError(f"{spec.engine} (engine kind {kind!r}) is not a RolloutEngine subclass")
    return cls
