"""tensor_checksum: one digest of the raw bytes whatever the device, dtype or strides (the trainer and
the engines compare these strings across processes and devices)."""

import pytest
import torch
import xxhash

from rlplacement.transfer import base
from rlplacement.transfer.base import tensor_checksum


def test_checksum_is_xxh3_of_the_c_order_bytes_for_any_dtype_and_strides():
    t = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    want = xxhash.xxh3_64_hexdigest(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert tensor_checksum(t) == want
    assert tensor_checksum(t.t().contiguous().t()) == want  # same values, other strides
    other = t.clone()
    other.view(torch.int16)[2, 3] ^= 1  # one bit
    assert tensor_checksum(other) != want
    assert tensor_checksum(torch.empty(0)) == xxhash.xxh3_64_hexdigest(b"")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the streamed path copies device -> pinned host)")
def test_gpu_checksum_streams_in_chunks_and_equals_the_host_digest(monkeypatch):
    monkeypatch.setattr(base, "CHECKSUM_CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(base, "_pinned_chunks", [])
    for nbytes in (0, 1000, 1 << 20, 5 * (1 << 20) + 3):  # empty, one partial chunk, one exact, several + tail
        host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        assert tensor_checksum(host.cuda()) == tensor_checksum(host), nbytes
    t = torch.randn(3000, 700, dtype=torch.bfloat16, device="cuda")
    flipped = t.clone()
    flipped.view(torch.int16)[2999, 699] ^= 1  # last byte pair of the last chunk
    assert tensor_checksum(t) == tensor_checksum(t.cpu())
    assert tensor_checksum(flipped) != tensor_checksum(t)
