"""Shared test hygiene: a module whose Ray fixture failed half-way must not leave Ray running for
the next module (its own teardown never runs when setup raises)."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def _ray_shut_down_after_module():
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
