"""Shared test hygiene: a module whose Ray fixture failed half-way must not leave Ray running for
the next module (its own teardown never runs when setup raises); a module that built a backend in
this process must not leave its process group behind (a later in-process single-rank run, such as
``rlplacement convert``, would see it and spawn ranks instead)."""

import os

import pytest

# Ray reads RAY_AUTH_MODE once per process and a test process starts many clusters, some with workers
# told RAY_AUTH_MODE=disabled (their calls would be refused by a token cluster started earlier): one mode
# for the whole run. The product's default, token auth, is tested in a fresh process (test_open_doors).
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# ray.init() without an address joins the cluster another test (ray.cluster_utils, `ray start`) last recorded
# in Ray's default temp folder, possibly one of a concurrent test process: every test's own ray.init starts
# its own cluster unless it names one
os.environ.setdefault("RAY_ADDRESS", "local")


@pytest.fixture(autouse=True, scope="module")
def _ray_shut_down_after_module():
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        from rlplacement.convert.run import _teardown

        _teardown()


def pytest_sessionfinish(session, exitstatus):
    from tests import loop_cluster

    loop_cluster.stop()
