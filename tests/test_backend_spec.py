"""A trainer backend is one package that registers one ``BackendSpec``: a dummy backend defined only in a test
package (tests/dummy_backend, the fsdp backend under another name) is chosen with ``--train-backend`` by the
flags, ``plan`` and the example loop, installed the way any package is (an ``rlplacement.plugins`` entry point),
with no edit inside ``rlplacement``; and the registry refuses what a spec cannot be."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlplacement.args import build_parser, config_from_args
from rlplacement.backends import registry
from rlplacement.specs.backend import BackendSpec
from rlplacement.errors import ConfigError
from rlplacement.transfer.spec import SHARES

ROOT = Path(__file__).resolve().parents[1]
SPLIT = ["--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"]


@pytest.fixture
def dummy():
    import tests.dummy_backend as dummy_backend

    dummy_backend.register()
    yield dummy_backend.SPEC
    dummy_backend.unregister()


def installed(tmp_path: Path, entry: str = "dummy_backend = tests.dummy_backend") -> dict[str, str]:
    """The environment of a process that has a dummy package installed as a package would be: a ``*.dist-info``
    folder with its ``rlplacement.plugins`` entry point (``entry``) on ``PYTHONPATH`` (which Ray's workers
    inherit), and nothing else that registers it."""
    site = tmp_path / "site"
    info = site / "rlplacement_dummy-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlplacement-dummy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rlplacement.plugins]\n{entry}\n")
    path = [str(site), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def plan_json(*argv: str, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-m", "rlplacement.cli", "plan", *argv, "--json"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_flags_take_the_backend_and_refuse_what_its_spec_does_not_accept(dummy):
    parser = build_parser()
    assert "dummy" in parser.format_help()
    config = config_from_args(parser.parse_args([*SPLIT, "--train-backend", "dummy", "--gradient-checkpointing"]))
    assert config.backend.name == "dummy" and config.train.gradient_checkpointing
    refusals = {
        ("--tensor-model-parallel-size", "2"): r"apply to --train-backend megatron, not dummy: drop them",
        ("--expert-model-parallel-size", "2"): r"--expert-model-parallel-size 2 is megatron's expert parallelism; "
                                               r"the dummy backend",
        ("--use-distributed-optimizer",): r"is megatron's DistributedOptimizer; the dummy backend",
        ("--recompute-granularity", "selective"): r"are megatron's; the dummy backend recomputes with "
                                                  r"--gradient-checkpointing",
        ("--moe-token-dispatcher-type", "alltoall"): r"configures megatron's MoE layer; the dummy backend runs",
        ("--lora-rank", "8"): r"--lora-rank with --train-backend dummy: LoRA adapters train on the fsdp and megatron "
                              r"backends: use --train-backend fsdp or megatron",
    }
    for extra, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            config_from_args(parser.parse_args([*SPLIT, "--train-backend", "dummy", *extra]))


def test_pieces_holdings_and_memory_come_from_the_spec(dummy, tmp_path):
    from rlplacement.advisor.memory import layout_memory
    from rlplacement.transfer.pieces import trainer_sends_pieces
    from rlplacement.transfer.plan.for_layout import trainer_holdings
    from rlplacement.transfer.plan.tensors import ModelTensors
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    assert trainer_sends_pieces("dummy", 2, SHARES, lora=False)
    assert not trainer_sends_pieces("dummy", 1, SHARES, lora=False)
    hf = make_tiny_model(tmp_path / "hf", TinySpec())
    model = ModelTensors.from_hf_config(str(hf / "config.json"))
    assert trainer_holdings(model, "dummy", 2) == trainer_holdings(model, "fsdp", 2)
    common = dict(trainer_gpus=2, tp=1, pp=1, ep=1, bf16=True, distributed_optimizer=False, engine_tp=1)
    assert ({**layout_memory(model, backend="dummy", **common), "backend": "fsdp"}
            == layout_memory(model, backend="fsdp", **common))


def test_preflight_runs_the_shared_checks_for_the_backend(dummy, tmp_path):
    from rlplacement.backends.preflight import preflight
    from rlplacement.config import BackendConfig
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", TinySpec())
    preflight(BackendConfig(name="dummy", hf_checkpoint=str(hf)))
    moe = make_tiny_model(tmp_path / "moe", TinySpec(family="qwen3_moe", num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match=r"mixture-of-experts model, which --train-backend dummy does not train yet: "
                                          r"use --train-backend fsdp or megatron"):
        preflight(BackendConfig(name="dummy", hf_checkpoint=str(moe)))
    with pytest.raises(ConfigError, match=r"--train-backend dummy needs --hf-checkpoint \(an HF model folder\)$"):
        preflight(BackendConfig(name="dummy"))


def test_the_registry_refuses_a_taken_name_and_an_unknown_one():
    with pytest.raises(ValueError, match=r"trainer backend 'fsdp' is already registered"):
        registry.register_backend(BackendSpec(name="fsdp", backend="m:C", summary="again"))
    with pytest.raises(ConfigError, match=r"--train-backend 'nowhere' is unknown: use one of fsdp, megatron, torchtitan"):
        registry.backend_spec("nowhere")
    assert "dummy" not in registry.known_backends()  # registered by nothing in this process


def test_an_installed_backend_is_planned_like_the_one_it_wraps(tmp_path):
    """``rlplacement plan`` in a process that has the dummy installed (entry point only): the transfer plans and
    the memory model are fsdp's, under its name."""
    from rlplacement.models.tiny import TinySpec, make_tiny_model

    hf = make_tiny_model(tmp_path / "hf", TinySpec())
    argv = [*SPLIT, "--simulate-transfer", "--memory", "--hf-config", str(hf / "config.json")]
    with pytest.raises(ConfigError, match=r"--train-backend 'dummy' is unknown"):  # not installed here
        registry.backend_spec("dummy")
    dummy = plan_json(*argv, "--train-backend", "dummy", env=installed(tmp_path))
    fsdp = plan_json(*argv, "--train-backend", "fsdp")
    assert dummy["transfer"]["backend"] == "dummy" and dummy["memory"]["backend"] == "dummy"
    assert dummy["transfer"]["runs"] == "spread" and dummy["transfer"]["engine_staging"]["pieces"] is True
    for key in ("transfer", "memory"):
        assert {**dummy[key], "backend": "fsdp"} == fsdp[key], key


