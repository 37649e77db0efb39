"""One way to register what a job may be built from, shared by its three axes: trainer backends
(:mod:`rlplacement.specs.backend`), rollout engine kinds (:mod:`rlplacement.specs.engine`) and transfer
modes (:mod:`rlplacement.transfer.registry`). The backend and engine registries live here, below the
layers that read them (the transfer plan, the advisor), and name the backends' and engines' modules only
as strings; a transfer mode's lives in the transfer layer, which is all that reads it from below.

Each axis keeps one :class:`SpecRegistry` of frozen specs keyed by name. Its rules:

- a spec is registered by the module that defines it, when that module is imported; a name taken
  already is refused (two packages must not silently replace each other's spec);
- the axis's built-in modules are imported on the registry's first lookup, never before, so importing
  a registry costs nothing and a spec's heavy parts stay behind its ``"module:Class"`` strings;
- after them, every entry point of the group :data:`ENTRY_POINT_GROUP` is imported once per process:
  each names a module outside ``rlplacement`` that registers its specs (of any axis) on import. The
  lookup that triggers this runs in every process that builds something by name (the driver, each
  trainer rank's Ray actor, each engine's processes), so an installed package's specs are seen in all
  of them, where a registration call made only in the driver would not be;
- an unknown name is refused with a :class:`~rlplacement.errors.ConfigError` naming the flag and the
  known names.

Torch-free: the flags and ``rlplacement plan`` look names up without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterable, TypeVar

from rlplacement.errors import ConfigError

ENTRY_POINT_GROUP = "rlplacement.plugins"
"""The entry-point group of packages that extend rlplacement: each entry point's value is a module that
registers its specs when imported (``my_pkg.rlplacement_specs``); its name only labels it in errors."""

S = TypeVar("S")

_plugins_loaded = False


def load_plugins() -> None:
    """Import every module of :data:`ENTRY_POINT_GROUP` once in this process (each registers its specs);
    a module that fails to import raises, naming its entry point and distribution."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True  # before importing: a plug-in that looks a name up must not re-enter
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            importlib.import_module(point.value.partition(":")[0])
        except Exception as exc:
            dist = point.dist.name if point.dist is not None else "an unknown distribution"
            exc.add_note(f"while loading the {ENTRY_POINT_GROUP} entry point {point.name!r} = {point.value} "
                         f"of {dist}: fix that package, or uninstall it")
            raise


def load_object(path: str):
    """The object a ``"module:name"`` string names (``name`` may be dotted), its module imported now."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{path!r} is not of the form 'module:name'")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


class SpecRegistry(Generic[S]):
    """One axis's specs by name (each spec has a ``name``).

    ``what`` names a spec in messages ("trainer backend"); ``builtin_modules`` are imported on the first
    lookup, and :meth:`specs` lists theirs first, in this order; ``unknown`` builds the refusal of an
    unknown name from it and the known names (its message names the flag); ``check`` refuses a spec
    that cannot be (raising ``ValueError``) before it is added; ``module_of`` says which module a spec's
    parts live in, to order the built-in ones (None: registration order)."""

    def __init__(self, what: str, builtin_modules: Iterable[str], *, unknown: Callable[[str, list[str]], str],
                 module_of: Callable[[S], str] | None = None, check: Callable[[S], None] | None = None):
        self.what = what
        self.builtin_modules = tuple(builtin_modules)
        self._unknown = unknown
        self._module_of = module_of
        self._check = check
        self._specs: dict[str, S] = {}
        self._builtins_loaded = False

    def register(self, spec: S) -> S:
        """Add ``spec`` (its module calls this where the spec is defined); a name taken already raises."""
        name = spec.name
        if name in self._specs:
            raise ValueError(f"{self.what} {name!r} is already registered (known: {', '.join(sorted(self._specs))})")
        if self._check is not None:
            self._check(spec)
        self._specs[name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Remove a spec (a plug-in's going away; a test's dummy after the test)."""
        self._load()
        self._specs.pop(name, None)

    def _load(self) -> None:
        if not self._builtins_loaded:
            self._builtins_loaded = True
            for module in self.builtin_modules:
                importlib.import_module(module)
        load_plugins()

    def specs(self) -> dict[str, S]:
        """Every registered spec: the built-in ones in :attr:`builtin_modules` order (whichever was imported
        first), then the others in the order they registered."""
        self._load()

        def rank(spec: S) -> int:
            if self._module_of is None:
                return 0
            module = self._module_of(spec)
            for i, builtin in enumerate(self.builtin_modules):
                if module == builtin or module.startswith(builtin + "."):
                    return i
            return len(self.builtin_modules)

        return {s.name: s for s in sorted(self._specs.values(), key=rank)}  # sorted() keeps registration order in a tie

    def names(self) -> list[str]:
        return list(self.specs())

    def get(self, name: str) -> S:
        """The spec registered as ``name``; an unknown name raises :class:`ConfigError` naming the flag."""
        known = self.specs()
        if name not in known:
            raise ConfigError(self._unknown(name, sorted(known)))
        return known[name]
