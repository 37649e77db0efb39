"""broadcast / broadcast_packed over a real private gloo group (sender + 2 receivers as threads).

Threads keep this file fast; the group is the same TCP gloo group the engines join from other
processes (tests/test_vllm_transfer.py covers that with real vLLM engines).
"""

import threading

import pytest
import torch

from rlplacement.errors import PeerError
from rlplacement.transfer import registry
from rlplacement.transfer.base import (TransferError, UpdateAborted, WeightMismatchError, WeightUpdateError,
                                       tensor_checksum)
from rlplacement.transfer.broadcast.receiver import BroadcastReceiver

MODES = ("broadcast", "broadcast_packed", "cuda_ipc", "p2p")  # p2p: real Mooncake over loopback TCP


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(3):
        p = f"model.layers.{layer}."
        named += [(p + "self_attn.q_proj.weight", torch.randn(32, 16, generator=g).to(torch.bfloat16)),
                  (p + "self_attn.k_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
                  (p + "self_attn.v_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
                  (p + "input_layernorm.weight", torch.randn(16, generator=g)),
                  (p + "mlp.up_proj.weight", torch.randn(16, 40, generator=g).to(torch.float16).t())]
    named += [("scalar", torch.tensor(float(seed))), ("big", torch.randn(3000, generator=g))]
    return named


def _as_loaded(t):
    """What a loader taking a worker's slice ends up with: the box copied out of the staged tensor (through
    ``transfer.slice_tensor``'s check), zeros elsewhere; a whole tensor cloned."""
    from rlplacement.transfer import shards
    from rlplacement.transfer.slice_tensor import is_slice

    if not is_slice(t):
        return t.clone()
    out = torch.zeros(t.shape, dtype=t.dtype)
    shards.cut(out, t._box).copy_(shards.cut(t, t._box))
    return out


class Session:
    """A sender and N receiver threads joined on one group; ``run`` does one update everywhere."""

    def __init__(self, mode, n_receivers=2, bucket_bytes=4096, check_equal=False, timeout_s=20.0, keeps=None):
        """``keeps``: per receiver, the slices it keeps (``transfer.shards.Keeps``; None: whole tensors)."""
        self.sender = registry.sender_class(mode)(bucket_bytes, check_equal=check_equal, timeout_s=timeout_s,
                                                  device="cpu")
        endpoint = self.sender.listen(1 + n_receivers, host="127.0.0.1")
        self.receivers = [registry.receiver_class(mode)("cpu") for _ in range(n_receivers)]
        for receiver, kept in zip(self.receivers, keeps or []):
            receiver.keep_slices(kept)
        self._threads([lambda i=i: self.receivers[i].connect(endpoint, i + 1) for i in range(n_receivers)],
                      self.sender.connect)
        self.applied = [None] * n_receivers

    @staticmethod
    def _threads(fns, main):
        errors = [None] * len(fns)

        def wrap(i):
            try:
                fns[i]()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                errors[i] = exc

        threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(fns))]
        for t in threads:
            t.start()
        try:
            result = main()
        finally:
            for t in threads:
                t.join(60)
        return result, errors

    def run(self, version, named):
        def recv(i):
            r = self.receivers[i]
            r.begin(version)
            r.receive()
            r.commit(lambda staged: self.applied.__setitem__(i, [(n, _as_loaded(t)) for n, t in staged]))

        def send():
            try:
                return self.sender.update(version, named), None
            except BaseException as exc:  # noqa: BLE001
                return None, exc

        (report, send_error), errors = self._threads([lambda i=i: recv(i) for i in range(len(self.receivers))], send)
        return report, send_error, errors

    def close(self):
        self.sender.close()
        for r in self.receivers:
            r.close()


@pytest.fixture(params=MODES)
def mode(request):
    return request.param


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_updates_arrive_bit_exact_with_versions(mode):
    s = Session(mode)
    try:
        for version in (1, 2):
            named = _model(version)
            report, send_error, errors = s.run(version, named)
            assert send_error is None and errors == [None, None]
            assert report.num_tensors == len(named) and report.num_buckets > 3
            for r, applied in zip(s.receivers, s.applied):
                assert r.version == version
                assert [n for n, _ in applied] == [n for n, _ in named]
                for (name, src), (_, got) in zip(named, applied):
                    assert got.dtype == src.dtype and got.shape == src.shape, name
                    assert torch.equal(_bytes(src), _bytes(got)), name
        # steady state: the receivers' staging buffers were allocated in the first update only
        assert all(r.buffers.allocations == report.num_buckets for r in s.receivers)
    finally:
        s.close()


