"""A trainer backend defined only here, outside ``rlplacement``: the fsdp backend under the name ``dummy``,
with its own spec. Importing this package registers it; a test installs it the way any package would,
through an ``rlplacement.plugins`` entry point naming this module (tests/test_backend_spec.py), so the
driver, the trainer ranks' Ray actors and ``rlplacement plan`` each find it on their first lookup.

Torch-free: its class is imported only where a trainer rank builds it.
"""

from rlplacement.backends import registry
from rlplacement.backends.registry import register_backend, unregister_backend
from rlplacement.specs.backend import GRADIENT_CHECKPOINTING, BackendSpec

MARKS_ENV = "DUMMY_BACKEND_MARKS"
"""Where a built dummy backend leaves a file named by its process id (unset: nowhere): a test's proof of
which processes built it."""

_FSDP = "rlplacement.backends.fsdp"

SPEC = BackendSpec(
    name="dummy", backend="tests.dummy_backend.backend:DummyBackend",
    summary="the fsdp backend under a test's name", recompute=GRADIENT_CHECKPOINTING, trains_moe=False, lora=False,
    sends_pieces=True, holdings=f"{_FSDP}:fsdp2_holdings", share_holdings=f"{_FSDP}:fsdp2_share_holdings",
    memory="rlplacement.advisor.memory:fsdp_rank_memory")



def register() -> None:
    """Register the spec unless it is (importing this module does it once; a test again after
    :func:`unregister`)."""
    if registry.REGISTRY.specs().get(SPEC.name) is not SPEC:
        register_backend(SPEC)


register()


def unregister() -> None:
    unregister_backend(SPEC.name)
