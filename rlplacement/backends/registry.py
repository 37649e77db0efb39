"""Backend name -> (module, class), imported only when chosen, so each backend's dependencies stay
optional and the names can be checked (preflight, ``--train-backend``) without importing torch."""

from __future__ import annotations

import importlib

from rlplacement.errors import ConfigError

# name -> (module, class): imported only when chosen, so each backend's deps stay optional.
_REGISTRY: dict[str, tuple[str, str]] = {
    "megatron": ("rlplacement.backends.megatron.backend", "MegatronBackend"),
    "fsdp": ("rlplacement.backends.fsdp.backend", "FSDPBackend"),
    "torchtitan": ("rlplacement.backends.torchtitan.backend", "TorchtitanBackend"),
}


def register_backend(name: str, module: str, class_name: str) -> None:
    if name in _REGISTRY:
        raise ValueError(f"trainer backend {name!r} is already registered ({_REGISTRY[name][0]})")
    _REGISTRY[name] = (module, class_name)


def known_backends() -> list[str]:
    return sorted(_REGISTRY)


def backend_class(name: str):
    """The backend class registered as ``name`` (imports its module)."""
    if name not in _REGISTRY:
        raise ConfigError(f"--train-backend {name!r} is unknown: use one of {', '.join(known_backends())}")
    module, class_name = _REGISTRY[name]
    return getattr(importlib.import_module(module), class_name)
