"""Ray placement groups on real Ray clusters with logical GPUs: actors land where the layout says.

One local cluster (one node, 8 logical GPUs) and one multi-node cluster built with
``ray.cluster_utils.Cluster`` (two raylets of 4 logical GPUs each), so node boundaries are real
to the scheduler.
"""

import os

import pytest

ray = pytest.importorskip("ray")

from rlplacement.args import build_parser, config_from_args  # noqa: E402
from rlplacement.errors import ConfigError  # noqa: E402
from rlplacement.placement import ray_groups  # noqa: E402


@ray.remote
class WhereAmI:
    def report(self):
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "nccl_nvls": os.environ.get("NCCL_NVLS_ENABLE")}


def placement_cfg(*argv):
    return config_from_args(build_parser().parse_args(list(argv))).placement


def launch_all(placement):
    layout = placement.layout
    trainers = [WhereAmI.options(**placement.trainer_options(r)).remote() for r in range(len(layout.trainer_gpus))]
    engines = [WhereAmI.options(**placement.engine_options(i)).remote() for i in range(len(layout.engines))]
    reports = ray.get([a.report.remote() for a in trainers + engines], timeout=120)
    for a in trainers + engines:
        ray.kill(a)
    return reports[:len(trainers)], reports[len(trainers):]


def assert_landed(placement, trainer_reports, engine_reports):
    layout = placement.layout
    for rank, rep in enumerate(trainer_reports):
        gpu = layout.trainer_gpus[rank]
        assert rep["node_id"] == placement.node_id_of[gpu[0]]
        assert rep["cuda_visible_devices"] == placement.device_of[gpu]
    for i, rep in enumerate(engine_reports):
        engine = layout.engines[i]
        assert rep["node_id"] == placement.node_id_of[engine[0][0]]
        assert rep["cuda_visible_devices"] == ",".join(placement.device_of[g] for g in engine)


@pytest.fixture(scope="module")
def local_ray():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # forwarded to every actor
    ray.init(num_gpus=8, num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()
    os.environ.pop("NCCL_NVLS_ENABLE")


def test_split_layout_on_local_cluster(local_ray):
    cfg = placement_cfg("--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    placement = ray_groups.place(cfg)
    try:
        trainers, engines = launch_all(placement)
        assert_landed(placement, trainers, engines)
        devices = [r["cuda_visible_devices"] for r in trainers + engines]
        assert sorted(",".join(devices).split(",")) == sorted(str(i) for i in range(8))  # no GPU twice
        assert all(len(d.split(",")) == 2 for d in devices[4:])
        assert {r["nccl_nvls"] for r in trainers + engines} == {"0"}
        assert placement.trainer_options(0)["num_gpus"] == 1
    finally:
        placement.remove()


def test_colocated_layout_shares_gpus(local_ray):
    cfg = placement_cfg("--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2")
    placement = ray_groups.place(cfg)
    try:
        trainers, engines = launch_all(placement)
        assert_landed(placement, trainers, engines)
        assert [e["cuda_visible_devices"] for e in engines] == [
            f"{trainers[0]['cuda_visible_devices']},{trainers[1]['cuda_visible_devices']}",
            f"{trainers[2]['cuda_visible_devices']},{trainers[3]['cuda_visible_devices']}"]
        assert placement.trainer_options(0)["num_gpus"] + placement.engine_options(0)["num_gpus"] <= 1
    finally:
        placement.remove()


def test_layout_larger_than_cluster_is_rejected(local_ray):
    cfg = placement_cfg("--rollout-num-gpus", "2")  # 8 trainer + 2 rollout > 8 GPUs on one node
    with pytest.raises(ConfigError, match=r"needs 10 GPUs on 2 node\(s\).*has 8 GPUs on 1 node"):
        ray_groups.place(cfg)


def test_nodes_smaller_than_num_gpus_per_node_are_rejected(local_ray):
    cfg = placement_cfg("--rollout-num-gpus", "2", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "16")
    with pytest.raises(ConfigError, match="--num-gpus-per-node is 16 but Ray node .* has 8 GPUs: set --num-gpus-per-node 8"):
        ray_groups.place(cfg)


@pytest.fixture(scope="module")
def two_node_cluster():
    from tests.transfer_helpers.cluster import two_node_ray

    with two_node_ray(gpus_per_node=4) as cluster:
        yield cluster


def test_multi_node_split_keeps_engines_inside_nodes(two_node_cluster):
    # 2 trainer GPUs on node 0; engines of 4 cannot use node 0's last 2 GPUs, so the engine goes to node 1
    cfg = placement_cfg("--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "4",
                        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "4")
    placement = ray_groups.place(cfg)
    try:
        trainers, engines = launch_all(placement)
        assert_landed(placement, trainers, engines)
        assert len({t["node_id"] for t in trainers}) == 1
        assert engines[0]["node_id"] != trainers[0]["node_id"]
        assert sorted(engines[0]["cuda_visible_devices"].split(",")) == ["0", "1", "2", "3"]
    finally:
        placement.remove()


def test_multi_node_trainer_spans_nodes(two_node_cluster):
    cfg = placement_cfg("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "2", "--num-gpus-per-node", "4",
                        "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    placement = ray_groups.place(cfg)
    try:
        trainers, engines = launch_all(placement)
        assert_landed(placement, trainers, engines)
        assert trainers[0]["node_id"] == trainers[1]["node_id"] != trainers[2]["node_id"] == trainers[3]["node_id"]
        assert engines[0]["node_id"] == trainers[0]["node_id"] and engines[1]["node_id"] == trainers[2]["node_id"]
    finally:
        placement.remove()


def test_multi_node_layout_too_big_is_rejected(two_node_cluster):
    cfg = placement_cfg("--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--num-gpus-per-node", "4",
                        "--rollout-num-gpus", "4")
    with pytest.raises(ConfigError, match=r"needs 12 GPUs on 3 node\(s\).*has 8 GPUs on 2 node"):
        ray_groups.place(cfg)


CONNECT_BESIDE_ANOTHER_CLUSTER = """
import ray
from rlplacement.placement import ray_groups
ray_groups.connect(local_num_gpus=3, local_num_cpus=1, verbose=False)
print("GPUs", ray.cluster_resources().get("GPU"))
ray.shutdown()
"""


def test_a_local_cluster_starts_beside_one_ray_start_left_on_the_machine():
    """``ray start`` (and ray's test clusters) record their address where ``ray.init()`` without one looks
    for a cluster to join; Ray then refuses the local cluster's logical GPU count. Without --ray-address or
    RAY_ADDRESS the job starts its own cluster instead (here beside an address nothing listens on: the
    job must not even try it)."""
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths live under it
    ray_dir = os.path.join(ray_tmp, "ray")
    os.makedirs(ray_dir)
    with open(os.path.join(ray_dir, "ray_current_cluster"), "w") as f:
        f.write("127.0.0.1:9")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-c", CONNECT_BESIDE_ANOTHER_CLUSTER], capture_output=True, text=True,
                          timeout=300, env={**env, "RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "disabled"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPUs 3.0" in proc.stdout


def test_ray_address_local_means_a_cluster_of_the_jobs_own(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_groups.cluster_to_join(None) is None
    assert ray_groups.cluster_to_join("10.0.0.1:6379") == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert ray_groups.cluster_to_join(None) == "10.0.0.2:6379" and ray_groups.cluster_to_join("local") is None
