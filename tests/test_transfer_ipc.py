"""Mode ``cuda_ipc`` pieces on CPU (/dev/shm): shared slot buffers and their clean-up, and a bucket
that a receiver cannot open aborting the update everywhere. Threads and a real gloo group, as in
tests/test_transfer_broadcast.py (which also runs its shared cases for cuda_ipc)."""

import os

import pytest
import torch

from rlplacement.transfer.base import TransferError, UpdateAborted
from rlplacement.transfer.cuda_ipc.buckets import OpenedBuffer, SharedSlots, leftover_shm_files
from tests.test_transfer_broadcast import Session, _model


def test_slots_share_bytes_grow_once_and_leave_nothing_in_dev_shm():
    slots = SharedSlots("cpu", min_nbytes=1000)
    buf, desc = slots.get(0, 10)
    assert desc["kind"] == "shm" and desc["nbytes"] == 1000 and os.path.exists(desc["path"])
    buf[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    opened = OpenedBuffer(desc, torch.device("cpu"))
    dst = torch.zeros(8, dtype=torch.uint8)
    opened.copy_to(dst, 4)
    assert dst[:4].tolist() == [1, 2, 3, 4]
    assert slots.get(0, 1000)[1] is desc and slots.allocations == 1  # fits: same buffer, same handle
    slots.release(0)  # every receiver has it open: the name goes, the mapping stays
    assert not os.path.exists(desc["path"]) and leftover_shm_files(slots.tag) == []
    buf[:4] = 9
    opened.copy_to(dst, 4)
    assert dst[:4].tolist() == [9] * 4
    _, grown = slots.get(0, 5000)  # an oversized bucket: a new buffer under a new key
    assert grown["key"] != desc["key"] and grown["nbytes"] == 5000 and slots.allocations == 2
    with pytest.raises(TransferError, match="does not fit shared buffer"):
        opened.copy_to(torch.zeros(2000, dtype=torch.uint8), 2000)
    opened.close()
    slots.get(1, 10)
    assert len(leftover_shm_files(slots.tag)) == 2
    slots.close()
    assert leftover_shm_files(slots.tag) == []


def test_a_handle_from_another_host_is_refused_by_name():
    slots = SharedSlots("cpu")
    try:
        desc = {**slots.get(0, 16)[1], "host": "trainer-node-7"}
        with pytest.raises(TransferError, match="buckets are on host 'trainer-node-7'.*drop --colocate"):
            OpenedBuffer(desc, torch.device("cpu"))
    finally:
        slots.close()


def test_a_receiver_that_cannot_open_a_bucket_aborts_the_update_everywhere(monkeypatch):
    s = Session("cuda_ipc", check_equal=True)
    try:
        assert s.run(1, _model(1))[1:] == (None, [None, None])
        receiver = s.receivers[1]
        original = type(receiver)._open

        def refuse_new_handles(info):
            if info["key"] not in {o.key for o in receiver._opened.values()}:
                raise TransferError(f"cannot open {info['key']}")
            return original(receiver, info)

        monkeypatch.setattr(receiver, "_open", refuse_new_handles)
        s.sender.buffers.close()  # the next update exports fresh buffers, which receiver 2 cannot open
        report, send_error, errors = s.run(2, _model(2))
        assert isinstance(send_error, UpdateAborted) and "rank(s) 2 failed on bucket 0" in str(send_error)
        assert isinstance(errors[0], UpdateAborted) and "rank(s) 2 failed" in str(errors[0])
        assert isinstance(errors[1], TransferError) and "cannot open" in str(errors[1])
        assert [r.version for r in s.receivers] == [1, 1]
        monkeypatch.undo()
        report, send_error, errors = s.run(2, _model(2))  # the group is still usable
        assert send_error is None and errors == [None, None] and [r.version for r in s.receivers] == [2, 2]
        tag = s.sender.buffers.tag
    finally:
        s.close()
    assert leftover_shm_files(tag) == []


def test_resident_tensors_on_cpu_go_by_buckets_bit_exact():
    """The direct path maps GPU allocations (tests/test_transfer_ipc_direct_gpu.py); a CPU trainer's
    memory is not shareable, so ``resident=True`` changes nothing there."""
    s = Session("cuda_ipc", check_equal=True)
    try:
        named = _model(1)
        (report, send_error), errors = s._threads(
            [lambda i=i: (s.receivers[i].begin(1), s.receivers[i].receive(),
                          s.receivers[i].commit(lambda staged, i=i: s.applied.__setitem__(i, staged)))
             for i in range(2)],
            lambda: (s.sender.update(1, named, resident=True), None))
        assert errors == [None, None] and report.path == "buckets"
        assert all(r.last_path == "buckets" for r in s.receivers)
        for applied in s.applied:
            assert all(torch.equal(a, t) for (_, a), (_, t) in zip(applied, named))
    finally:
        s.close()


def test_resident_row_groups_on_cpu_reach_the_engines_in_their_hf_shapes():
    """A Megatron trainer's q/k/v are row groups of its fused QKV (``hf_shapes``): where they cannot be
    read in place the sender packs them in their HF shapes, so receivers stage HF tensors."""
    s = Session("cuda_ipc", check_equal=True)
    try:
        named = _model(1)
        fused = torch.randn(24, 8)
        grouped = fused.view(2, 12, 8)[:, :8]  # two query groups' q rows, k and v rows between them
        named = named + [("q_grouped", grouped)]
        (report, _), errors = s._threads(
            [lambda i=i: (s.receivers[i].begin(1), s.receivers[i].receive(),
                          s.receivers[i].commit(lambda staged, i=i: s.applied.__setitem__(i, staged)))
             for i in range(2)],
            lambda: (s.sender.update(1, named, resident=True, hf_shapes={"q_grouped": (16, 8)}), None))
        assert errors == [None, None] and report.path == "buckets"
        for applied in s.applied:
            got = dict(applied)
            assert tuple(got["q_grouped"].shape) == (16, 8) and torch.equal(got["q_grouped"], grouped.reshape(16, 8))
            assert all(torch.equal(got[n], t) for n, t in named[:-1])
    finally:
        s.close()


def test_direct_manifest_views_keep_row_groups_and_name_their_hf_shapes_cpu_stand_in(monkeypatch):
    """The receiver's side of a direct manifest (GPU memory on a real run; here a CPU buffer stands in for
    the mapped allocation): tensors in their HF shapes where that is a view, q/k/v row groups kept as
    ``[groups, rows, ...]`` and named with their HF shapes, anything else refused by name."""
    import json
    import socket

    from rlplacement.transfer.cuda_ipc import direct as ipc_direct
    from rlplacement.transfer.base import TransferError

    fused = torch.randn(24, 8)  # a fused QKV of two query groups: 12 rows each, its 8 q rows first
    memory = fused.view(-1).view(torch.uint8)
    monkeypatch.setattr(ipc_direct.cuda_driver, "DeviceBytes", lambda ptr, nbytes: memory[ptr:ptr + nbytes])

    def views(rows):
        m = ipc_direct.MappedAllocations(torch.device("cpu"))
        m.parse(json.dumps({"host": socket.gethostname(), "keep_mapped": False,
                            "segments": [{"key": "k", "size": memory.numel(), "handle": ""}],
                            "tensors": rows}).encode())
        m._mapped = {"k": 0}
        return m._make_views(), m.hf_shapes

    q = ["q", "float32", [2, 8, 8], [96, 8, 1], 0, 0, [16, 8]]  # rows 0-7 and 12-19
    norm = ["norm", "float32", [1, 8], [8, 1], 0, 8 * 8 * 4, [8]]  # contiguous: a view in its HF shape
    got, shapes = views([q, norm])
    assert shapes == {"q": (16, 8)} and tuple(got[0][1].shape) == (2, 8, 8)
    assert torch.equal(got[0][1].reshape(16, 8), torch.cat([fused[0:8], fused[12:20]]))
    assert tuple(got[1][1].shape) == (8,) and torch.equal(got[1][1], fused[8])
    with pytest.raises(TransferError, match="'q' of shape \\(2, 8, 8\\) is not its HF shape \\(8, 16\\)"):
        views([q[:6] + [[8, 16]]])
