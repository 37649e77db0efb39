"""The chunk kernel that commits a copy plan in one launch (rlplacement.engines.copy_kernel).

The chunk table and the choice of copies are plain arithmetic and run here; the kernel itself needs
Triton and a GPU, and its tests are skipped without one (the H200 run replays real Qwen3 shapes).
"""

import numpy as np
import pytest
import torch

from rlplacement.engines import copy_kernel, copy_plan

def gpu(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(),
                                              reason="the chunk kernel is a Triton GPU kernel")(test))


def test_the_table_cuts_each_copy_into_chunks_that_cover_it_exactly():
    copies = [(1 << 20, 9 << 20, 48), (3 << 20, 5 << 20, 32), (7 << 20, 2 << 20, 16)]
    rows = copy_kernel.chunk_table(copies, chunk_bytes=32)
    assert rows.dtype == np.int64
    assert rows.tolist() == [[1 << 20, 9 << 20, 8], [(1 << 20) + 32, (9 << 20) + 32, 4],
                             [3 << 20, 5 << 20, 8], [7 << 20, 2 << 20, 4]]
    covered = {}
    for src, dst, words in rows.tolist():  # every byte of every copy once, at the same offset on both sides
        for b in range(words * copy_kernel.WORD):
            assert (src + b) not in covered
            covered[src + b] = dst + b
    assert covered == {s + b: d + b for s, d, n in copies for b in range(n)}


def test_a_chunk_size_the_vectors_cannot_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple of 16"):
        copy_kernel.chunk_table([(0, 64, 64)], chunk_bytes=24)


def test_only_plain_aligned_copies_of_one_dtype_are_eligible():
    base = torch.zeros(1024, dtype=torch.bfloat16)
    dst, src = base[:64], torch.ones(64, dtype=torch.bfloat16)
    assert copy_kernel.eligible(dst, src)
    assert not copy_kernel.eligible(base[1:65], src)  # 2 bytes off the 16-byte grid
    assert not copy_kernel.eligible(base[:63], src[:63])  # 126 bytes: not whole vectors
    assert not copy_kernel.eligible(dst, src.float()[:64].half())  # another dtype (a cast, not a byte copy)
    assert not copy_kernel.eligible(base[:128].view(64, 2).t(), torch.ones(2, 64, dtype=torch.bfloat16))
    assert not copy_kernel.eligible(base[:0], src[:0])


def test_overlapping_destinations_are_noticed():
    assert not copy_kernel.overlapping([(0, 16), (16, 32), (64, 80)])
    assert copy_kernel.overlapping([(64, 80), (0, 16), (15, 32)])
    assert not copy_kernel.overlapping([(5, 5), (0, 16)])  # an empty range shares nothing


def test_copies_off_the_gpu_are_not_fused_and_say_why():
    assert copy_kernel.fuse([torch.zeros(8)], [torch.ones(8)]) == "the copies are not on a GPU"


def _pairs(device: str):
    """Destinations as vLLM's fused parameters hold them (slices of one tensor), sources as the
    trainer's tensors: aligned ones, plus a strided one, an odd-sized one and a cast."""
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.zeros(3 * 1024 + 8, 256, dtype=torch.bfloat16, device=device)
    norm = torch.zeros(2560, dtype=torch.bfloat16, device=device)
    down = torch.zeros(512, 300, dtype=torch.bfloat16, device=device)
    odd = torch.zeros(7, dtype=torch.float32, device=device)
    cast = torch.zeros(64, dtype=torch.float32, device=device)
    dsts = [qkv[:1024], qkv[1024:2048], qkv[2048:3072], qkv[3072:], norm, down.t(), odd, cast]
    srcs = [torch.randn(d.shape, generator=g, device=device).to(d.dtype) for d in dsts[:5]]
    srcs.append(torch.randn(300, 512, generator=g, device=device).bfloat16())
    srcs.append(torch.randn(7, generator=g, device=device))
    srcs.append(torch.randn(64, generator=g, device=device).bfloat16())
    return dsts, srcs


