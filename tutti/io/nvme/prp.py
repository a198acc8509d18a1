"""PRP (Physical Region Page) data pointers, following the NVMe base spec's rules.

- PRP1 is the address of the first byte: any dword-aligned offset into its page.
- If the transfer ends inside PRP1's page, PRP2 is unused (0).
- If it ends inside the next page, PRP2 is that page's address (offset 0).
- Otherwise PRP2 points to a PRP list: one page-aligned entry per remaining page, in order.
  This binding keeps each command to one list page (page_size / 8 entries, no chaining),
  which is what `max_prp_bytes` reports as the largest transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def pages_touched(first_offset: int, length: int, page_size: int) -> int:
    """How many memory pages a transfer of `length` bytes starting `first_offset` into a page spans."""
    return (first_offset + length + page_size - 1) // page_size


def max_prp_bytes(page_size: int) -> int:
    """Largest transfer that fits PRP1 + one PRP list page whatever the first page offset."""
    return (page_size // 8) * page_size


@dataclass(frozen=True)
class PrpPlan:
    prp1: int
    prp2: int
    list_entries: list[int] = field(default_factory=list)  # to be written at the list page


def build_prps(
    page_iovas: Sequence[int], first_offset: int, length: int, page_size: int, list_iova: int | None = None
) -> PrpPlan:
    """PRP1/PRP2 (and the PRP list when needed) for one transfer.

    `page_iovas[i]` is the bus address of the i-th memory page the transfer touches (page
    aligned); `first_offset` is where the data starts in the first of them.
    """
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size}: must be a power of two")
    if length <= 0:
        raise ValueError(f"length={length}: expected a positive byte count")
    if not 0 <= first_offset < page_size or first_offset & 0x3:
        raise ValueError(f"first_offset={first_offset}: must be dword aligned and inside one {page_size} B page")
    n = pages_touched(first_offset, length, page_size)
    if len(page_iovas) != n:
        raise ValueError(f"page_iovas: {len(page_iovas)} addresses given, the transfer touches {n} pages")
    for i, a in enumerate(page_iovas):
        if a % page_size:
            raise ValueError(f"page_iovas[{i}]=0x{a:x}: not aligned to the {page_size} B controller page")
    prp1 = page_iovas[0] + first_offset
    if n == 1:
        return PrpPlan(prp1, 0)
    if n == 2:
        return PrpPlan(prp1, page_iovas[1])
    entries = list(page_iovas[1:])
    if len(entries) > page_size // 8:
        raise ValueError(
            f"length={length}: needs {len(entries)} PRP list entries, one list page holds {page_size // 8}; "
            f"split transfers at {max_prp_bytes(page_size)} B"
        )
    if list_iova is None or list_iova % page_size:
        raise ValueError(f"list_iova={list_iova!r}: a page-aligned PRP list page is needed for {n} pages")
    return PrpPlan(prp1, list_iova, entries)
