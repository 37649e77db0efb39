"""Our transfer modes as verl checkpoint-engine backends, driven the way verl 0.9.1 drives them.

verl is the real package from PyPI (installed ``--no-deps`` by the Makefile with what its imports
need). The driver below repeats ``CheckpointEngineManager.update_weights`` of verl 0.9.1
(``verl/checkpoint_engine/base.py``): ``prepare`` on every trainer rank and rollout worker, the
backend class's ``build_topology`` on the driver from those results, ``init_process_group`` on
all workers at once, ``send_weights`` on every trainer rank beside ``receive_weights`` on every
rollout worker, then ``finalize`` everywhere. Workers are separate processes (Ray actors), two
trainer ranks and two rollout workers; the engines are built through verl's own registry after
verl's own ``import_external_libs(custom_backend_module)``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl==0.9.1 is installed by `make venv`")

from rlplacement.errors import ConfigError  # noqa: E402
from rlplacement.integrations.verl import BACKENDS  # noqa: E402
from tests.transfer_helpers.verl_workers import StandInVerlRolloutWorker, StandInVerlTrainerRank  # noqa: E402

BUCKET_SIZE = 1 << 16  # several buckets for the tiny model
TIMEOUT_S = 120


def engine_kwargs(backend: str, tmp_path) -> dict:
    kwargs = {"check_weight_update_equal": True, "timeout_s": 60}
    if backend == "rlplacement_disk_delta":
        kwargs["update_weight_disk_dir"] = str(tmp_path / "versions")
    if backend == "rlplacement_p2p":
        kwargs["p2p_protocol"] = "tcp"
    return kwargs


@pytest.fixture(scope="module")
def ray_local():
    from tests.transfer_helpers.cluster import join_shared_ray

    ray = join_shared_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), TinySpec(dtype="bfloat16")))


def start_workers(ray, backend: str, model_dir: str, kwargs: dict, trainers: int = 2, rollouts: int = 2):
    Trainer = ray.remote(StandInVerlTrainerRank).options(num_cpus=0)
    Rollout = ray.remote(StandInVerlRolloutWorker).options(num_cpus=0)
    return ([Trainer.remote(r, model_dir, backend, BUCKET_SIZE, kwargs) for r in range(trainers)],
            [Rollout.remote(backend, BUCKET_SIZE, kwargs) for _ in range(rollouts)])


@pytest.fixture(scope="module")
def workers(ray_local, model_dir):
    """Two trainer ranks and two rollout workers for the whole module: each test gives them fresh
    engines of its backend and the saved weights (``use_backend``), as new processes would have; a
    test that restarts a worker leaves the new one in the lists."""
    ray = ray_local
    lists = start_workers(ray, "rlplacement_broadcast", model_dir, {"timeout_s": 60})

    def fresh(backend: str, kwargs: dict):
        trainers, rollouts = lists
        ray.get([w.use_backend.remote(backend, BUCKET_SIZE, kwargs) for w in trainers + rollouts], timeout=TIMEOUT_S)
        return trainers, rollouts

    yield fresh
    for actor in lists[0] + lists[1]:
        ray.kill(actor)


def verl_update(ray, backend_cls, trainers, rollouts, global_steps, fail_after=None):
    """One ``CheckpointEngineManager.update_weights`` (verl 0.9.1) for a non-naive backend; returns
    (the prepare() metadata, trainer results, rollout results). ``fail_after``: trainer rank 0's
    gather fails after that many tensors; then (results, errors) of that step are returned instead."""
    workers = trainers + rollouts
    metadata = ray.get([w.execute_checkpoint_engine.remote("prepare") for w in workers], timeout=TIMEOUT_S)
    trainer_kwargs, rollout_kwargs = backend_cls.build_topology(len(trainers), len(rollouts), metadata)
    assert all(len(v) == len(trainers) for v in trainer_kwargs.values())
    assert all(len(v) == len(rollouts) for v in rollout_kwargs.values())
    ray.get([w.execute_checkpoint_engine.remote("init_process_group", **{k: v[i] for k, v in kw.items()})
             for ws, kw in ((trainers, trainer_kwargs), (rollouts, rollout_kwargs)) for i, w in enumerate(ws)],
            timeout=TIMEOUT_S)
    refs = [w.update_weights.remote(global_steps, *([fail_after] if i == 0 and fail_after is not None else []))
            for i, w in enumerate(workers)]
    if fail_after is not None:
        outcomes = []
        for ref in refs:
            try:
                outcomes.append(ray.get(ref, timeout=TIMEOUT_S))
            except ray.exceptions.RayTaskError as exc:
                outcomes.append(exc)
        return metadata, outcomes
    results = ray.get(refs, timeout=TIMEOUT_S)
    ray.get([w.execute_checkpoint_engine.remote("finalize") for w in workers], timeout=TIMEOUT_S)
    return metadata, results[:len(trainers)], results[len(trainers):]


def assert_bit_exact(expected: dict, got: dict) -> None:
    import torch

    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_mode_delivers_verl_updates_bit_exact(ray_local, workers, tmp_path, backend):
    """Three versions through two rollout workers, then a restarted rollout worker rejoins."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    ray = ray_local
    import_external_libs("rlplacement.integrations.verl")  # what the manager does on the driver
    backend_cls = CheckpointEngineRegistry.get(backend)
    kwargs = engine_kwargs(backend, tmp_path)
    trainers, rollouts = workers(backend, kwargs)
    groups = []
    for step in range(3):
        ray.get([t.perturb.remote(step + 1) for t in trainers], timeout=TIMEOUT_S)
        metadata, sent, received = verl_update(ray, backend_cls, trainers, rollouts, global_steps=step)
        groups.append(metadata[0]["group"])
        expected = ray.get(trainers[0].state.remote(), timeout=TIMEOUT_S)
        for got in received:
            assert_bit_exact(expected, got)
        assert sent[0]["metrics"]["rlplacement/version"] == step + 1
        assert sent[0]["metrics"]["rlplacement/global_steps"] == step
        assert sent[0]["metrics"]["rlplacement/bytes"] > 0
        assert sent[1] == {"metrics": {}, "yielded": len(expected)}  # rank 1 drained its gathers
    assert groups[0] is None and groups[1] == groups[2] is not None  # built once, then kept

    # a rollout worker restarts (new process, no group): the next update rebuilds the group and
    # the newcomer gets the whole weights (disk-delta: a keyframe), bit-exact
    ray.kill(rollouts[1])
    rollouts[1] = ray.remote(StandInVerlRolloutWorker).options(num_cpus=0).remote(backend, BUCKET_SIZE, kwargs)
    ray.get([t.perturb.remote(9) for t in trainers], timeout=TIMEOUT_S)
    metadata, sent, received = verl_update(ray, backend_cls, trainers, rollouts, global_steps=3)
    assert metadata[-1]["group"] is None and metadata[0]["group"] == groups[-1]
    expected = ray.get(trainers[0].state.remote(), timeout=TIMEOUT_S)
    for got in received:
        assert_bit_exact(expected, got)
    assert sent[0]["metrics"]["rlplacement/version"] == 4


