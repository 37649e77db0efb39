"""The module-wide setup the real-vLLM transfer tests share: a Ray cluster of our own, a trainer
actor holding a real HF model, and engines of the same folder (engine start-up dominates, so each
test module starts this once), with the constants their updates use.

A module takes its cluster with ``cluster = cluster_fixture(spec)``; the fixture yields a dict:
``model_dir``, ``trainer``, ``engines`` (the live engines, a killed one replaced in place),
``version`` (the last version number sent, burnt even if its update failed) and ``tmp`` (a folder
of the module's).
"""

import contextlib
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 17, 9, 250]]
BUCKET = 64 * 1024  # several buckets per update for the ~450 KB tiny model
TIMEOUT_S = 60.0

@contextlib.contextmanager
def two_node_ray(gpus_per_node: int, runtime_env: dict | None = None):
    """A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: two raylets of one CPU and
    ``gpus_per_node`` logical GPUs each), this process connected to it (with ``runtime_env``), shut down after."""
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "num_gpus": gpus_per_node, "include_dashboard": False})
    cluster.add_node(num_cpus=1, num_gpus=gpus_per_node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, **({"runtime_env": runtime_env} if runtime_env else {}))
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def shut_down_engine(engine) -> None:
    """Shut ``engine`` (an engine actor, or None) down before its Ray goes: vLLM's shared memory (/dev/shm)
    goes only with its engine core, not with the actor. One already shut down or dead is left as it is."""
    import ray

    if engine is None:
        return
    try:
        ray.get(engine.shutdown.remote(), timeout=120)
    except Exception:  # noqa: BLE001 - already shut down or dead: nothing more to release
        pass


def join_shared_ray():
    """This process joined to the test process's shared Ray cluster (``tests.shared_ray``), its workers
    importing this checkout; returns the ``ray`` module."""
    import ray

    from tests import shared_ray

    shared_ray.join({"env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"}})
    return ray


def start_trainer_and_engines(model_dir: str, num_engines: int = 2):
    """Return ``(trainer, engines)`` on the shared Ray (:func:`join_shared_ray`); the engines' workers
    take the tests' hooks (``worker_hooks``)."""
    from rlplacement.engines.ray_engines import create_engine_actor
    from tests.transfer_helpers.trainer_actor import StandInHFTrainer
    from tests.transfer_helpers.worker_hooks import HOOKED_WORKER_EXTENSION

    ray = join_shared_ray()
    trainer = ray.remote(StandInHFTrainer).options(num_cpus=0).remote(model_dir)
    return trainer, [create_engine_actor(i, model_dir, worker_extension_cls=HOOKED_WORKER_EXTENSION)
                     for i in range(num_engines)]


def cluster_fixture(spec, connect_mode: str | None = None):
    """A module-scoped fixture: Ray, a trainer and two engines of a tiny model made from ``spec``
    (``rlplacement.models.tiny.TinySpec``), every actor answering before the first test; with
    ``connect_mode``, the trainer and both engines already joined in a group of that mode."""

    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory):
        import ray

        from rlplacement.models.tiny import make_tiny_model
        from rlplacement.runtime import transfer_driver as driver

        model_dir = str(make_tiny_model(tmp_path_factory.mktemp("tiny"), spec))
        trainer, engines = start_trainer_and_engines(model_dir)
        try:
            ray.get([e.info.remote() for e in engines] + [trainer.checksums.remote()], timeout=300)
            if connect_mode is not None:
                ray.get(trainer.transfer_setup.remote(connect_mode, BUCKET, check_equal=True, timeout_s=TIMEOUT_S))
                driver.connect(trainer, engines, timeout_s=TIMEOUT_S)
            yield {"model_dir": model_dir, "trainer": trainer, "engines": engines, "version": 0,
                   "tmp": tmp_path_factory.mktemp("out")}
        finally:
            ray.shutdown()

    return cluster


def start_replacement_engine(cluster, index: int):
    """A new engine process of the cluster's model, never in any group: what a restarted engine
    ``index`` is. A kill test starts it before the kill, so its start-up (~10 s on 2 cores) overlaps
    the kill's waits instead of following them; it joins only when the test connects it."""
    from rlplacement.engines.ray_engines import create_engine_actor
    from tests.transfer_helpers.worker_hooks import HOOKED_WORKER_EXTENSION

    return create_engine_actor(index, cluster["model_dir"], worker_extension_cls=HOOKED_WORKER_EXTENSION)


def outputs(engine, prompts, max_tokens: int):
    """An engine's completions without their timestamps: what must stay equal across updates."""
    import ray

    return [{k: v.tolist() if hasattr(v, "tolist") else v for k, v in r.items()
             if k not in ("finished_at", "first_token_at")}
            for r in ray.get(engine.generate.remote(prompts, max_tokens=max_tokens), timeout=300)]
