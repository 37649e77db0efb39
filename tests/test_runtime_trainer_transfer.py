"""The trainer side's set-up from flags: every option of the chosen mode reaches its sender."""

import argparse

import pytest

from rlplacement.args import add_arguments, config_from_args
from rlplacement.runtime.trainer_transfer import TrainerTransferMixin


def _transfer_config(*flags):
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", *flags])
    return config_from_args(args).transfer


def test_disk_delta_flags_reach_the_sender(tmp_path):
    config = _transfer_config("--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir",
                              str(tmp_path / "deltas"), "--update-weight-delta-encoding", "overwrite",
                              "--update-weight-buffer-size", "12345B", "--check-weight-update-equal")
    trainer = TrainerTransferMixin()
    trainer.transfer_setup_from_config(config, device="cpu", base_dir=str(tmp_path / "hf"))
    try:
        sender = trainer.transfer_sender
        assert type(sender).__name__ == "DiskDeltaSender"
        assert sender.root == tmp_path / "deltas" and sender.encoding == "overwrite"
        assert sender.base_dir == tmp_path / "hf"
        assert sender.bucket_bytes == 12345 and sender.check_equal
    finally:
        trainer.transfer_close()


def test_a_mode_override_keeps_the_other_flags():
    config = _transfer_config("--update-weight-buffer-size", "4KiB")
    trainer = TrainerTransferMixin()
    trainer.transfer_setup_from_config(config, device="cpu", mode="broadcast_packed", check_equal=True)
    try:
        sender = trainer.transfer_sender
        assert sender.mode == "broadcast_packed" and sender.bucket_bytes == 4096 and sender.check_equal
    finally:
        trainer.transfer_close()


def test_a_failed_send_finishes_the_gathers_with_the_other_ranks():
    """Two trainer ranks on a real gloo group, each tensor behind a collective (as FSDP's
    full_tensor()). Rank 0's sender fails after 3 tensors (a stand-in sender: the wire itself is
    tested elsewhere); rank 1 must still get through every gather, and both stay in step."""
    import datetime
    import threading

    import torch
    import torch.distributed as dist

    from rlplacement.transfer.base import TransferError

    master = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    stores = [master, dist.TCPStore("127.0.0.1", master.port, 2, is_master=False)]  # one client per rank
    timeout = datetime.timedelta(seconds=20)
    groups = [None, None]

    def join(rank):
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("t", stores[rank]), rank, 2, timeout)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]

    class Rank(TrainerTransferMixin):
        def __init__(self, rank):
            self.rank = rank

        def hf_named_tensors(self):
            for i in range(8):
                t = torch.full((4,), float(self.rank + i))
                groups[self.rank].allreduce([t]).wait()  # a gather every rank takes part in
                yield f"w{i}", t

    class FailingSender:
        def update(self, version, tensors, *, resident=False, hf_shapes=None):
            for i, _ in enumerate(tensors):
                if i == 2:
                    raise TransferError("the wire broke at tensor 2")

    rank0, rank1 = Rank(0), Rank(1)
    rank0.transfer_sender = FailingSender()
    seen = {}
    helper = threading.Thread(target=lambda: seen.update(n=sum(1 for _ in rank1.hf_named_tensors())))
    helper.start()
    with pytest.raises(TransferError, match="tensor 2"):
        rank0.transfer_send(1)
    helper.join(15)
    assert not helper.is_alive() and seen["n"] == 8
    check = [torch.ones(1), torch.ones(1)]  # the next collective pairs up: the ranks are in step
    works = [groups[r].allreduce([check[r]]) for r in range(2)]
    [w.wait() for w in works]
    assert [c.item() for c in check] == [2.0, 2.0]


def test_the_driver_finds_the_engine_and_tensor_that_differ():
    from rlplacement.runtime.transfer_driver import first_mismatch

    want = {"a": "01", "b": "02"}
    assert first_mismatch(want, [dict(want), dict(want)]) is None
    engine, error = first_mismatch(want, [dict(want), {"a": "01", "b": "ff"}])
    assert engine == 1 and "tensor 'b' has checksum ff but the trainer sent 02" in str(error)
    engine, error = first_mismatch(want, [{"a": "01"}])
    assert engine == 0 and "tensor 'b' has checksum <missing>" in str(error)


def test_the_trainer_refuses_to_free_weights_engines_may_map_until_told_they_let_go_gpu_state_stand_in():
    """cuda_ipc's engines keep the trainer's allocations mapped between updates, and freeing mapped
    memory is undefined; the mapped state only arises on a GPU, so it is set by hand here."""
    import types

    import torch

    from rlplacement.runtime.trainer_worker import TrainerWorker
    from rlplacement.transfer.cuda_ipc.sender import IpcSender
    from rlplacement.transfer.cuda_ipc.direct import AllocationExports

    offloads = []
    worker = TrainerWorker(0, 1)
    worker.backend = types.SimpleNamespace(offload_to_host=lambda: offloads.append(1) or {"seconds": 0.0},
                                           offloaded_to_host=False,
                                           refuse_while_chunks_open=lambda what, because: None)
    sender = IpcSender(1 << 20, device="cpu")
    assert not sender.keep_mapped_between_updates()  # on CPU nothing of the trainer is mapped elsewhere
    sender.exports = AllocationExports(torch.device("cuda", 0))  # as on a GPU; nothing here touches CUDA
    assert sender.keep_mapped_between_updates()
    worker.transfer_sender = sender
    sender.exports.mapped_elsewhere = True  # what a direct update with kept mappings leaves
    with pytest.raises(RuntimeError, match=r"engines may still map this trainer's weights.*unmap_trainer_memory\(\)"):
        worker.offload_to_host()
    assert offloads == [] and sender.mapped_elsewhere
    worker.offload_to_host(engines_unmapped=True)
    assert offloads == [1] and not sender.mapped_elsewhere
    worker.offload_to_host()  # nothing mapped since: no unmap needed
    assert offloads == [1, 1]
    sender.exports = None
    sender.close()
