"""Engine workers that receive only their slice of each tensor (``transfer.shards``), over the real wire: p2p
(Mooncake over loopback TCP), broadcast and broadcast_packed (gloo, a group per worker position) and disk-delta
into receiver threads, each keeping another slice; and the pure parts (the worker's keeps from vLLM's rules,
the view the loader is handed, the check of what a loader read)."""

import pytest
import torch

from rlplacement.transfer import shards
from rlplacement.transfer.base import TransferError, tensor_checksum
from tests.test_transfer_broadcast import Session, _bytes, _model, _scaled

# worker 0 and worker 1 of a 2-wide engine, on _model's tensors: q by rows (heads), up_proj (a transposed
# tensor, so its slice is not contiguous in the trainer's memory) by columns as a row-parallel layer is;
# k, v and the norms whole
KEEPS = [{f"model.layers.{i}.self_attn.q_proj.weight": ((w * 16, w * 16 + 16), (0, 16)) for i in range(3)}
         | {f"model.layers.{i}.mlp.up_proj.weight": ((0, 40), (w * 8, w * 8 + 8)) for i in range(3)}
         for w in range(2)]


def _box(t, box):
    return shards.cut(t, box)


@pytest.mark.parametrize("mode,bucket_bytes", [("p2p", 4096), ("p2p", 1 << 20), ("broadcast", 4096),
                                              ("broadcast_packed", 4096), ("broadcast_packed", 1 << 20),
                                              ("disk-delta", 4096)])
def test_each_worker_receives_only_its_slices_bit_exact_over_versions(mode, bucket_bytes):
    """p2p writes each worker its slices (bucket by bucket, then replayed); the broadcast modes broadcast each
    position's slices in its own group; disk-delta's workers decode and hold only theirs, the first version a
    keyframe, the next ones xor deltas."""
    s = Session(mode, bucket_bytes=bucket_bytes, check_equal=True, keeps=KEEPS)
    try:
        named = _model(1)
        whole_bytes = sum(t.numel() * t.element_size() for _, t in named)
        for version in (1, 2, 3):
            report, send_error, errors = s.run(version, named)
            assert send_error is None and errors == [None, None]
            if mode == "p2p":
                assert report.path == ("buckets" if version == 1 else "replay")
            elif mode == "disk-delta":
                assert report.base_version == (None if version == 1 else version - 1)
            for w, (receiver, applied) in enumerate(zip(s.receivers, s.applied)):
                got = dict(applied)
                assert set(got) == {n for n, _ in named}
                for name, src in named:
                    box = KEEPS[w].get(name)
                    assert got[name].shape == src.shape
                    assert torch.equal(_bytes(_box(got[name], box)), _bytes(_box(src, box))), name
                kept = sum(_box(t, KEEPS[w].get(n)).numel() * t.element_size() for n, t in named)
                if mode != "disk-delta":
                    assert receiver.received_bytes == kept < whole_bytes
                else:  # the host copy kept for the next delta is the worker's share
                    assert receiver.staging_bytes == kept < whole_bytes
                assert set(receiver.sliced) == set(KEEPS[w])
                # what each worker checks is its own slices, under the keys the trainer reported
                assert receiver.verified_checksums == {
                    shards.region_key(n, KEEPS[w].get(n)): tensor_checksum(_box(t, KEEPS[w].get(n))) for n, t in named}
                assert set(receiver.verified_checksums) <= set(report.checksums)
            named = _scaled(named, 1.5)
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["broadcast", "broadcast_packed"])
def test_two_engines_of_two_workers_take_their_slices_in_a_group_per_position(mode):
    """Workers 0 and 2, and 1 and 3 (the same position of two 2-wide engines) keep the same slices: the sender
    builds a group for each position and broadcasts each region once, in it; every worker gets its slices
    bit-exact, and a worker's bytes are its share."""
    keeps = KEEPS + KEEPS
    s = Session(mode, n_receivers=4, check_equal=True, keeps=keeps)
    try:
        assert [ranks for _, ranks in s.sender._positions] == [[1, 3], [2, 4]]
        assert [g.world_size for g in s.sender._position_groups] == [3, 3]
        named = _model(1)
        for version in (1, 2):
            report, send_error, errors = s.run(version, named)
            assert send_error is None and errors == [None] * 4
            for w, receiver in enumerate(s.receivers):
                got = dict(s.applied[w])
                for name, src in named:
                    assert torch.equal(_bytes(_box(got[name], keeps[w].get(name))), _bytes(_box(src, keeps[w].get(name))))
                assert receiver.received_bytes == sum(
                    _box(t, keeps[w].get(n)).numel() * t.element_size() for n, t in named)
            named = _scaled(named, 1.5)
    finally:
        s.close()


