"""Trainer backends behind one interface (see :mod:`rlplacement.backends.base`).

Each backend yields full, Hugging Face-named tensors for the transfer layer, whatever its sharding.
Importing this package imports nothing heavy: :func:`preflight` is torch-free and loaded here;
``Batch``, ``TrainerBackend``, ``known_backends`` and ``make_backend`` load :mod:`.base` (torch) on
first use. Heavy dependencies (megatron-core, torchtitan) are imported inside the backend that needs them.
"""

from rlplacement.backends.preflight import preflight  # noqa: F401
from rlplacement.backends.registry import known_backends  # noqa: F401

_FROM_BASE = ("Batch", "TrainerBackend", "make_backend")


def __getattr__(name: str):
    if name in _FROM_BASE:
        from rlplacement.backends import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
