"""Triton gather/scatter vs the torch reference and the format's independent definition."""

import pytest
import torch

import tutti.kernels as K
from tutti.kernels import conformance as C
from tutti.kernels import triton_kernels


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", list(C.DTYPES))
@pytest.mark.parametrize("kind", C.KINDS)
def test_triton_matches_reference(kind, dtype, block_size):
    # gather byte-exact (padding poisoned first), scatter into other blocks leaves the rest untouched
    C.run_case("triton", kind, dtype, block_size)


@pytest.mark.parametrize("kind", C.KINDS)
def test_manager_block_spans_kernel_blocks(kind):
    C.run_case("triton", kind, "bf16", 16, k=2, ids_dtype=torch.int32, extra_bytes=4096)
    C.run_case("triton", kind, "fp16", 16, k=4, blocks_per_chunk=1, num_chunks=3)


@pytest.mark.parametrize("src,dst", C.CROSS_PAIRS)
@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_cross_layout_round_trip(src, dst, dtype):
    C.run_cross_case("triton", src, dst, dtype)


def test_torch_variant_full_suite():
    report = K.check_variant("torch")
    assert report.num_cases > 100 and report.variant == "torch"


def test_triton_quick_suite():
    report = K.check_variant("triton", quick=True)
    assert report.num_cases >= 30


@pytest.mark.parametrize("max_programs,group,split", [(1, None, None), (3, None, None), (3, 1, None), (None, 1, None),
                                                      (2, 4, None), (None, 1, 3), (4, 2, 2), (None, None, 64)])
def test_grid_cap_covers_all_work(max_programs, group, split):
    """Persistent loop over work items (grid cap), both item-grouping paths of the kernel, and
    tiles of a group split over programs (what compiled launches do by default)."""
    case = C.make_case("kv_outer", torch.float16, 16, num_blocks=10)
    ids = torch.tensor([[1, 9, 4], [0, 2, 7]])
    S = case.layout.segment_bytes(48)
    want = C.expected_segments(case, ids, 1, S)
    out = torch.full((2, 2, S), 7, dtype=torch.uint8)
    triton_kernels.gather(case.caches, case.layout, ids, out, max_programs=max_programs, block=128, group=group,
                          split=split)
    assert torch.equal(out, want)
    dst = C.make_case("kv_outer", torch.float16, 16, num_blocks=10, seed=5)
    before = C.storage_bytes(dst)[0].clone()
    triton_kernels.scatter(dst.caches, dst.layout, ids, out, max_programs=max_programs, group=group, block=128,
                           split=split)
    back = torch.empty_like(out)
    K.gather(dst.caches, dst.layout, ids, back, variant="torch")
    assert torch.equal(back, want)
    after = C.storage_bytes(dst)[0]
    assert not torch.equal(before, after)


def test_segment_views_with_strides_and_single_layer():
    """out may be a slot view of a staging ring (strided first dims) or (N, S) for one layer."""
    case = C.make_case("hnd", torch.bfloat16, 16, num_blocks=6, num_layers=1)
    ids = torch.tensor([[3], [5], [0]])
    S = case.layout.segment_bytes(16)
    ring = torch.full((3, 8, S + 4096), 0xCD, dtype=torch.uint8)
    out = ring[1, 2:8:2, 4096:]  # (3, S) with a row stride of 2 slots
    K.gather(case.caches, case.layout, ids, out, variant="triton")
    want = C.expected_segments(case, ids, 1, S)[0]
    assert torch.equal(out, want)
    assert (ring[1, 3] == 0xCD).all() and (ring[0] == 0xCD).all()  # neighbours untouched


def test_auto_dispatch_on_cpu_is_torch():
    case = C.make_case("mla3", torch.bfloat16, 16, num_blocks=4)
    ids = torch.tensor([[2, 1]])
    S = case.layout.segment_bytes(32)
    a = torch.empty((2, 1, S), dtype=torch.uint8)
    b = torch.empty((2, 1, S), dtype=torch.uint8)
    K.gather(case.caches, case.layout, ids, a)
    K.gather(case.caches, case.layout, ids, b, variant="triton")
    assert torch.equal(a, b) and torch.equal(a, C.expected_segments(case, ids, 1, S))


def test_empty_wave_is_a_no_op():
    case = C.make_case("hnd", torch.float16, 16, num_blocks=4)
    out = torch.empty((2, 0, case.layout.segment_bytes(16)), dtype=torch.uint8)
    K.gather(case.caches, case.layout, torch.empty((0, 1), dtype=torch.int64), out, variant="triton")


@pytest.mark.parametrize("kind", ["kv_outer", "shared_int8_odd", "mla4"])
def test_one_item_per_program_path(kind, monkeypatch):
    """Large kernel blocks take the scalar one-item path; force it on small test blocks."""
    monkeypatch.setattr(triton_kernels, "_GROUP_WORDS", 1)
    C.run_case("triton", kind, "bf16", 16, k=2)
