"""Bucketing: sizes, groups, alignment, mixed dtypes, odd tensors, buffer reuse (pure torch)."""

import pytest
import torch

from rlplacement.transfer.bucket import (ALIGN, FlatBuffers, aligned, fused_group_of, iter_buckets, pack_into,
                                         plan_manifest, unpack)


def _roundtrip(named, bucket_bytes):
    buffers = FlatBuffers()
    out = []
    buckets = list(iter_buckets(named, bucket_bytes))
    for i, bucket in enumerate(buckets):
        manifest = plan_manifest(i, bucket)
        flat = pack_into(buffers.get(0, manifest.nbytes), bucket, manifest).clone()
        out.extend((n, t.clone()) for n, t in unpack(flat, manifest))
    return buckets, out


def _assert_bit_equal(src, got):
    assert [n for n, _ in src] == [n for n, _ in got]
    for (name, a), (_, b) in zip(src, got):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name


def test_mixed_dtypes_share_a_bucket_and_come_back_bit_exact():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(7, 3, generator=g).to(torch.bfloat16)),
             ("b", torch.randn(5, generator=g).to(torch.float16)),
             ("c", torch.randn(2, 2, generator=g)),
             ("d", torch.randint(0, 100, (9,), generator=g)),
             ("e", torch.tensor([True, False, True])),
             ("f", torch.randn(3, generator=g).to(torch.float8_e4m3fn))]
    buckets, out = _roundtrip(named, 1 << 20)
    assert len(buckets) == 1
    _assert_bit_equal(named, out)
    offsets = [m.offset for m in plan_manifest(0, named).tensors]
    assert all(o % ALIGN == 0 for o in offsets)


def test_tensor_bigger_than_the_bucket_goes_alone():
    named = [("small1", torch.ones(4)), ("big", torch.arange(1000, dtype=torch.float32)), ("small2", torch.zeros(4))]
    buckets, out = _roundtrip(named, 256)
    assert [[n for n, _ in b] for b in buckets] == [["small1"], ["big"], ["small2"]]
    _assert_bit_equal(named, out)


def test_one_byte_over_the_bucket_starts_a_new_bucket():
    # two tensors of exactly ALIGN bytes fill a 2*ALIGN bucket; a third of one byte does not fit
    t = torch.zeros(ALIGN, dtype=torch.uint8)
    named = [("x", t), ("y", t + 1), ("z", torch.tensor([7], dtype=torch.uint8))]
    assert [len(b) for b in iter_buckets(named, 2 * ALIGN)] == [2, 1]
    assert [len(b) for b in iter_buckets(named, 2 * ALIGN + 1)] == [3]
    _assert_bit_equal(named, _roundtrip(named, 2 * ALIGN)[1])


def test_zero_dim_empty_and_non_contiguous_sources():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    named = [("scalar", torch.tensor(3.5, dtype=torch.float64)), ("empty", torch.empty(0, 5)),
             ("transposed", base.t()), ("strided", base[:, ::2]), ("expanded", torch.ones(1, 3).expand(4, 3))]
    assert not named[2][1].is_contiguous() and not named[3][1].is_contiguous()
    buckets, out = _roundtrip(named, 64)
    _assert_bit_equal(named, out)
    assert out[0][1].shape == () and out[0][1].item() == 3.5
    assert torch.equal(out[2][1], base.t())


def test_fused_pieces_stay_in_one_bucket():
    layer = "model.layers.0."
    named = [(layer + "input_layernorm.weight", torch.ones(16)),
             (layer + "self_attn.q_proj.weight", torch.ones(16, 16)),
             (layer + "self_attn.k_proj.weight", torch.ones(8, 16)),
             (layer + "self_attn.v_proj.weight", torch.ones(8, 16)),
             (layer + "mlp.gate_proj.weight", torch.ones(32, 16)),
             (layer + "mlp.up_proj.weight", torch.ones(32, 16))]
    assert fused_group_of(layer + "self_attn.k_proj.weight") == layer + "self_attn.qkv_proj.weight"
    # the bucket fits q+k+v (2048 B) but not the norm on top, nor q+k+v+gate
    buckets = [[n.split(".")[-2] for n, _ in b] for b in iter_buckets(named, 2048)]
    assert buckets == [["input_layernorm"], ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]]


def test_buffers_are_reused_across_updates():
    named = [(f"t{i}", torch.full((100,), float(i))) for i in range(10)]
    buffers = FlatBuffers()
    for _ in range(3):
        for i, bucket in enumerate(iter_buckets(named, 1024)):
            manifest = plan_manifest(i, bucket)
            pack_into(buffers.get(i, manifest.nbytes), bucket, manifest)
    assert buffers.allocations == len(list(iter_buckets(named, 1024)))


def test_bad_buffer_size_names_the_flag():
    with pytest.raises(ValueError, match="--update-weight-buffer-size"):
        list(iter_buckets([("a", torch.ones(1))], 0))


def test_aligned():
    assert [aligned(n) for n in (0, 1, ALIGN, ALIGN + 1)] == [0, ALIGN, ALIGN, 2 * ALIGN]
