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
    from tests import shared_ray

    shared_ray.stop()


# Under pytest-xdist (`pytest -n N --dist loadgroup --no-loadscope-reorder tests`, for a machine of more cores
# than CI's two, where the suite is CPU-bound and two workers gained nothing): a module's tests run on one
# worker, so its module-scoped set-up (a cluster, a job, engines) is made once, except the modules of
# independent loops below, whose tests (or groups of tests that share a run: their own xdist_group mark)
# spread over the workers; the slowest work first, so no worker is left with a long module at the end.
SPREAD_MODULES = ("test_tiny_grpo.py", "test_fully_async_loop.py")
SLOWEST_FIRST = ("test_tiny_grpo.py", "test_fully_async_loop.py", "test_chaos_soak.py", "test_vllm_transfer.py",
                 "test_vllm_transfer_ipc.py", "test_lora_fsdp.py", "test_vllm_worker_extension.py",
                 "test_megatron_train.py", "test_job_recovery.py", "test_integration_verl.py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.name
        if not any(True for _ in item.iter_markers("xdist_group")) and module not in SPREAD_MODULES:
            item.add_marker(pytest.mark.xdist_group(module))
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its order
