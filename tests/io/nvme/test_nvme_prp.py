"""PRP1/PRP2/PRP-list construction across page boundaries."""

import pytest

from tutti.io.nvme.prp import build_prps, max_prp_bytes, pages_touched

PS = 4096
PAGES = [0x10_0000 + i * 0x3000 for i in range(600)]  # deliberately not contiguous


def test_one_page_uses_prp1_only():
    p = build_prps(PAGES[:1], 0, PS, PS)
    assert (p.prp1, p.prp2, p.list_entries) == (PAGES[0], 0, [])
    p = build_prps(PAGES[:1], 512, 1024, PS)  # inside one page, with an offset
    assert (p.prp1, p.prp2) == (PAGES[0] + 512, 0)


def test_two_pages_use_prp2_as_second_page():
    p = build_prps(PAGES[:2], 0, 2 * PS, PS)
    assert (p.prp1, p.prp2, p.list_entries) == (PAGES[0], PAGES[1], [])


def test_unaligned_first_page_spills_into_a_second_page():
    assert pages_touched(512, PS, PS) == 2
    p = build_prps(PAGES[:2], 512, PS, PS)
    assert (p.prp1, p.prp2) == (PAGES[0] + 512, PAGES[1])


def test_many_pages_use_a_prp_list():
    lst = 0x90_0000
    p = build_prps(PAGES[:5], 0, 5 * PS, PS, list_iova=lst)
    assert (p.prp1, p.prp2) == (PAGES[0], lst)
    assert p.list_entries == PAGES[1:5]  # page aligned, offset 0, in order


def test_unaligned_first_page_with_a_list():
    # 3 pages of data starting 1 KiB into a page touch 4 pages
    p = build_prps(PAGES[:4], 1024, 3 * PS, PS, list_iova=0x90_0000)
    assert p.prp1 == PAGES[0] + 1024
    assert p.list_entries == PAGES[1:4]


def test_largest_transfer_fits_one_list_page_at_any_offset():
    n = max_prp_bytes(PS)
    assert n == 512 * PS
    for off in (0, 4, PS - 4):
        k = pages_touched(off, n, PS)
        p = build_prps(PAGES[:k], off, n, PS, list_iova=0x90_0000)
        assert len(p.list_entries) == k - 1 <= PS // 8


def test_too_many_pages_for_one_list_page_is_refused():
    with pytest.raises(ValueError, match="one list page holds 512"):
        build_prps(PAGES[:514], 0, 514 * PS, PS, list_iova=0x90_0000)


@pytest.mark.parametrize("args,match", [
    ((PAGES[:2], 0, PS, PS), "touches 1 pages"),
    (([PAGES[0] + 8], 0, PS, PS), "not aligned"),
    ((PAGES[:1], 2, 16, PS), "dword"),
    ((PAGES[:3], 0, 3 * PS, PS), "list page"),
    ((PAGES[:1], 0, 0, PS), "positive"),
    ((PAGES[:1], 0, 16, 3000), "power of two"),
])
def test_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        build_prps(*args)