def test_check_equal_sends_checksums_and_catches_corruption(mode, monkeypatch):
    s = Session(mode, n_receivers=1, check_equal=True)
    try:
        named = _model(1)
        report, send_error, errors = s.run(1, named)
        assert send_error is None and errors == [None]
        assert report.checksums == {n: tensor_checksum(t) for n, t in named}
        # corrupt what lands in the receiver's buffer: it must refuse and stay on version 1. p2p replays its
        # second update (no per-bucket payload call; the checksums come with END): corrupt before it is read
        cls = type(s.receivers[0])
        hook = "_unpack" if mode == "p2p" else "_recv_payload"
        orig = getattr(cls, hook)

        def corrupting(self, buf, manifest):
            if hook == "_unpack" and manifest.index == 0:
                buf[0] ^= 0xFF
            out = orig(self, buf, manifest)
            if hook == "_recv_payload" and manifest.index == 0:
                buf[0] ^= 0xFF  # first byte of the first tensor
            return out

        monkeypatch.setattr(cls, hook, corrupting)
        report, send_error, errors = s.run(2, _model(2))
        if mode == "cuda_ipc":  # receivers acknowledge each bucket: the sender aborts the update everywhere
            assert isinstance(send_error, UpdateAborted) and "rank(s) 1 failed on bucket 0" in str(send_error)
        else:
            assert send_error is None
        assert isinstance(errors[0], WeightMismatchError) and "model.layers.0.self_attn.q_proj.weight" in str(errors[0])
        assert s.receivers[0].version == 1
        monkeypatch.setattr(cls, hook, orig)
        report, send_error, errors = s.run(3, _model(3))  # the group is still usable
        assert send_error is None and errors == [None] and s.receivers[0].version == 3
    finally:
        s.close()


def test_source_failure_aborts_everywhere_and_keeps_the_old_version(mode):
    s = Session(mode)
    try:
        assert s.run(1, _model(1))[2] == [None, None]

        def failing():
            yield from _model(2)[:4]
            raise RuntimeError("gather failed on rank 3")

        report, send_error, errors = s.run(2, failing())
        assert isinstance(send_error, UpdateAborted) and "gather failed on rank 3" in str(send_error)
        assert all(isinstance(e, UpdateAborted) and "gather failed on rank 3" in str(e) for e in errors)
        assert [r.version for r in s.receivers] == [1, 1]
        report, send_error, errors = s.run(2, _model(2))
        assert send_error is None and errors == [None, None] and [r.version for r in s.receivers] == [2, 2]
    finally:
        s.close()


def test_stale_version_is_refused_before_any_transfer():
    r = BroadcastReceiver()
    with pytest.raises(TransferError, match="before connect"):
        r.begin(1)


def test_unknown_mode_lists_the_known_ones():
    with pytest.raises(ValueError, match="broadcast, broadcast_packed, cuda_ipc"):
        registry.sender_class("carrier-pigeon")


def test_unchanged_manifests_are_sent_once_and_a_new_layout_is_sent_again(mode):
    s = Session(mode)
    try:
        # cuda_ipc: an oversized bucket grows its slot during the first update (a new handle), so the
        # manifests settle from the second update on
        for version in (1, 2):
            assert s.run(version, _model(version))[2] == [None, None]
        first = dict(s.receivers[0]._manifests)
        report, send_error, errors = s.run(3, _model(3))  # same layout, new bytes: manifests are reused
        assert send_error is None and errors == [None, None]
        assert first and all(s.receivers[0]._manifests[i][0] is first[i][0] for i in first)
        for (name, src), (_, got) in zip(_model(3), s.applied[0]):
            assert torch.equal(_bytes(src), _bytes(got)), name
        changed = [(n, t * 2 if n != "big" else torch.randn(500)) for n, t in _model(4)]  # "big" changes shape
        report, send_error, errors = s.run(4, changed)
        assert send_error is None and errors == [None, None]
        for (name, src), (_, got) in zip(changed, s.applied[1]):
            assert got.shape == src.shape and torch.equal(_bytes(src), _bytes(got)), name
    finally:
        s.close()


