"""Several trainer ranks sending one update (``rlplacement.transfer.multi_sender``): real private gloo groups,
one per sender, senders and receivers as threads; p2p over real Mooncake on loopback TCP.

Each sender sends only its share; every receiver ends with the union, bit for bit, whole or bucket by
bucket; a failure on one sender fails the update on every receiver, which keeps its previous version.
"""

import json
import threading

import pytest
import torch

from rlplacement.transfer import registry
from rlplacement.transfer.bucket import fused_group_of
from rlplacement.transfer.base import TransferEndpoint, UpdateAborted, UpdateReport
from rlplacement.transfer.multi_sender import (MultiSenderReceiver, merge_sender_reports, receiver_for,
                                               sender_bucket_size, with_more_senders)
from rlplacement.transfer.plan.senders import spread_owners, spread_owners_by_group

MODES = ("broadcast", "broadcast_packed", "p2p")
# the matrices' p2p cases start a Mooncake engine per sender (6-9 s a case): in `make test`, not in test-fast
MODE_PARAMS = ("broadcast", "broadcast_packed", pytest.param("p2p", marks=pytest.mark.slow))


def _model(seed):
    g = torch.Generator().manual_seed(seed)
    named = []
    for layer in range(4):
        p = f"model.layers.{layer}."
        named += [(p + "self_attn.q_proj.weight", torch.randn(32, 16, generator=g).to(torch.bfloat16)),
                  (p + "self_attn.k_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
                  (p + "self_attn.v_proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
                  (p + "input_layernorm.weight", torch.randn(16, generator=g))]
    named += [("model.embed_tokens.weight", torch.randn(64, 16, generator=g))]
    return named


def _run_threads(fns):
    errors, results = [None] * len(fns), [None] * len(fns)

    def wrap(i):
        try:
            results[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


class Senders:
    """``num_senders`` senders of ``mode`` (trainer ranks) and ``n_receivers`` receivers (engine workers)."""

    def __init__(self, mode, num_senders=2, n_receivers=2, bucket_bytes=1024, options=lambda i: {},
                 keeps=lambda i: None):
        self.senders = [registry.sender_class(mode)(bucket_bytes, timeout_s=20.0, device="cpu", **options(i))
                        for i in range(num_senders)]
        endpoints = [s.listen(1 + n_receivers, host="127.0.0.1").to_dict() for s in self.senders]
        endpoint = TransferEndpoint.from_dict(with_more_senders(endpoints))
        self.receivers = [receiver_for(registry.receiver_class(mode), endpoint, "cpu", version=0)
                          for _ in range(n_receivers)]
        for i, r in enumerate(self.receivers):
            r.keep_slices(keeps(i))  # published at join, as an engine worker's are
        _, errors = _run_threads([s.connect for s in self.senders] +
                                 [lambda i=i, r=r: r.connect(endpoint, i + 1) for i, r in enumerate(self.receivers)])
        assert errors == [None] * len(errors)

    def run(self, version, shares, *, bucketwise=False):
        """``applied[i]``: receiver ``i``'s ``(name, tensor)`` as its loader got them, a slice as ``(name,
        (box, whole shape, the slice's bytes))``."""
        from rlplacement.transfer.slice_tensor import box_of, slice_of

        applied = [[] for _ in self.receivers]

        def kept(tensors):
            return [(n, t.clone() if box_of(t) is None else (*box_of(t), slice_of(t).clone())) for n, t in tensors]

        def recv(i):
            r = self.receivers[i]
            r.begin(version)
            if bucketwise:
                r.receive_bucketwise(lambda tensors: applied[i].extend(kept(tensors)))
                r.commit(lambda staged: None)
            else:
                r.receive()
                r.commit(lambda staged: applied[i].extend(kept(staged)))

        results, errors = _run_threads([lambda s=s, share=share: s.update(version, share)
                                        for s, share in zip(self.senders, shares)] +
                                       [lambda i=i: recv(i) for i in range(len(self.receivers))])
        return results[:len(self.senders)], errors, applied

    def close(self):
        for x in self.senders + self.receivers:
            x.close()


def _shares(named, num_senders):
    owners = spread_owners_by_group([(n, t.numel() * t.element_size()) for n, t in named], num_senders, fused_group_of)
    return [[(n, t) for n, t in named if owners[n] == s] for s in range(num_senders)], owners


@pytest.mark.parametrize("mode", MODE_PARAMS)
@pytest.mark.parametrize("bucketwise", [False, True], ids=["full", "bucket"])
def test_every_receiver_gets_the_union_of_the_shares_bit_exact(mode, bucketwise):
    session = Senders(mode)
    try:
        assert all(isinstance(r, MultiSenderReceiver) for r in session.receivers)
        for version in (1, 2):
            named = _model(version)
            shares, owners = _shares(named, 2)
            assert all(shares), "both senders have a share"
            reports, errors, applied = session.run(version, shares, bucketwise=bucketwise)
            assert errors == [None] * 4
            want = dict(named)
            for got in applied:
                assert sorted(n for n, _ in got) == sorted(want)
                for name, tensor in got:
                    assert tensor.dtype == want[name].dtype and torch.equal(
                        tensor.view(torch.uint8), want[name].contiguous().view(torch.uint8)), name
            assert [r.version for r in session.receivers] == [version, version]
            merged = merge_sender_reports(reports)
            assert merged.num_tensors == len(named)
            assert merged.bytes_per_sender == tuple(sum(t.numel() * t.element_size() for _, t in share)
                                                    for share in shares)
            assert merged.metrics["perf/update_weights_senders"] == 2
            # q/k/v of a layer go from one sender: a fused parameter arrives in one bucket
            for layer in range(4):
                p = f"model.layers.{layer}.self_attn."
                assert owners[p + "q_proj.weight"] == owners[p + "k_proj.weight"] == owners[p + "v_proj.weight"]
    finally:
        session.close()


def test_disk_delta_senders_publish_their_shares_in_folders_of_their_own_and_deltas_chain(tmp_path):
    """Two disk-delta senders on one ``--update-weight-disk-dir``: each publishes in ``sender{i}``; versions 2
    and 3 are deltas on the bytes each receiver's channel committed last, bit-exact."""
    session = Senders("disk-delta", options=lambda i: {"disk_dir": str(tmp_path), "sender_index": i})
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sender0", "sender1"]
        g = torch.Generator().manual_seed(0)
        named = _model(1)
        for version in (1, 2, 3):
            named = [(n, t if i % 3 else t + torch.randn(t.shape, generator=g).to(t.dtype))
                     for i, (n, t) in enumerate(named)]  # a third of the tensors change each version
            shares, _ = _shares(named, 2)
            reports, errors, applied = session.run(version, shares)
            assert errors == [None] * 4
            assert [r.base_version for r in reports] == ([None, None] if version == 1 else [version - 1] * 2)
            merged = merge_sender_reports(reports)  # the delta's own numbers over both shares
            assert merged.changed_bytes == sum(r.changed_bytes for r in reports) > 0
            assert merged.wire_bytes == sum(r.wire_bytes for r in reports)
            assert merged.density == pytest.approx(merged.changed_bytes / merged.bytes)
            assert merged.base_version == reports[0].base_version
            want = dict(named)
            for got in applied:
                assert sorted(n for n, _ in got) == sorted(want)
                assert all(torch.equal(t.view(torch.uint8), want[n].contiguous().view(torch.uint8)) for n, t in got)
            for i, share in enumerate(shares):  # each folder's latest version holds exactly its sender's share
                index = json.loads((tmp_path / f"sender{i}" / f"weight_v{version:06d}" /
                                    "model.safetensors.index.json").read_text())
                assert set(index["tensors"]) == {n for n, _ in share}
    finally:
        session.close()


@pytest.mark.parametrize("bucketwise", [False, True], ids=["full", "bucket"])
def test_one_sender_failing_fails_the_update_on_every_receiver_and_the_next_one_lands(bucketwise):
    session = Senders("broadcast")
    try:
        named = _model(1)
        shares, _ = _shares(named, 2)

        def failing():
            yield shares[1][0]
            raise RuntimeError("gather failed on trainer rank 1")

        reports, errors, _ = session.run(1, [shares[0], failing()], bucketwise=bucketwise)
        assert isinstance(errors[1], UpdateAborted) and "gather failed on trainer rank 1" in str(errors[1])
        assert errors[0] is None  # rank 0's share went out whole; the update is still one update
        for e in errors[2:]:
            assert isinstance(e, UpdateAborted) and "gather failed on trainer rank 1" in str(e)
        assert [r.version for r in session.receivers] == [0, 0]
        named = _model(2)
        shares, _ = _shares(named, 2)
        reports, errors, applied = session.run(2, shares, bucketwise=bucketwise)
        assert errors == [None] * 4 and [r.version for r in session.receivers] == [2, 2]
        assert all(len(got) == len(named) for got in applied)
    finally:
        session.close()


def test_a_failed_bucket_stops_loading_on_every_channel():
    """Under bucket staging the first bucket the loader refuses stops the loading of every later bucket,
    whichever sender's channel it came from, and the failure is raised once every channel is drained."""
    session = Senders("broadcast", n_receivers=1, bucket_bytes=256)
    try:
        named = _model(1)
        shares, _ = _shares(named, 2)
        loaded = []

        def apply(tensors):
            if len(loaded) == 2:
                raise ValueError("loader refused a bucket")
            loaded.append([n for n, _ in tensors])

        receiver = session.receivers[0]
        receiver.begin(1)
        results, errors = _run_threads([lambda s=s, share=share: s.update(1, share)
                                        for s, share in zip(session.senders, shares)] +
                                       [lambda: receiver.receive_bucketwise(apply)])
        assert errors[:2] == [None, None]
        assert isinstance(errors[2], ValueError) and "loader refused a bucket" in str(errors[2])
        assert len(loaded) == 2 and receiver.version == 0
    finally:
        session.close()


def test_spread_owners_balance_largest_first():
    assert spread_owners([10, 1, 1, 1, 7, 2], 2) == [0, 1, 0, 1, 1, 1]  # 10+1 and 7+2+1+1
    owners = spread_owners([100] * 7 + [400], 4)
    load = [sum(s for s, o in zip([100] * 7 + [400], owners) if o == k) for k in range(4)]
    assert max(load) <= 400 and sum(load) == 1100
    with pytest.raises(ValueError, match="at least one sender"):
        spread_owners([1], 0)


def test_senders_divide_the_bucket_size_so_a_worker_holds_the_same_in_flight():
    mib = 1 << 20
    assert sender_bucket_size(512 * mib, 1) == 512 * mib
    assert sender_bucket_size(512 * mib, 8) == 64 * mib  # 8 channels x 2 slots x 64 MiB = 2 x 512 MiB
    assert sender_bucket_size(4 * mib, 16) == mib  # never below 1 MiB
    # pieces: half of that, for the tensors the worker assembles beside its channels' buffers
    assert sender_bucket_size(512 * mib, 8, pieces=True) == 32 * mib
    assert sender_bucket_size(512 * mib, 1, pieces=True) == 512 * mib


def test_merge_keeps_one_sender_report_as_it_is():
    report = UpdateReport(1, 3, 1, 30, 0.1)
    assert merge_sender_reports([report]) is report
    assert report.metrics["perf/update_weights_senders"] == 1
    assert report.metrics["perf/update_weights_max_sender_bytes"] == 30


def test_a_sender_per_worker_counts_the_update_once_and_its_ranks_must_agree():
    """Colocated (``whole_each``): every rank sent the whole update to the worker on its GPU."""
    from rlplacement.transfer.base import TransferError

    a = UpdateReport(1, 3, 2, 30, 0.1, checksums={"w": "x", "b": "y"})
    b = UpdateReport(1, 3, 2, 30, 0.2, checksums={"w": "x", "b": "y"})
    merged = merge_sender_reports([a, b], whole_each=True)
    assert (merged.num_tensors, merged.num_buckets, merged.bytes, merged.seconds) == (3, 2, 30, 0.2)
    assert merged.bytes_per_sender == (30, 30) and merged.checksums == {"w": "x", "b": "y"}
    with pytest.raises(TransferError, match="different bytes for 'b'"):
        merge_sender_reports([a, UpdateReport(1, 3, 2, 30, 0.1, checksums={"w": "x", "b": "z"})], whole_each=True)


def test_each_worker_joins_its_own_senders_group_at_rank_1():
    from rlplacement.transfer.base import TransferError
    from rlplacement.transfer.multi_sender import own_sender

    endpoints = [TransferEndpoint("cuda_ipc", "127.0.0.1", 1000 + i, 2, "gloo", f"g{i}").to_dict() for i in range(3)]
    joined = TransferEndpoint.from_dict(with_more_senders(endpoints, per_worker=True))
    for rank in (1, 2, 3):
        endpoint, rank_there = own_sender(joined, rank)
        assert (endpoint.port, endpoint.group_name, rank_there) == (999 + rank, f"g{rank - 1}", 1)
        assert not endpoint.more_senders and not endpoint.sender_per_worker
    with pytest.raises(TransferError, match="worker ranks 1 to 3"):
        own_sender(joined, 4)
    plain = TransferEndpoint.from_dict(endpoints[0])
    assert own_sender(plain, 3) == (plain, 3)  # every worker in one group: joined as it is
