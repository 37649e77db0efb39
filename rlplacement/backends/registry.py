"""Backend name -> :class:`~rlplacement.backends.spec.BackendSpec`. A backend registers its spec where it is
defined (:func:`register_backend`); the built-in specs are imported on the first lookup, then those of
installed packages (the ``rlplacement.plugins`` entry points, :mod:`rlplacement.plugins`). A backend's
class is imported only when it is built, so each backend's dependencies stay optional and the names can
be checked (preflight, ``--train-backend``) without importing torch."""

from __future__ import annotations

from rlplacement.backends.spec import BackendSpec
from rlplacement.plugins import SpecRegistry

BUILTIN_MODULES = ("rlplacement.backends.builtin_specs",)

REGISTRY: SpecRegistry[BackendSpec] = SpecRegistry(
    "trainer backend", BUILTIN_MODULES,
    unknown=lambda name, known: f"--train-backend {name!r} is unknown: use one of {', '.join(known)}")


def register_backend(spec: BackendSpec) -> BackendSpec:
    """Add ``spec`` (its package calls this where the spec is defined); a name taken already raises."""
    return REGISTRY.register(spec)


def unregister_backend(name: str) -> None:
    """Remove a backend (a plug-in's going away; a test's dummy backend after the test)."""
    REGISTRY.unregister(name)


def known_backends() -> list[str]:
    """The registered backends' names, sorted."""
    return sorted(REGISTRY.specs())


def backend_spec(name: str) -> BackendSpec:
    """The spec registered as ``name``; an unknown name raises ``ConfigError`` naming ``--train-backend``."""
    return REGISTRY.get(name)


def backends_with(feature: str) -> list[str]:
    """The registered backends whose spec has ``feature`` (a boolean field of :class:`BackendSpec`), sorted:
    what a refusal of that feature offers instead."""
    return sorted(name for name, s in REGISTRY.specs().items() if getattr(s, feature))


def spoken(names: list[str], word: str = "or") -> str:
    """``a``, ``a or b``, ``a, b or c``: names as a message offers them."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def backend_class(name: str):
    """The backend class registered as ``name`` (imports its module)."""
    return backend_spec(name).backend_class()
