"""The trainer backends' registry, as the backends package offers it: :mod:`rlplacement.specs.backend` holds
it (below the transfer plan and the advisor, which read it too); this module is the same names."""

from rlplacement.specs.backend import (BUILTIN_MODULES, REGISTRY, BackendSpec, backend_class,  # noqa: F401
                                       backend_spec, backends_with, known_backends, register_backend, spoken,
                                       unregister_backend)
