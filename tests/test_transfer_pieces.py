"""Senders that send pieces (``rlplacement.transfer.pieces``): each trainer rank its dim-0 rows of every tensor,
as FSDP2 shards them, never a whole tensor; each engine worker assembles every tensor, or the slice it keeps,
from all senders' pieces. Real private gloo groups (one per sender), senders and receivers as threads; p2p
over real Mooncake on loopback TCP.
"""

import pytest
import torch

from rlplacement.transfer import pieces
from rlplacement.transfer.base import TransferError
from rlplacement.transfer.multi_sender import merge_sender_reports
from rlplacement.transfer.pieces import PieceAssembler, kept_part, parse_piece, piece_name, split_piece_key
from rlplacement.transfer.shards import parse_region_key, region_key
from tests.test_transfer_multi_sender import MODE_PARAMS, MODES, Senders


def _model(seed):
    """Column-parallel (q, gate: dim-0 slices), row-parallel (o: dim-1 slices), a norm kept whole, rows that
    two and three senders split unevenly, and a one-row tensor only the first sender holds."""
    g = torch.Generator().manual_seed(seed)
    return [("model.layers.0.self_attn.q_proj.weight", torch.randn(32, 16, generator=g).to(torch.bfloat16)),
            ("model.layers.0.self_attn.o_proj.weight", torch.randn(16, 32, generator=g).to(torch.bfloat16)),
            ("model.layers.0.mlp.gate_proj.weight", torch.randn(21, 16, generator=g)),
            ("model.layers.0.input_layernorm.weight", torch.randn(17, generator=g)),
            ("model.bias_row", torch.randn(1, 8, generator=g))]


KEEPS = [  # a two-wide engine's workers (vLLM's TP slices of q, gate and o)
    {"model.layers.0.self_attn.q_proj.weight": ((0, 16), (0, 16)),
     "model.layers.0.self_attn.o_proj.weight": ((0, 16), (0, 16)),
     "model.layers.0.mlp.gate_proj.weight": ((0, 11), (0, 16))},
    {"model.layers.0.self_attn.q_proj.weight": ((16, 32), (0, 16)),
     "model.layers.0.self_attn.o_proj.weight": ((0, 16), (16, 32)),
     "model.layers.0.mlp.gate_proj.weight": ((11, 21), (0, 16))}]


WHOLE = "model.layers.0.input_layernorm.weight"  # sent whole by the last sender, as a megatron rank sends a norm


def row_pieces(named, num_senders, whole=()):
    """Each sender's rows of every tensor (``torch.chunk``'s split, as FSDP2's ``Shard(0)``), under piece names;
    the tensors named in ``whole`` whole, from the last sender."""
    shares = [[] for _ in range(num_senders)]
    for name, t in named:
        if name in whole:
            shares[-1].append((name, t))
            continue
        for s, key, rows in pieces.row_pieces(name, t, num_senders):
            shares[s].append((key, rows))
    return shares


def _assert_assembled(got, named, keeps):
    want = dict(named)
    assert sorted(n for n, _ in got) == sorted(want)
    for name, tensor in got:
        box = keeps.get(name) if keeps else None
        if box is None:
            assert isinstance(tensor, torch.Tensor), name
            expected = want[name]
        else:
            got_box, whole_shape, tensor = tensor
            assert got_box == box and whole_shape == tuple(want[name].shape), name
            expected = want[name][tuple(slice(a, b) for a, b in box)]
        assert tensor.dtype == expected.dtype and torch.equal(tensor.contiguous().view(torch.uint8),
                                                              expected.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("mode", MODE_PARAMS)
@pytest.mark.parametrize("bucketwise", [False, True], ids=["full", "bucket"])
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "slices"])
def test_workers_assemble_every_tensor_or_their_slice_from_every_senders_rows(mode, bucketwise, sliced):
    keeps = KEEPS if sliced else [None, None]
    session = Senders(mode, num_senders=3, bucket_bytes=512, keeps=lambda i: keeps[i])
    try:
        for version in (1, 2):
            named = _model(version)
            shares = row_pieces(named, 3, whole=(WHOLE,) if version == 2 else ())
            reports, errors, applied = session.run(version, shares, bucketwise=bucketwise)
            assert errors == [None] * 5
            for got, k in zip(applied, keeps):
                _assert_assembled(got, named, k)
            assert [r.version for r in session.receivers] == [version, version]
            # every sender sent its own rows and nothing else: the bytes of the pieces it held
            merged = merge_sender_reports(reports)
            assert merged.bytes_per_sender == tuple(sum(t.numel() * t.element_size() for _, t in share)
                                                    for share in shares)
            if sliced:  # each worker received its slices' rows only, and loaded them as slices
                assert set(session.receivers[1].sliced) == set(KEEPS[1])
                assert session.receivers[1].received_bytes < sum(t.numel() * t.element_size() for _, t in named)
    finally:
        session.close()


