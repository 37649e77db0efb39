"""A rollout engine kind defined only here, outside ``rlplacement``: the vLLM engine under the kind ``dummy``,
with a spec of its own whose mapping of the rollout settings adds one keyword of its own. Importing this
package registers it; a test installs it through an ``rlplacement.plugins`` entry point naming this module
(tests/test_engine_spec.py).

Torch-free: its class is imported only where an engine is built.
"""

import dataclasses

from rlplacement.engines import registry
from rlplacement.engines.vllm import VLLM, vllm_engine_kwargs

MARKS_ENV = "DUMMY_ENGINE_MARKS"
"""Where a built dummy engine leaves a file named by its process id, holding its label (unset: nowhere)."""


def engine_kwargs(rollout) -> dict:
    """vLLM's keywords, plus the dummy's own label: proof that the job asked this spec for them."""
    return {**vllm_engine_kwargs(rollout), "dummy_label": f"dtype {rollout.dtype}"}


SPEC = dataclasses.replace(VLLM, name="dummy", engine="tests.dummy_engine.engine:DummyRolloutEngine",
                           summary="the vLLM engine under a test's kind", engine_kwargs=f"{__name__}:engine_kwargs")


def register() -> None:
    """Register the spec unless it is (importing this module does it once; a test again after
    :func:`unregister`)."""
    if registry.REGISTRY.specs().get(SPEC.name) is not SPEC:
        registry.register_engine(SPEC)


register()


def unregister() -> None:
    registry.unregister_engine(SPEC.name)
