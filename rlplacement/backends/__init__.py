"""Trainer backends behind one interface (see :mod:`rlplacement.backends.base`).

Each backend yields full, Hugging Face-named tensors for the transfer layer, whatever its sharding.
Heavy dependencies (megatron-core, torchtitan) are imported inside the backend that needs them.
"""

from rlplacement.backends.base import Batch, TrainerBackend, known_backends, make_backend  # noqa: F401
from rlplacement.backends.preflight import preflight  # noqa: F401