@pytest.mark.slow
def test_a_failed_verl_update_yields_nothing_and_the_next_one_rebuilds_the_group(ray_local, workers, tmp_path):
    """Trainer rank 0's gather fails mid-stream: every rollout worker raises before yielding a
    single tensor (verl's loader sees no part of that version), and the next update builds a fresh
    group and lands bit-exact."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    ray, backend = ray_local, "rlplacement_broadcast_packed"
    backend_cls = CheckpointEngineRegistry.get(backend)
    trainers, rollouts = workers(backend, engine_kwargs(backend, tmp_path))
    _, _, received = verl_update(ray, backend_cls, trainers, rollouts, global_steps=0)
    ray.get([t.perturb.remote(5) for t in trainers], timeout=TIMEOUT_S)
    metadata, outcomes = verl_update(ray, backend_cls, trainers, rollouts, global_steps=1, fail_after=3)
    assert "gather failed after 3 tensors" in str(outcomes[0])
    for outcome in outcomes[2:]:  # rollout workers
        assert isinstance(outcome, Exception) and "UpdateAborted" in str(outcome), outcome
    metadata, sent, received = verl_update(ray, backend_cls, trainers, rollouts, global_steps=1)
    assert metadata[0]["group"] is None and all(m["group"] is None for m in metadata[2:])  # everyone left it
    expected = ray.get(trainers[0].state.remote(), timeout=TIMEOUT_S)
    for got in received:
        assert_bit_exact(expected, got)
    assert sent[0]["metrics"]["rlplacement/version"] == 2  # the failed version is not counted as sent


@pytest.mark.parametrize("backend,kwargs,message", [
    ("rlplacement_broadcast", {"update_weight_disk_dri": "/x"},
     "engine_kwargs.rlplacement_broadcast.update_weight_disk_dri is not an rlplacement option"),
    ("rlplacement_disk_delta", {}, "needs --update-weight-disk-dir"),
    ("rlplacement_broadcast_packed", {"update_weight_buffer_size": 1 << 20},
     "set actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes instead"),
    ("rlplacement_broadcast", {"update_weight_delta_encoding": "zip"}, "--update-weight-delta-encoding 'zip' is unknown"),
])
def test_bad_engine_kwargs_are_refused_naming_the_key(backend, kwargs, message):
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        CheckpointEngineRegistry.new(backend, bucket_size=1 << 20, **kwargs)


def test_verl_finds_the_backends_through_its_plugin_entry_point():
    """A bare ``import verl`` (VERL_USE_EXTERNAL_PLUGINS defaults to auto) registers every backend."""
    code = ("import verl\nfrom verl.checkpoint_engine.base import CheckpointEngineRegistry as R\n"
            "print(sorted(k for k in R._registry if k.startswith('rlplacement')))")
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(sorted(BACKENDS))


def test_plan_emit_verl_overrides_build_our_engine_from_verls_own_config(capsys, tmp_path):
    """The overrides `plan --emit verl` prints name keys of verl 0.9.1's generated trainer config
    (a new key only where verl's Hydra needs the ``+``), and the resulting checkpoint-engine
    config builds our backend the way verl's workers do."""
    from importlib.resources import files

    from omegaconf import OmegaConf
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    from rlplacement.cli import main

    assert main(["plan", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--check-weight-update-equal",
                 "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(tmp_path),
                 "--update-weight-buffer-size", str(64 << 20), "--emit", "verl"]) == 0
    overrides = capsys.readouterr().out.splitlines()[0].split()
    cfg = OmegaConf.load(str(files("verl.trainer.config") / "_generated_ppo_trainer.yaml"))
    for override in overrides:
        key = override.split("=", 1)[0]
        if key.startswith("+"):
            assert OmegaConf.select(cfg, key[1:].rsplit(".", 2)[0], default=None) is not None, key
        else:
            assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
    ce = cfg.actor_rollout_ref.rollout.checkpoint_engine
    engine = CheckpointEngineRegistry.new(ce.backend, is_master=True, bucket_size=ce.update_weights_bucket_megabytes << 20,
                                          **OmegaConf.to_container(ce.engine_kwargs).get(ce.backend, {}))
    assert (engine.mode, engine.config.bucket_bytes, engine.config.check_equal) == ("disk-delta", 64 << 20, True)
    assert engine.config.options.disk_dir == str(tmp_path)
    assert cfg.trainer.v1.trainer_mode == "separate_async" and cfg.actor_rollout_ref.hybrid_engine is False
