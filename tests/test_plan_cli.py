"""`rlplacement plan`: a table or the JSON contract; bad flags exit non-zero with no traceback."""

import json
import subprocess
import sys

import pytest

from rlplacement.cli import main


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlplacement.cli", *argv], capture_output=True, text=True, timeout=60)


def test_plan_json_contract(capsys):
    assert main(["plan", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
                 "--rollout-num-gpus-per-engine", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"mode": "split", "num_nodes": 1, "num_gpus": 8,
                   "trainer": {"num_gpus": 4, "gpus": [[0, 0], [0, 1], [0, 2], [0, 3]]},
                   "rollout": {"num_gpus": 4, "gpus_per_engine": 2, "num_engines": 2,
                               "engines": [[[0, 4], [0, 5]], [[0, 6], [0, 7]]]}}


def test_plan_table_shows_roles_per_node(capsys):
    assert main(["plan", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "4",
                 "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]) == 0
    out = capsys.readouterr().out
    assert "mode: split   nodes: 2" in out
    assert "node 1:\n  gpu 0: trainer[2]\n  gpu 1: trainer[3]\n  gpu 2: engine[1].0\n  gpu 3: engine[1].1" in out
    assert main(["plan", "--colocate", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "4",
                 "--rollout-num-gpus-per-engine", "2"]) == 0
    assert "gpu 3: trainer[3], engine[1].1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["plan"], "needs --rollout-num-gpus"),
    (["plan", "--colocate", "--update-weight-transfer-mode", "p2p"], "p2p cannot be used with --colocate"),
    (["plan", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "not a multiple of"),
])
def test_plan_rejects_with_message_and_no_traceback(argv, message):
    proc = run_cli(*argv)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("rlplacement plan: error: ")


def test_plan_needs_no_ray_or_torch():
    code = ("import sys, json; from rlplacement.cli import main; main(['plan','--rollout-num-gpus','2','--json']);"
            "assert not {'ray','torch','vllm'} & set(sys.modules), sorted(m for m in sys.modules if m in ('ray','torch','vllm'))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