def test_workers_that_all_keep_whole_tensors_share_the_one_group():
    """No worker keeps slices (TP=1 engines, GPU workers): no group per position, each bucket one broadcast in
    the group of all, as before slices."""
    s = Session("broadcast_packed", n_receivers=2, check_equal=True)
    try:
        assert s.sender._position_groups == [] and not s.sender._sliced
        report, send_error, errors = s.run(1, _model(1))
        assert send_error is None and errors == [None, None]
        assert s.sender.collectives == s.receivers[0]._group.collectives
    finally:
        s.close()


@pytest.mark.parametrize("mode", ["p2p", "broadcast_packed"])
def test_a_corrupted_slice_is_refused_by_its_checksum_and_the_version_kept(monkeypatch, mode):
    s = Session(mode, check_equal=True, keeps=KEEPS)
    try:
        named = _model(1)
        report, send_error, errors = s.run(1, named)
        assert send_error is None and errors == [None, None]
        receiver = s.receivers[1]
        unpack = type(receiver)._unpack

        def corrupt(self, buf, manifest):
            if self is receiver:
                buf.view(torch.uint8)[0] ^= 0xFF
            return unpack(self, buf, manifest)

        monkeypatch.setattr(type(receiver), "_unpack", corrupt)
        report, send_error, errors = s.run(2, _scaled(named, 2.0))
        assert errors[0] is None and "checksum" in str(errors[1])
        assert [r.version for r in s.receivers] == [2, 1]
    finally:
        s.close()


def test_a_worker_keeps_vllms_slices_of_the_tensors_tp_cuts():
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 1, "vocab_size": 100, "tie_word_embeddings": False, "rms_norm_eps": 1e-6}
    keeps = [shards.keeps_for_worker(config, w, 4) for w in range(4)]
    p = "model.layers.0."
    assert keeps[1][p + "self_attn.q_proj.weight"] == ((32, 64), (0, 64))
    assert keeps[3][p + "self_attn.o_proj.weight"] == ((0, 64), (96, 128))
    assert keeps[2][p + "mlp.gate_proj.weight"] == ((64, 96), (0, 64))
    # 2 KV heads over 4 workers: each worker keeps one head, replicated on two workers
    assert keeps[0][p + "self_attn.k_proj.weight"] == keeps[1][p + "self_attn.k_proj.weight"] == ((0, 32), (0, 64))
    # the vocabulary padded to 128 and split by 32 rows: worker 3's rows 96..127 are past 100 but 96..99
    assert keeps[3]["model.embed_tokens.weight"] == ((96, 100), (0, 64))
    assert all(p + "input_layernorm.weight" not in k for k in keeps)  # norms go whole
    assert shards.keeps_for_worker(config, 0, 1) == {}


@pytest.mark.parametrize("box", [((2, 5), (0, 6)), ((0, 7), (1, 4)), ((0, 7), (0, 6), (3, 5))])
def test_the_loader_gets_the_whole_shape_holding_only_the_slice_and_must_read_exactly_its_box(box):
    """A slice stands in for its whole tensor without the rows outside it (meta storage); a copy of exactly the
    box (contiguous or not) takes the slice's bytes; any other read is refused naming the tensor and the flag."""
    from rlplacement.transfer.slice_tensor import SliceReadError, as_whole, slice_of

    shape = (7, 6) if len(box) == 2 else (7, 6, 5)
    whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    piece = shards.cut(whole, box).contiguous()
    view = as_whole(piece, box, shape, "t")
    assert view.shape == whole.shape and view.device == piece.device and slice_of(view) is piece
    assert view.untyped_storage is not None and view.to(torch.float32) is view and view.data.shape == whole.shape
    for taken in (shards.cut(view, box), shards.cut(view, box).contiguous(), shards.cut(view.detach(), box)):
        into = torch.zeros(shards.box_shape(box))
        into.copy_(taken)
        assert torch.equal(into, shards.cut(whole, box))
    wider = tuple((0, n) if (a, b) != (0, n) else (a, b) for (a, b), n in zip(box, shape))  # the neighbour's rows too
    for misread in (lambda: torch.zeros(whole.shape).copy_(view), lambda: torch.zeros(shards.box_shape(wider)).copy_(
            shards.cut(view, wider))):
        with pytest.raises(SliceReadError, match=r"the loader read 't' other than as its slice .*"
                                                 r"--update-weight-slices off"):
            misread()
    for computed in (lambda: view * 2, lambda: view[[0, 1]], lambda: view.to(torch.bfloat16), lambda: view.item()):
        with pytest.raises(SliceReadError, match=r"the loader applied .* to 't', of which this worker was sent "
                                                 r"only the slice"):
            computed()


