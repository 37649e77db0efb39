"""Mode ``cuda_ipc`` with real CUDA IPC: a sender process and two receiver processes on one GPU
(as under --colocate), bit for bit, with the trainer's allocator in its default setting and with
expandable segments on (whose blocks cannot be exported as legacy IPC handles unless the bucket
buffers are allocated outside them). Skipped where there is no GPU; the same protocol runs on CPU
over /dev/shm in tests/test_transfer_broadcast.py and tests/test_vllm_transfer_ipc.py.
"""

import os

import pytest
import torch

from tests.transfer_helpers.spawned import run_sender_and_receivers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA IPC needs a GPU; the CPU variant of cuda_ipc (/dev/shm) runs elsewhere")]

BUCKET = 1 << 20
N_RECEIVERS = 2


def _model(seed: int):
    g = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(4):
        p = f"model.layers.{layer}."
        named += [(p + "self_attn.q_proj.weight", torch.randn(256, 128, generator=g).to(torch.bfloat16)),
                  (p + "self_attn.k_proj.weight", torch.randn(64, 128, generator=g).to(torch.bfloat16)),
                  (p + "self_attn.v_proj.weight", torch.randn(64, 128, generator=g).to(torch.bfloat16)),
                  (p + "input_layernorm.weight", torch.randn(128, generator=g)),
                  (p + "mlp.up_proj.weight", torch.randn(128, 512, generator=g).to(torch.float16).t())]
    named += [("scalar", torch.tensor(float(seed))), ("embed", torch.randn(600_000, generator=g))]  # > bucket
    return named


def _sender(alloc_conf, endpoint_q, result_q, versions):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    from rlplacement.transfer import registry
    from rlplacement.transfer.base import tensor_checksum

    try:
        sender = registry.sender_class("cuda_ipc")(BUCKET, check_equal=True, timeout_s=60, device="cuda:0")
        endpoint = sender.listen(1 + N_RECEIVERS, host="127.0.0.1")
        for _ in range(N_RECEIVERS):
            endpoint_q.put(endpoint.to_dict())
        sender.connect()
        for v in versions:
            named = [(n, t.cuda()) for n, t in _model(v)]
            report = sender.update(v, named)
            assert report.checksums == {n: tensor_checksum(t) for n, t in named}
        result_q.put(("sender", {"allocations": sender.buffers.allocations,
                                 "kinds": sorted({d["kind"] for _, d in sender.buffers._slots.values()})}))
        sender.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put(("sender", f"{type(exc).__name__}: {exc}"))


def _receiver(rank, endpoint_q, result_q, versions):
    from rlplacement.transfer import registry
    from rlplacement.transfer.base import TransferEndpoint, tensor_checksum

    try:
        receiver = registry.receiver_class("cuda_ipc")("cuda:0")
        receiver.connect(TransferEndpoint.from_dict(endpoint_q.get(timeout=60)), rank)
        sums = {}
        for v in versions:
            receiver.begin(v)
            receiver.receive()
            assert all(t.device.type == "cuda" for _, t in receiver.staged)
            receiver.commit(lambda staged: sums.update({n: tensor_checksum(t) for n, t in staged}))
        result_q.put((f"receiver {rank}", {"sums": sums, "version": receiver.version,
                                           "handles_opened": receiver.handles_opened}))
        receiver.close()
    except BaseException as exc:  # noqa: BLE001
        result_q.put((f"receiver {rank}", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_cuda_ipc_between_processes_on_one_gpu_is_bit_exact(alloc_conf):
    from rlplacement.transfer.base import tensor_checksum

    versions = [1, 2, 3]
    results = run_sender_and_receivers(_sender, _receiver, N_RECEIVERS, sender_args=(alloc_conf,), extra=(versions,))
    want = {n: tensor_checksum(t) for n, t in _model(versions[-1])}
    assert results["sender"]["kinds"] == ["cuda"]
    for rank in range(1, 1 + N_RECEIVERS):
        got = results[f"receiver {rank}"]
        assert got["version"] == versions[-1] and got["sums"] == want
        assert got["handles_opened"] == results["sender"]["allocations"]  # one handle per buffer, reused
