"""aligned_buffer: alignment, ownership (the tensor keeps its mapping alive), and open_direct."""

import gc
import os

import pytest
import torch

from tutti.io.buffers import aligned_buffer, is_aligned, open_direct


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * 4096, 1_000_003])
def test_aligned_buffer_shape_alignment_and_zeroes(nbytes):
    t = aligned_buffer(nbytes)
    assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
    assert t.numel() == nbytes
    assert t.data_ptr() % 4096 == 0 and is_aligned(t)
    assert int(t.sum()) == 0
    t[-1] = 7  # writable to the last byte
    assert int(t[-1]) == 7


def test_plain_torch_empty_is_not_what_we_rely_on():
    # The point of aligned_buffer: a sub-view at a 4 KiB offset stays aligned, an odd one does not.
    t = aligned_buffer(3 * 4096)
    assert is_aligned(t[4096:])
    assert not is_aligned(t[100:])
    assert is_aligned(8192) and not is_aligned(8193)
    assert is_aligned(512, align=512)


@pytest.mark.parametrize("bad", [0, -4096, 1.5, "4096", True])
def test_aligned_buffer_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="nbytes"):
        aligned_buffer(bad)


def test_view_keeps_memory_alive_after_base_is_dropped():
    t = aligned_buffer(1 << 20)
    t.copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    tail = t[4096:8192]
    expected = tail.clone()
    del t
    gc.collect()
    aligned_buffer(1 << 20).fill_(0xAB)  # new mappings must not land on (or clobber) our pages
    assert torch.equal(tail, expected)


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_mapping_lives_exactly_as_long_as_the_tensor():
    t = aligned_buffer(64 << 20)  # large enough to get a mapping of its own
    addr = t.data_ptr()
    view = t[1 << 20 :]
    del t
    gc.collect()
    assert _mapped(addr)  # a view still uses it
    view[0] = 3
    del view
    gc.collect()
    assert not _mapped(addr)  # unmapped with the last view: no leak


def test_huge_page_hint_is_optional():
    for huge in (True, False):
        t = aligned_buffer(4 << 20, huge=huge)
        assert is_aligned(t) and t.numel() == 4 << 20
        t.fill_(9)
        assert int(t[-1]) == 9


def test_pin_is_a_noop_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is exercised for real elsewhere")
    t = aligned_buffer(4096, pin=True)
    assert is_aligned(t)


def test_open_direct_uses_o_direct_on_a_real_file(tmp_path):
    fd, direct = open_direct(tmp_path / "f", write=True, create=True)
    try:
        assert direct is True
        assert os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
    finally:
        os.close(fd)


def test_open_direct_falls_back_where_o_direct_is_refused():
    # procfs files refuse O_DIRECT with EINVAL: the documented buffered fallback must kick in.
    fd, direct = open_direct("/proc/self/status")
    try:
        assert direct is False
        assert b"Name:" in os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


def test_open_direct_passes_other_errors_through(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_direct(tmp_path / "missing")
