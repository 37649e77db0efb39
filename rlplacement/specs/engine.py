"""What a rollout engine kind is, for every layer that must know: one frozen :class:`EngineSpec` per kind,
registered where the engine is defined (:func:`register_engine`), and the registry of them by name.

The job (``job_start``: the engine's keywords), the transfer plan (``transfer.plan.for_layout``: what each
worker keeps) and the advisor's memory model (``advisor.memory``) read the spec, so a new engine kind is
one package that registers one spec (from outside ``rlplacement`` too, through the ``rlplacement.plugins``
entry points: :mod:`rlplacement.specs`).

The built-in specs (the vLLM kind's, in ``rlplacement.engines.vllm``) are imported on the first lookup, then those of
installed packages. The registry sits below every layer that reads it (the transfer plan and the advisor
too), so it names the engines' modules only as strings; every ``"module:name"`` field is imported only when
used: the spec itself is torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlplacement.specs import SpecRegistry, load_object


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One rollout engine kind: its class, its keywords from the rollout settings, and what the transfer
    plan and the advisor model of its workers."""

    name: str
    """The kind's name (``RLJob.start(engine_kind=...)``)."""
    engine: str
    """``"module:Class"`` of its :class:`~rlplacement.engines.base.RolloutEngine` subclass."""
    summary: str
    """One line for the docs."""
    engine_kwargs: str
    """``"module:function"`` called as ``f(rollout_config)``: the engine class's keywords that the rollout
    settings (``rlplacement.config.RolloutConfig``) make."""
    worker_needs: str
    """``"module:function"`` called as ``f(model, width)``: per worker of a ``width``-GPU engine, the box of
    every HF tensor it keeps (``transfer.plan``'s boxes); a width it cannot shard the model over raises
    ``ValueError`` naming the flag."""
    worker_weight_bytes: str
    """``"module:function"`` called as ``f(model, width)``: the served weights one worker holds, in bytes."""

    def engine_class(self) -> type:
        return load_object(self.engine)

    def call(self, field: str, *args: Any, **kwargs: Any) -> Any:
        """Call the ``"module:function"`` of ``field``."""
        return load_object(getattr(self, field))(*args, **kwargs)


DEFAULT_ENGINE_KIND = "vllm"
BUILTIN_MODULES = ("rlplacement.engines.vllm",)

REGISTRY: SpecRegistry[EngineSpec] = SpecRegistry(
    "rollout engine kind", BUILTIN_MODULES,
    unknown=lambda kind, known: f"no rollout engine kind {kind!r}: use one of {', '.join(known)}")


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Add ``spec`` (its package calls this where the spec is defined); a name taken already raises."""
    return REGISTRY.register(spec)


def unregister_engine(kind: str) -> None:
    """Remove a kind (a plug-in's going away; a test's stand-in after the test)."""
    REGISTRY.unregister(kind)


def known_engines() -> list[str]:
    return sorted(REGISTRY.specs())


def engine_spec(kind: str = DEFAULT_ENGINE_KIND) -> EngineSpec:
    """The spec of ``kind``; an unknown kind is refused naming the known ones."""
    return REGISTRY.get(kind)