@pytest.mark.slow
def test_an_installed_backend_trains_the_example_loop_in_its_ray_workers(tmp_path):
    """The example loop with ``--train-backend dummy --rollout-name dummy`` in a process where only the entry
    points register them (a backend and an engine kind from a package outside ``rlplacement``, chosen by flags
    alone): each trainer rank (a Ray actor) finds the backend on its own lookup and builds it, the engine's
    actor builds the dummy kind, every rank sends its pieces, and every update is checked bit for bit."""
    env = {**installed(tmp_path, entry="dummy_backend = tests.dummy_backend\ndummy_engine = tests.dummy_engine"),
           "DUMMY_BACKEND_MARKS": str(tmp_path / "marks"), "DUMMY_ENGINE_MARKS": str(tmp_path / "engine_marks")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "tiny_grpo.py"), "--work-dir", str(tmp_path / "run"),
                             "--train-backend", "dummy", "--rollout-name", "dummy", "--steps", "2",
                             "--check-weight-update-equal",
                             "--actor-num-gpus-per-node", "2", "--telemetry", str(tmp_path / "steps.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        _, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["perf/update_weights_checked"] == 1 for r in rows)
    assert [r["perf/update_weights_senders"] for r in rows] == [2, 2]
    marks = sorted((tmp_path / "marks").iterdir())
    assert len(marks) == 2 and all(m.read_text() == "dummy" for m in marks)
    assert str(proc.pid) not in [m.name for m in marks]  # built in the trainer ranks' processes, not the driver
    engine_marks = list((tmp_path / "engine_marks").iterdir())
    assert len(engine_marks) == 1 and engine_marks[0].name != str(proc.pid)  # the engine's actor built the dummy kind