def test_a_sender_failing_part_way_fails_the_update_on_every_worker():
    session = Senders("broadcast_packed", num_senders=2, bucket_bytes=256, keeps=lambda i: KEEPS[i])
    try:
        named = _model(1)
        reports, errors, applied = session.run(1, row_pieces(named, 2), bucketwise=True)
        assert errors == [None] * 4

        def failing(share):
            yield share[0]
            raise RuntimeError("the trainer's stream broke")

        shares = row_pieces(_model(2), 2)
        _, errors, _ = session.run(2, [failing(shares[0]), shares[1]], bucketwise=True)
        assert all(e is not None for e in errors[2:]), errors
        assert [r.version for r in session.receivers] == [1, 1]
        named = _model(3)  # and the next whole update lands
        _, errors, applied = session.run(3, row_pieces(named, 2), bucketwise=True)
        assert errors == [None] * 4
        for got, k in zip(applied, KEEPS):
            _assert_assembled(got, named, k)
    finally:
        session.close()


def test_piece_names_carry_the_box_and_the_whole_shape_through_region_keys():
    name = piece_name("model.norm.weight", ((8, 17),), (17,))
    assert name == "model.norm.weight#piece[8:17]of[17]"
    assert parse_piece(name) == ("model.norm.weight", ((8, 17),), (17,))
    assert parse_region_key(name) == (name, None)
    part = ((0, 4), (2, 6))
    big = piece_name("w", ((4, 8), (0, 8)), (8, 8))
    assert parse_region_key(region_key(big, part)) == (big, part)
    assert split_piece_key("w[0:1]") == (None, "w[0:1]")
    assert kept_part(((4, 8), (0, 8)), ((0, 6), (2, 6))) == ((0, 2), (2, 6))
    assert kept_part(((4, 8), (0, 8)), ((0, 4), (0, 8))) == ((0, 0), (0, 0))


def test_an_update_short_of_a_piece_or_with_overlapping_pieces_is_refused_by_name():
    t = torch.arange(12.0).reshape(4, 3)
    shape = (4, 3)
    assembler = PieceAssembler(None, keep_buffers=False)
    assembler.begin(None)
    assert assembler.feed([(piece_name("w", ((0, 2), (0, 3)), shape), t[:2])]) == []
    with pytest.raises(TransferError, match=r"'w': 6 of the 12 elements of \[0:4, 0:3\] this worker keeps arrived "
                                            r"from no sender"):
        assembler.finish()
    assembler.begin(None)
    assembler.feed([(piece_name("w", ((0, 3), (0, 3)), shape), t[:3])])
    with pytest.raises(TransferError, match="'w': pieces of this update overlap"):
        assembler.feed([(piece_name("w", ((1, 4), (0, 3)), shape), t[1:])])
    keeping = PieceAssembler({"w": ((0, 2), (0, 3))}, keep_buffers=False)
    keeping.begin(None)
    with pytest.raises(TransferError, match=r"a piece \[2:4, 0:3\] of 'w' arrived where this worker keeps "
                                            r"\[0:2, 0:3\]"):
        keeping.feed([(piece_name("w", ((2, 4), (0, 3)), shape), t[2:])])