@pytest.mark.parametrize("error", [
    WeightMismatchError("model.norm.weight", "00ff", "0a0b", "receiver rank 2"),
    WeightUpdateError(7, {"engine 1": "TransferError: x", "trainer": "y"}),
    UpdateAborted("trainer aborted update to version 3: gather failed"),
    PeerError("trainer set-up", {"trainer rank 1": "actor died (process killed or crashed)"}),
])
def test_transfer_errors_survive_pickling_with_their_message(error):
    """Errors that cross processes keep their type, message and fields; a weight update's failure
    has the same shape as any peer's (``what``, ``failures``), so one handler reads both."""
    import pickle

    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)
    if isinstance(error, PeerError):
        assert back.failures == error.failures and str(back).startswith(f"{back.what} failed: ")


def test_p2p_write_failure_aborts_naming_the_engine_and_bucket():
    """Real Mooncake over TCP: a receiver whose staging memory is no longer registered refuses the
    trainer's write; the trainer raises naming that engine worker and the bucket, every receiver keeps
    its version, and once the memory is registered again the next update lands."""
    s = Session("p2p", bucket_bytes=1 << 20)
    try:
        assert s.run(1, _model(1))[2] == [None, None]
        engine = s.receivers[1]._engine
        for ptr in list(engine.registered):
            engine.te.unregister_memory(ptr)
        report, send_error, errors = s.run(2, _model(2))
        assert isinstance(send_error, UpdateAborted)
        assert "engine worker rank 2: bucket 0 failed to write" in str(send_error)
        assert all(isinstance(e, UpdateAborted) for e in errors)
        assert [r.version for r in s.receivers] == [1, 1]
        engine.registered.clear()  # registered afresh at the next bucket
        report, send_error, errors = s.run(3, _model(3))
        assert send_error is None and errors == [None, None] and [r.version for r in s.receivers] == [3, 3]
    finally:
        s.close()


def test_each_side_marks_its_phases_on_one_clock(mode):
    """Instants (time.monotonic) line the sides up: nothing is staged before the sender started, and
    each side's marks are in the order its phases run."""
    s = Session(mode)
    try:
        report, send_error, errors = s.run(1, _model(1))
        assert send_error is None and errors == [None, None]
        assert list(report.instants) == ["start", "end"] and report.instants["start"] < report.instants["end"]
        for r in s.receivers:
            assert list(r.instants) == ["begin", *(["first_frame"] if mode == "cuda_ipc" else []), "staged", "applied"]
            assert r.instants["staged"] > report.instants["start"]
            assert sorted(r.instants.values()) == list(r.instants.values())
    finally:
        s.close()


def _scaled(named, factor):
    return [(n, (t.float() * factor).to(t.dtype)) for n, t in named]


def test_p2p_replays_the_last_updates_buckets_with_no_collective_per_bucket():
    """Real Mooncake over TCP, many small buckets: the first update learns every destination bucket by bucket
    (3 collectives a bucket); later ones replay them with 4 collectives in all, bit-exact and checked; a
    stream whose layout changes part-way is replayed up to the change and goes bucket by bucket after it."""
    s = Session("p2p", bucket_bytes=2048, check_equal=True)
    try:
        named = _model(1)
        before = s.sender.collectives
        report, send_error, errors = s.run(1, named)
        assert send_error is None and errors == [None, None] and report.path == "buckets"
        buckets = report.num_buckets
        assert buckets > 5 and s.sender.collectives - before >= 3 * buckets
        for version in (2, 3):
            named = _scaled(named, 1.5)
            before = s.sender.collectives
            report, send_error, errors = s.run(version, named)
            assert send_error is None and errors == [None, None]
            assert report.path == "replay" and report.num_buckets == buckets
            assert s.sender.collectives - before == 4  # REPLAY, the refusals, END and its blob
            for applied in s.applied:
                assert [n for n, _ in applied] == [n for n, _ in named]
                assert all(torch.equal(_bytes(src), _bytes(got)) for (_, src), (_, got) in zip(named, applied))
        # the last tensor grows: every bucket before it replays, the rest goes bucket by bucket
        changed = named[:-1] + [("big", torch.randn(4000))]
        before = s.sender.collectives
        report, send_error, errors = s.run(4, changed)
        assert send_error is None and errors == [None, None] and report.path == "replay"
        assert 4 < s.sender.collectives - before < 3 * buckets
        for applied in s.applied:
            assert all(torch.equal(_bytes(src), _bytes(got)) for (_, src), (_, got) in zip(changed, applied))
        before = s.sender.collectives
        report, send_error, errors = s.run(5, _scaled(changed, 2.0))  # the new layout replays in turn
        assert send_error is None and errors == [None, None] and s.sender.collectives - before == 4
        assert [r.version for r in s.receivers] == [5, 5]
    finally:
        s.close()

