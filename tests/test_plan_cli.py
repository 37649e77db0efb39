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


def emitted(capsys, *argv: str) -> list[str]:
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_emit_verl_split_layout_as_hydra_overrides(capsys):
    line, *notes = emitted(capsys, "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "12",
                           "--rollout-num-gpus-per-engine", "2", "--update-weight-transfer-mode", "disk-delta",
                           "--update-weight-disk-dir", "/shared/w", "--update-weight-buffer-size", str(256 << 20),
                           "--emit", "verl")
    ce = "actor_rollout_ref.rollout.checkpoint_engine"
    assert line.split() == [
        "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=false", "trainer.nnodes=2",
        "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.n_gpus_per_node=6",
        f"{ce}.backend=rlplacement_disk_delta", f"{ce}.custom_backend_module=rlplacement.integrations.verl",
        f"{ce}.update_weights_bucket_megabytes=256",
        f"+{ce}.engine_kwargs.rlplacement_disk_delta.update_weight_disk_dir=/shared/w"]
    assert all(n.startswith("# ") for n in notes) and any("no node choice" in n for n in notes)


def test_emit_verl_says_what_it_cannot_express(capsys):
    line, note = emitted(capsys, "--colocate", "--actor-num-gpus-per-node", "4", "--emit", "verl")
    assert line == "trainer.v1.trainer_mode=sync trainer.nnodes=1 trainer.n_gpus_per_node=4 " \
                   "actor_rollout_ref.rollout.tensor_model_parallel_size=1"
    assert "'naive' backend" in note
    # trainer 8 GPUs on node 0, rollout 12 on nodes 1 and 2 as 8 + 4: not [n] * nnodes
    proc = run_cli("plan", "--rollout-num-gpus", "12", "--emit", "verl")
    assert proc.returncode == 2 and "--rollout-num-gpus 12 lands on nodes with different rollout GPU counts" in proc.stderr
    proc = run_cli("plan", "--rollout-num-gpus", "4", "--update-weight-buffer-size", "1000KB", "--emit", "verl")
    assert proc.returncode == 2 and "not a whole number of MiB" in proc.stderr


def test_emit_miles_flags_load_our_protocol(capsys):
    import argparse

    from rlplacement.integrations import miles

    line, note = emitted(capsys, "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4",
                         "--update-weight-transfer-mode", "p2p", "--p2p-protocol", "tcp",
                         "--check-weight-update-equal", "--emit", "miles")
    assert line.startswith("--actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 "
                           "--rollout-num-gpus-per-engine 1 --num-gpus-per-node 8 --update-weight-transfer-mode external "
                           "--custom-weight-transfer-protocol-path rlplacement.integrations.miles.p2p")
    assert "--p2p-protocol tcp: not Miles flags" in note
    tokens, values = line.split(), {}
    for i, tok in enumerate(tokens):  # flags as Miles' argparse would store them
        if tok.startswith("--"):
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            values[tok[2:].replace("-", "_")] = True if nxt is None or nxt.startswith("--") else nxt
    args = argparse.Namespace(**values)
    module, _, attr = args.custom_weight_transfer_protocol_path.rpartition(".")
    assert module == "rlplacement.integrations.miles"
    getattr(miles, attr).validate_args(args)
    protocol = getattr(miles, attr)(args)
    assert protocol.mode == "p2p" and protocol.config.check_equal and protocol.config.options.protocol == "tcp"


def test_plan_describes_a_cluster_so_it_does_not_check_this_hosts_rdma(capsys):
    """`--p2p-protocol rdma` is checked where the transfer runs, not on the machine that plans it."""
    line, _ = emitted(capsys, "--rollout-num-gpus", "4", "--update-weight-transfer-mode", "p2p", "--p2p-protocol", "rdma",
                      "--emit", "miles")
    assert line.endswith("--custom-weight-transfer-protocol-path rlplacement.integrations.miles.p2p --p2p-protocol rdma")
