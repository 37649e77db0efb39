"""broadcast / broadcast_packed over NCCL: sender on cuda:0, receiver process on cuda:1.

Needs a CUDA machine (skipped elsewhere); the same code runs over gloo in test_transfer_broadcast.py.
"""

import multiprocessing as mp

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one GPU)")]


def _receive(conn, device):
    from rlplacement.transfer import registry
    from rlplacement.transfer.base import TransferEndpoint, tensor_checksum

    torch.cuda.set_device(device)
    endpoint = TransferEndpoint.from_dict(conn.recv())
    receiver = registry.receiver_class(endpoint.mode)(device)
    receiver.connect(endpoint, 1)
    got = {}
    for version in (1, 2):
        receiver.begin(version)
        receiver.receive()
        receiver.commit(lambda staged: got.update({n: (str(t.device), tensor_checksum(t)) for n, t in staged}))
        conn.send(got)
    receiver.close()


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed"])
def test_nccl_updates_are_bit_exact(mode):
    from rlplacement.transfer import registry
    from rlplacement.transfer.base import tensor_checksum

    recv_device = "cuda:1"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receive, args=(child, recv_device), daemon=True)
    proc.start()
    try:
        sender = registry.sender_class(mode)(1 << 20, device="cuda:0", timeout_s=60)
        endpoint = sender.listen(2, host="127.0.0.1")
        assert endpoint.backend == "nccl"
        parent.send(endpoint.to_dict())
        sender.connect()
        for version in (1, 2):
            g = torch.Generator(device="cuda:0").manual_seed(version)
            named = [(f"model.layers.{i}.mlp.{k}.weight",
                      torch.randn(257, 129, generator=g, device="cuda:0").to(dt))
                     for i in range(4) for k, dt in (("gate_proj", torch.bfloat16), ("up_proj", torch.float16),
                                                      ("down_proj", torch.float32))]
            named.append(("scalar", torch.tensor(1.5, device="cuda:0")))
            named.append(("transposed", torch.randn(300, 7, device="cuda:0", generator=g).t()))
            report = sender.update(version, named)
            assert parent.poll(60)
            got = parent.recv()
            assert report.num_tensors == len(named)
            for name, t in named:
                assert got[name] == (recv_device, tensor_checksum(t)), name
        sender.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _rejoin(conn, device, rounds):
    """Receiver that, per round, joins a fresh group, takes one update, then closes its side *late*
    (after the sender has already rebuilt): NCCL's shutdown would wait for it, abort does not."""
    import time

    from rlplacement.transfer import registry
    from rlplacement.transfer.base import TransferEndpoint

    torch.cuda.set_device(device)
    receiver = None
    for version in range(1, rounds + 1):
        endpoint = TransferEndpoint.from_dict(conn.recv())
        if receiver is not None:
            time.sleep(5)  # hold the old group open while the sender has moved on
            receiver.close()
        receiver = registry.receiver_class(endpoint.mode)(device, version=version - 1)
        receiver.connect(endpoint, 1)
        receiver.begin(version)
        receiver.receive()
        receiver.commit(lambda staged: None)
        conn.send(version)
    receiver.close()


def test_group_rebuilt_three_times_never_waits_for_the_peer():
    """The sender's close() must not wait for the receiver to close its side (2 H200s: NCCL's shutdown
    took 20 s with the peer holding its side open for 20 s, abort 0.5 s)."""
    import time

    from rlplacement.transfer import registry

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_rejoin, args=(child, "cuda:1", 3), daemon=True)
    proc.start()
    try:
        named = [("w", torch.randn(1024, 1024, device="cuda:0"))]
        close_seconds = []
        sender = None
        for version in (1, 2, 3):
            if sender is not None:
                t0 = time.perf_counter()
                sender.close()
                close_seconds.append(time.perf_counter() - t0)
            sender = registry.sender_class("broadcast_packed")(1 << 20, device="cuda:0", timeout_s=60)
            parent.send(sender.listen(2, host="127.0.0.1").to_dict())
            sender.connect()
            sender.update(version, named)
            assert parent.poll(60) and parent.recv() == version
        sender.close()
        assert max(close_seconds) < 3.0, close_seconds  # the receiver held each old group 5 s
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