@gpu
def test_the_kernel_copies_every_eligible_byte_and_leaves_the_rest_to_the_plan():
    dsts, srcs = _pairs("cuda")
    fused = copy_kernel.fuse(dsts, srcs)
    assert isinstance(fused, copy_kernel.FusedCopies), fused
    assert fused.fused == [0, 1, 2, 3, 4] and fused.rest == [5, 6, 7]
    before = [d.clone() for d in dsts]
    fused.launch()
    torch.cuda.synchronize()
    for i in fused.fused:
        assert torch.equal(dsts[i], srcs[i]), i
    for i in fused.rest:  # the kernel wrote nothing it was not given
        assert torch.equal(dsts[i], before[i]), i


@gpu
def test_overlapping_destinations_fall_back_to_copies_one_by_one():
    buf = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
    srcs = [torch.randn(2048, device="cuda").bfloat16() for _ in range(2)]
    fused = copy_kernel.FusedCopies([buf[:2048], buf[1024:3072]], srcs)
    assert fused.fused == [] and fused.rest == [0, 1] and fused.num_chunks == 0


@gpu
@pytest.mark.parametrize("variant", copy_kernel.VARIANTS + (copy_kernel.Variant("small", 4096, True, False),),
                         ids=lambda v: v.name)  # small: many chunks per copy, and ragged ends
def test_every_variant_copies_exactly_the_eligible_bytes(variant):
    dsts, srcs = _pairs("cuda")
    fused = copy_kernel.FusedCopies(dsts, srcs, variants=(variant,))
    before = [d.clone() for d in dsts]
    for _ in range(2):  # the first launch captures the graph, the second replays it
        fused.launch()
        torch.cuda.synchronize()
        assert all(torch.equal(dsts[i], srcs[i]) for i in fused.fused)
        assert all(torch.equal(dsts[i], before[i]) for i in fused.rest)
        for s in srcs:
            s.copy_(torch.randn(s.shape, device="cuda").to(s.dtype))
    assert fused.graph is not None and fused.summary().startswith(f"{variant.name} by graph replay")


@gpu
def test_a_plan_replayed_through_the_kernel_equals_copies_one_by_one():
    dsts, srcs = _pairs("cuda")
    copies = [copy_plan._Copy(f"t{i}", 0, tuple(s.shape), tuple(s.stride()), d, d.untyped_storage().data_ptr())
              for i, (d, s) in enumerate(zip(dsts, srcs))]
    plan = copy_plan.CopyPlan(copy_plan.layout_of([(f"t{i}", s) for i, s in enumerate(srcs)]), copies)
    staged = [(f"t{i}", s) for i, s in enumerate(srcs)]
    for step in range(3):  # new bytes each time, in the same staged tensors
        for s in srcs:
            s.copy_(torch.randn(s.shape, device="cuda").to(s.dtype))
        plan.replay(staged)
        torch.cuda.synchronize()
        assert plan.fused_failure is None and "5 of 8 copies in one launch" in plan.chunk_kernel_summary()
        assert plan.mismatches(staged) == [], step
    assert "by graph replay; first launch timed" in plan.chunk_kernel_summary()  # every variant, the fastest kept
    fused, graph = plan._fused, plan._fused.graph
    for s in srcs:  # the trainer's memory moved (a hand-off): the same table and graph, retargeted in place
        s.data = s.clone()
    plan.forget_staged()
    staged = [(f"t{i}", s) for i, s in enumerate(srcs)]
    plan.replay(staged)
    torch.cuda.synchronize()
    assert plan._fused is fused and fused.graph is graph and plan.mismatches(staged) == []
    chosen = fused.variant
    moved = [(f"t{i}", torch.empty(s.numel() * s.element_size() + 8, dtype=torch.uint8, device="cuda")[8:]
              .view(s.dtype).view(s.shape)) for i, s in enumerate(srcs)]  # 8 bytes off the vectors' alignment
    for (_, m), s in zip(moved, srcs):
        m.copy_(torch.randn(s.shape, device="cuda").to(s.dtype))
    plan.replay(moved)  # a source the kernel cannot read: a new table (the same variant, untimed) or copies
    torch.cuda.synchronize()
    assert plan._fused is not fused and plan.mismatches(moved) == []
    assert plan._fused is None or (plan._fused.variant == chosen and plan._fused.timings_ms == {})
