"""No open doors: a job on 127.0.0.1 opens its rendezvous stores on loopback only (connections to this
machine's other address are refused), Mooncake holds registered only the staging memory that is
alive (a write into a freed slot is refused by the engine itself), and a local Ray cluster keeps its
token authentication. What cannot be bound (Mooncake's ports) is pinned by a strict xfail, so a
Mooncake that starts honouring a bind address shows up here (docs/security.md)."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from rlplacement.rendezvous import host_store, job_host, join_store

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _non_loopback_address() -> str | None:
    """This machine's address on its default route (the one other machines reach), else its first global
    IPv4 address (``ip -4 -o addr``), else None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("198.51.100.1", 9))  # no packet is sent: this only picks the route
            addr = s.getsockname()[0]
        if not addr.startswith("127."):
            return addr
    except OSError:
        pass
    try:
        lines = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = [w.split("/")[0] for line in lines.splitlines() if "scope global" in line
             for w in line.split()[3:4]]
    return found[0] if found else None


@pytest.fixture(scope="module")
def outside():
    addr = _non_loopback_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the doors from")
    return addr


def _refused(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=3):
            return False
    except ConnectionRefusedError:
        return True


def test_a_store_on_loopback_refuses_other_interfaces_and_serves_loopback(outside):
    store, port = host_store("127.0.0.1", 2, 10.0)
    assert _refused(outside, port)
    client = join_store("127.0.0.1", port, 2, 10.0)
    client.set("k", b"v")
    assert store.get("k") == b"v"


def test_a_store_refuses_a_host_that_is_not_this_machine():
    with pytest.raises(OSError, match=r"rendezvous: cannot listen on '198\.51\.100\.77'"):
        host_store("198.51.100.77", 2, 5.0)  # TEST-NET-2: documentation only, never this machine's


def test_one_machine_jobs_use_loopback_for_the_trainer_and_the_transfer_group(outside):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray cluster from another test is up in this process")
    from rlplacement.runtime.trainer_worker import TrainerWorker
    from rlplacement.transfer import registry

    assert job_host() == "127.0.0.1"
    host, port = TrainerWorker(0, 2).address(timeout_s=10)  # the trainer's default process group store
    assert host == "127.0.0.1" and _refused(outside, port)
    sender = registry.sender_class("broadcast")(4096, device="cpu", timeout_s=10)
    endpoint = sender.listen(2)  # the transfer group's store, on the default host
    try:
        assert endpoint.host == "127.0.0.1" and _refused(outside, endpoint.port)
    finally:
        sender.close()


@pytest.mark.xfail(strict=True, reason="mooncake-transfer-engine 0.3.13 binds its handshake port on 0.0.0.0 "
                                       "whatever the host or MC_TCP_BIND_ADDRESS (docs/security.md)")
def test_mooncake_handshake_port_refuses_other_interfaces(outside):
    from rlplacement.transfer.p2p.mooncake import MooncakeEngine

    engine = MooncakeEngine("127.0.0.1", "tcp")
    try:
        assert _refused(outside, engine.te.get_rpc_port())
    finally:
        engine.close()


@pytest.fixture(scope="module")
def engines():
    from rlplacement.transfer.p2p.mooncake import MooncakeEngine

    target, writer = MooncakeEngine("127.0.0.1", "tcp"), MooncakeEngine("127.0.0.1", "tcp")
    yield target, writer
    target.close()
    writer.close()


def test_a_freed_slot_is_unregistered_and_a_peer_write_into_it_refused(engines):
    """Through the engine's own check: the server refuses a write outside registered memory."""
    from rlplacement.transfer.p2p.mooncake import RegisteredBuffers

    target, writer = engines
    src = torch.full((1 << 16,), 7, dtype=torch.uint8)
    src_ptr = writer.register(src)

    def write(dst: torch.Tensor) -> int:
        return writer.te.transfer_sync_write(target.session, src_ptr, dst.data_ptr(), 4096)

    slots = RegisteredBuffers("cpu", target)
    small = slots.get(0, 4096)
    target.register(small)
    assert write(small) == 0 and int(small.sum()) == 7 * 4096
    grown = slots.get(0, 1 << 16)  # slot 0 grows: the small buffer is let go
    assert grown is not small and list(target.registered) == []
    assert write(small) != 0
    target.register(grown)
    assert write(grown) == 0
    slots.trim(0)
    assert list(target.registered) == [] and write(grown) != 0


def _model(seed: int, big: int):
    g = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(n, generator=g)) for i, n in enumerate((300, 700, big, 90))]


def test_p2p_registrations_follow_the_live_staging_and_go_at_close():
    from tests.test_transfer_broadcast import Session

    s = Session("p2p", bucket_bytes=4096)
    try:
        for version, model in ((1, _model(1, 500)), (2, _model(2, 5000)), (3, _model(3, 200))):
            _, send_error, errors = s.run(version, model)
            assert send_error is None and errors == [None, None]
            for side in [s.sender, *s.receivers]:
                live = {b.data_ptr() for b in side.buffers._slots.values()}
                assert set(side._engine.registered) <= live
        # the update with the big tensor grew slots and the next one trimmed them: memory was let go
        assert s.sender.buffers.allocations > len(s.sender.buffers._slots)
        assert all(r.buffers.allocations > len(r.buffers._slots) for r in s.receivers)
        assert [name for name, _ in s.applied[0]] == ["w0", "w1", "w2", "w3"]
        engines = [s.sender._engine, *(r._engine for r in s.receivers)]
    finally:
        s.close()
    assert [len(e.registered) for e in engines] == [0, 0, 0]


def test_a_local_ray_cluster_keeps_token_authentication(tmp_path):
    """In a fresh process (Ray reads the mode once per process) with RAY_AUTH_MODE unset."""
    pytest.importorskip("ray")
    script = textwrap.dedent("""
        import os, stat, ray
        from rlplacement.placement import ray_groups
        ray_groups.connect(local_num_gpus=1, local_num_cpus=1, verbose=False)
        mode = ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_MODE")).options(num_cpus=0).remote(), timeout=60)
        token = os.path.expanduser("~/.ray/auth_token")
        perms = [oct(stat.S_IMODE(os.stat(p).st_mode)) for p in (token, os.path.dirname(token))]
        print("MODE", mode, *perms)
        ray.shutdown()
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(tmp_path), PYTHONPATH=REPO, RAY_COLOR_PREFIX="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert "MODE token 0o600 0o700" in out.stdout, out.stdout + out.stderr[-3000:]