def test_a_mode_that_hands_over_whole_buckets_refuses_slices():
    from rlplacement.transfer import registry

    with pytest.raises(TransferError, match="mode 'cuda_ipc' sends every worker whole tensors"):
        registry.receiver_class("cuda_ipc")("cpu").keep_slices(KEEPS[0])


@pytest.mark.parametrize("encoding", ["xor", "overwrite", "full"])
@pytest.mark.parametrize("box", [((2, 4), (0, 10)), ((0, 6), (3, 7)), ((5, 6), (0, 10))])
@pytest.mark.parametrize("stream_bytes", [1 << 20, 40, 1])  # the whole tensor, two rows, one row at a time
def test_a_slice_decodes_from_the_whole_payload_and_its_own_base(encoding, box, stream_bytes, monkeypatch):
    """xor and full payloads are read as a stream of row chunks, never decompressed whole (the whole-payload
    decompression is made to fail); overwrite's payload (the changed bytes) is."""
    import numpy as np

    from rlplacement.transfer import delta_codec as codec

    monkeypatch.setattr(codec, "SLICE_STREAM_BYTES", stream_bytes)
    if encoding != "overwrite":
        monkeypatch.setattr(codec, "_decompress", lambda *a: pytest.fail("a slice decompressed its tensor whole"))
    rng = np.random.default_rng(0)
    shape, itemsize = (6, 10), 2
    old = rng.integers(0, 256, size=6 * 10 * 2, dtype=np.uint8)
    new = old.copy()
    new[rng.integers(0, old.size, size=17)] ^= 0x5A
    enc = codec.encode(new, None if encoding == "full" else old, "xor" if encoding == "full" else encoding)
    assert enc.encoding == encoding
    base = None if encoding == "full" else codec.cut_bytes(old, shape, itemsize, box)
    got = codec.decode_slice(enc.encoding, enc.payload, base, new.size, enc.extra, shape, itemsize, box)
    assert np.array_equal(got, codec.cut_bytes(new, shape, itemsize, box))
    if encoding != "overwrite":  # a payload cut short is refused, not read as zeros
        from rlplacement.errors import DeltaDecodeError

        with pytest.raises(DeltaDecodeError, match="zstd|the payload ends"):
            codec.decode_slice(enc.encoding, enc.payload[:len(enc.payload) // 3], None if encoding == "full" else old,
                               new.size, enc.extra, shape, itemsize, ((0, 6), (0, 10)))


def test_a_disk_delta_worker_whose_slices_the_index_lacks_refuses_by_name():
    from rlplacement.transfer.disk_delta import folder_format

    s = Session("disk-delta", check_equal=True, keeps=KEEPS)
    try:
        (s.sender.root / folder_format.keeps_file(2)).unlink()  # the sender never learns worker 2's slices
        report, send_error, errors = s.run(1, _model(1))
        assert send_error is None and errors[0] is None
        assert "the index has no checksum of this worker's slice model.layers.0" in str(errors[1])
    finally:
        s.close()


def test_a_disk_delta_worker_that_cannot_write_the_folder_takes_whole_tensors_stand_in_for_a_read_only_mount(
        monkeypatch):
    """Root writes anywhere here, so the read-only mount is a publish that raises ``PermissionError``."""
    from rlplacement.transfer.disk_delta import folder_format

    publish = folder_format.publish_file

    def read_only_for_engines(root, name, data):  # the trainer's own files still go in
        if name.startswith("keeps."):
            raise PermissionError(f"[Errno 30] Read-only file system: '{root / name}'")
        publish(root, name, data)

    monkeypatch.setattr(folder_format, "publish_file", read_only_for_engines)
    s = Session("disk-delta", check_equal=True, keeps=KEEPS)
    try:
        named = _model(1)
        report, send_error, errors = s.run(1, named)
        assert send_error is None and errors == [None, None]
        assert [r.keeps for r in s.receivers] == [None, None] and not s.receivers[0].sliced
        got = dict(s.applied[0])
        assert all(torch.equal(_bytes(src), _bytes(got[name])) for name, src in named)
    finally:
        s.close()
