"""The transfer group's point-to-point messages (rlplacement.transfer.group), which carry a direct
cuda_ipc update's acknowledgements: one message per receiver, in order, each from its own rank.
Real gloo groups in three processes."""

import torch

from tests.transfer_helpers.spawned import run_sender_and_receivers

TAG = 6
STEPS = 3


def _group(store, rank: int):
    from rlplacement.transfer.group import TransferGroup

    return TransferGroup(store, "acks", rank, 3, "gloo", "cpu", 30.0)


def _sender(endpoint_q, result_q):
    from rlplacement.rendezvous import host_store

    try:
        store, port = host_store("127.0.0.1", 3, 30.0)
        for _ in range(2):
            endpoint_q.put(port)
        group = _group(store, 0)
        got = []
        for _ in range(STEPS):
            status = torch.zeros(3, dtype=torch.int32)
            works = [group.recv(status[r:r + 1], r, TAG) for r in (1, 2)]
            for work in works:
                work.wait()
            got.append(status.tolist())
        group.broadcast(torch.zeros(1))  # everyone's messages are in: the receivers may close
        result_q.put(("sender", got))
        group.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put(("sender", f"{type(exc).__name__}: {exc}"))


def _receiver(rank, endpoint_q, result_q):
    from rlplacement.rendezvous import join_store

    try:
        group = _group(join_store("127.0.0.1", endpoint_q.get(timeout=30), 3, 30.0), rank)
        for step in range(STEPS):  # sent before the sender asks: messages wait for their receive
            group.send(torch.tensor([10 * rank + step], dtype=torch.int32), 0, TAG)
        group.broadcast(torch.zeros(1))
        result_q.put((f"receiver {rank}", {"sent": STEPS}))
        group.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put((f"receiver {rank}", f"{type(exc).__name__}: {exc}"))


def test_each_receivers_messages_reach_the_sender_in_order_and_by_rank():
    results = run_sender_and_receivers(_sender, _receiver, 2, timeout_s=120)
    assert results["sender"] == [[0, 10 + step, 20 + step] for step in range(STEPS)]