def test_disk_delta_workers_decode_only_their_part_of_each_piece_and_deltas_chain(tmp_path):
    """Three disk-delta senders, each publishing its rows in a folder of its own; workers keeping slices decode
    each piece's part of their slice only (the index holds a checksum of each part), versions 2 and 3 deltas."""
    session = Senders("disk-delta", num_senders=3, keeps=lambda i: KEEPS[i],
                      options=lambda i: {"disk_dir": str(tmp_path), "sender_index": i})
    try:
        g = torch.Generator().manual_seed(0)
        named = _model(1)
        for version in (1, 2, 3):
            named = [(n, t if i % 2 else t + torch.randn(t.shape, generator=g).to(t.dtype))
                     for i, (n, t) in enumerate(named)]
            _, errors, applied = session.run(version, row_pieces(named, 3))
            assert errors == [None] * 5
            for got, k in zip(applied, KEEPS):
                _assert_assembled(got, named, k)
            assert set(session.receivers[0].sliced) == set(KEEPS[0])
    finally:
        session.close()


def test_the_device_path_batches_a_buckets_copies_and_stays_bit_exact(monkeypatch):
    """A GPU's copies go in one ``_foreach_copy_`` at the end of each feed; run here on host tensors by turning the
    host path off (this machine has no GPU): whole tensors and column slices (strided destinations) bit-exact."""
    from rlplacement.transfer.slice_tensor import box_of, slice_of

    monkeypatch.setattr(pieces, "_host_copy", lambda dst, src: False)
    named = _model(5)
    for keeps in (None, KEEPS[1]):
        assembler = PieceAssembler(keeps, keep_buffers=False)
        assembler.begin(None)
        got = []
        for share in row_pieces(named, 3):  # one sender's bucket per feed
            arrived = []
            for key, t in share:
                name, box, _ = parse_piece(key)
                kept = keeps.get(name) if keeps else None
                if kept is None:
                    arrived.append((key, t))
                    continue
                from rlplacement.transfer.shards import cut
                from rlplacement.transfer.slice_tensor import as_whole

                part = kept_part(box, kept)
                arrived.append((key, as_whole(cut(t, part).contiguous(), part, tuple(t.shape), key)))
            got += [(n, t if box_of(t) is None else (*box_of(t), slice_of(t))) for n, t in assembler.feed(arrived)]
        assembler.finish()
        _assert_assembled(got, named, keeps)


@pytest.mark.parametrize("mode", MODES)
def test_a_sender_ahead_of_the_others_waits_so_a_worker_assembles_about_a_bucket_not_the_model(mode):
    """Bucket staging: sender 1 streams at once, sender 0 slowly. The worker holds sender 1's bucket until the
    tensors it brought pieces of are whole, so sender 1 waits, and the tensors assembling at once stay within
    the buckets held (without the hold sender 1 runs to its end and every tensor is started: the model)."""
    import time

    g = torch.Generator().manual_seed(0)
    named = [(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(32, 64, generator=g)) for i in range(24)]
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    piece_bytes = model_bytes // len(named) // 2
    bucket = 2 * piece_bytes  # each sender's bucket: its pieces of two tensors
    session = Senders(mode, num_senders=2, bucket_bytes=bucket)
    try:
        shares = row_pieces(named, 2)

        def slowly(share):
            for pair in share:
                time.sleep(0.02)
                yield pair

        _, errors, applied = session.run(1, [slowly(shares[0]), shares[1]], bucketwise=True)
        assert errors == [None] * 4
        for got in applied:
            _assert_assembled(got, named, None)
        peaks = [r.assembly_peak_bytes for r in session.receivers]
        # the tensors of the buckets held: each tensor twice a piece, so a bucket's pieces start two buckets of
        # tensors, which the other sender's bucket completes (16 KiB here), with room for one sender a bucket on
        assert max(peaks) <= 2 * 2 * bucket < model_bytes / 4, (peaks, bucket, model_bytes)
    finally:
        session.close()
