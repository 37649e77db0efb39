"""patches/: the verl placement patch is applied to a copy of the installed verl 0.9.1, refused for
another version or a hand-edited file, and the patched code puts verl's pools on our layout's
nodes in a real two-node Ray cluster (``ray.cluster_utils.Cluster``, logical GPUs)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl==0.9.1 is installed by `make venv`")

REPO = Path(__file__).resolve().parents[1]
APPLY = [sys.executable, str(REPO / "patches" / "apply.py"), "verl"]
TARGET = "verl/single_controller/ray/base.py"


@pytest.fixture
def verl_copy(tmp_path) -> Path:
    """The installed verl package and its dist-info, copied to a site folder of our own."""
    import verl

    installed = Path(verl.__file__).parent
    site = tmp_path / "site"
    shutil.copytree(installed, site / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    for info in installed.parent.glob("verl-*.dist-info"):
        shutil.copytree(info, site / info.name)
    return site


def run_apply(site: Path, action: str) -> subprocess.CompletedProcess:
    return subprocess.run([*APPLY, action, "--site", str(site)], capture_output=True, text=True, timeout=60)


def test_apply_is_checked_idempotent_and_refuses_what_it_was_not_made_for(verl_copy):
    original = (verl_copy / TARGET).read_text()
    assert "applicable" in run_apply(verl_copy, "--check").stdout
    out = run_apply(verl_copy, "--apply")
    assert out.returncode == 0 and "applied now" in out.stdout
    patched = (verl_copy / TARGET).read_text()
    assert "placement_group_options(self.name_prefix, idx, len(bundles))" in patched
    assert "already applied" in run_apply(verl_copy, "--apply").stdout
    assert (verl_copy / TARGET).read_text() == patched and ": applied" in run_apply(verl_copy, "--check").stdout

    (verl_copy / TARGET).write_text(original.replace("lifetime=lifetime)", "lifetime=lifetime, _max_cpu_fraction_per_node=1)"))
    out = run_apply(verl_copy, "--apply")
    assert out.returncode == 1 and "the lines it changes differ" in out.stderr

    (verl_copy / TARGET).write_text(original)
    metadata = next(verl_copy.glob("verl-*.dist-info")) / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.9.1", "Version: 0.9.2"))
    out = run_apply(verl_copy, "--apply")
    assert out.returncode == 1 and "made for verl 0.9.1, but" in out.stderr and "verl 0.9.2" in out.stderr
    assert (verl_copy / TARGET).read_text() == original


PLACE_POOLS = r"""
import json, os, sys
import ray
from ray.cluster_utils import Cluster
from verl.single_controller.ray.base import RayResourcePool
from rlplacement.placement.ray_groups import cluster_nodes

assert RayResourcePool.__module__ == "verl.single_controller.ray.base"
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "num_gpus": 4, "include_dashboard": False})
cluster.add_node(num_cpus=8, num_gpus=4)
cluster.wait_for_nodes()
ray.init(address=cluster.address)
try:
    nodes = [n.node_id for n in cluster_nodes()]
    # rollout pools first: left to Ray they would take the first node's free GPUs
    pools = {name: RayResourcePool([count], use_gpu=True, name_prefix=name, max_colocate_count=1)
             for name, count in (("rollout_pool_0", 2), ("rollout_pool_1", 2), ("global_pool", 4))}
    landed = {}
    for name, pool in pools.items():
        pg = pool.get_placement_groups()[0]
        landed[name] = sorted({nodes.index(n) for n in ray.util.placement_group_table(pg)["bundles_to_node_id"].values()})
    print(json.dumps(landed))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow
def test_patched_verl_puts_trainer_and_rollout_pools_on_the_layouts_nodes(verl_copy):
    assert run_apply(verl_copy, "--apply").returncode == 0
    plan = subprocess.run([sys.executable, "-m", "rlplacement.cli", "plan", "--actor-num-gpus-per-node", "4",
                           "--num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2",
                           "--json"], capture_output=True, text=True, check=True, timeout=60)
    layout = json.loads(plan.stdout)
    assert [n for n, _ in layout["trainer"]["gpus"]] == [0] * 4
    assert {n for engine in layout["rollout"]["engines"] for n, _ in engine} == {1}
    env = {**os.environ, "PYTHONPATH": f"{verl_copy}{os.pathsep}{REPO}", "RAY_AUTH_MODE": "disabled",
           "RLPLACEMENT_VERL_LAYOUT": plan.stdout}
    out = subprocess.run([sys.executable, "-c", PLACE_POOLS], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "rollout_pool_0": [1], "rollout_pool_1": [1], "global_pool": [0]}
