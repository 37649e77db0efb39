"""A rollout engine kind is one package that registers one ``EngineSpec``: a dummy kind defined only in a test
package (tests/dummy_engine, the vLLM engine under another name) is planned and started by a job, installed the
way any package is (an ``rlplacement.plugins`` entry point), with no edit inside ``rlplacement``; the job asks
the kind's spec for its keywords; and the registry refuses what it cannot take."""

import json
import subprocess
import sys

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.engines import registry
from rlplacement.errors import ConfigError
from tests.test_backend_spec import ROOT, installed

LOOP = """
import json, sys
import rlplacement
from rlplacement.args import build_parser, config_from_args
from rlplacement.models.tiny import TinySpec, make_tiny_model

hf = str(make_tiny_model(sys.argv[1], TinySpec()))
config = config_from_args(build_parser().parse_args(
    ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--num-gpus-per-node", "2",
     "--train-backend", "fsdp", "--check-weight-update-equal", "--rollout-name", "dummy"]))
with rlplacement.RLJob.start(config, hf) as job:
    samples = job.generate([[5, 6, 7]], max_tokens=4, exact_lengths=True)
    job.prepare_update()
    landed = job.update_weights().version
    print(json.dumps({"tokens": [len(s.token_ids) for s in samples], "landed": landed,
                      "served": job.served_versions()}))
"""


@pytest.fixture
def dummy():
    import tests.dummy_engine as dummy_engine

    dummy_engine.register()
    yield dummy_engine.SPEC
    dummy_engine.unregister()


def test_the_vllm_kind_maps_the_rollout_settings_to_its_keywords_as_the_config_did():
    expected = ({"dtype": "auto", "max_model_len": None, "enforce_eager": False},
                {"dtype": "bfloat16", "max_model_len": 4096, "enforce_eager": True, "gpu_memory_utilization": 0.5})
    for argv, kwargs in zip(([], ["--vllm-dtype", "bfloat16", "--vllm-max-model-len", "4096", "--vllm-enforce-eager",
                                  "--vllm-gpu-memory-utilization", "0.5"]), expected):
        rollout = config_from_args(build_parser().parse_args(["--rollout-num-gpus", "1", *argv])).rollout
        assert registry.engine_spec("vllm").call("engine_kwargs", rollout) == kwargs


def test_the_plan_and_the_advisor_read_the_kind_from_its_spec(dummy, tmp_path):
    from rlplacement.advisor.memory import layout_memory
    from rlplacement.advisor.thresholds import ModelAssumptions
    from rlplacement.models.tiny import TinySpec, make_tiny_model
    from rlplacement.placement.layout import compute_layout
    from rlplacement.transfer.plan.for_layout import plans_for
    from rlplacement.transfer.plan.tensors import ModelTensors

    hf = make_tiny_model(tmp_path / "hf", TinySpec())
    model = ModelTensors.from_hf_config(str(hf / "config.json"))
    config = config_from_args(build_parser().parse_args(["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2",
                                                         "--rollout-num-gpus-per-engine", "2"]))
    layout = compute_layout(config.placement)
    plans = {kind: plans_for(model, layout, backend="fsdp", tp=1, pp=1, mode="p2p", assumptions=ModelAssumptions(),
                             engine_kind=kind).to_json() for kind in ("vllm", "dummy")}
    assert plans["dummy"] == plans["vllm"]
    memory = {kind: layout_memory(model, backend="fsdp", trainer_gpus=2, tp=1, pp=1, ep=1, bf16=True,
                                  distributed_optimizer=False, engine_tp=2, engine_kind=kind) for kind in ("vllm", "dummy")}
    assert memory["dummy"] == memory["vllm"]


def test_the_registry_refuses_a_taken_kind_and_an_unknown_one():
    import dataclasses

    from rlplacement.engines.vllm import VLLM

    with pytest.raises(ValueError, match=r"rollout engine kind 'vllm' is already registered"):
        registry.register_engine(dataclasses.replace(VLLM, engine="m:C"))
    with pytest.raises(ConfigError, match=r"no rollout engine kind 'dummy': use one of vllm"):
        registry.engine_spec("dummy")  # registered by nothing in this process


@pytest.mark.slow
def test_an_installed_engine_kind_serves_a_job_started_with_it(tmp_path):
    """A job started with ``--rollout-name dummy`` in a process where only the entry point registers it: the engine
    actor is the dummy's class, built with the keywords its spec made, generates and takes a checked update."""
    env = {**installed(tmp_path, entry="dummy_engine = tests.dummy_engine"), "DUMMY_ENGINE_MARKS": str(tmp_path / "marks")}
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(tmp_path / "hf")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["tokens"] == [4] and result["served"] == [result["landed"]]
    marks = list((tmp_path / "marks").iterdir())
    assert [m.read_text() for m in marks] == ["dtype auto"]  # the dummy spec's own keyword reached its class
    assert marks[0].name != str(proc.pid)  # built in the engine's Ray actor, not the driver
