"""Segment checksum: torch and Triton agree exactly and match the written definition."""

import numpy as np
import pytest
import torch

from tutti.kernels import segment_checksum, segment_checksum_torch, segment_checksum_triton
from tutti.kernels import segment_checksum_definition as _by_definition  # docs/format.md, in plain integers


@pytest.mark.parametrize("shape", [(4096,), (3, 8192 + 12), (2, 2, 4096 * 5)])
def test_torch_triton_and_definition_agree(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    a = segment_checksum_torch(x)
    assert a.shape == shape[:-1] and a.dtype == torch.int64
    assert torch.equal(a, segment_checksum_triton(x))
    assert torch.equal(a, segment_checksum_triton(x, splits=3, block=256))
    assert torch.equal(a, segment_checksum(x))
    flat = x.reshape(-1, shape[-1])
    assert int(a.reshape(-1)[-1]) == _by_definition(flat[-1].numpy().tobytes())


def test_high_words_and_strided_rows():
    x = torch.full((2, 4096), 0xFF, dtype=torch.uint8)  # all words 0xFFFFFFFF: both sums wrap
    assert torch.equal(segment_checksum_torch(x), segment_checksum_triton(x))
    assert int(segment_checksum_torch(x)[0]) == _by_definition(x[0].numpy().tobytes())
    ring = torch.randint(0, 256, (4, 8192), dtype=torch.uint8)
    view = ring[::2, 4:4100]  # strided rows
    assert torch.equal(segment_checksum_torch(view), segment_checksum_triton(view))


def test_flipped_byte_and_swapped_words_change_it():
    x = torch.randint(0, 256, (1, 8192), dtype=torch.uint8)
    base = segment_checksum_torch(x)
    for pos in (0, 1, 4095, 8191):
        y = x.clone()
        y[0, pos] ^= 0x10
        assert segment_checksum_torch(y) != base and segment_checksum_triton(y) != base
    y = x.clone()
    y[0, 0:4], y[0, 4:8] = x[0, 4:8].clone(), x[0, 0:4].clone()
    if not torch.equal(x[0, 0:4], x[0, 4:8]):
        assert segment_checksum_torch(y) != base  # order matters: the weighted sum sees it


def test_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 4"):
        segment_checksum(torch.zeros(4098, dtype=torch.uint8))
    with pytest.raises(ValueError, match="segments.dtype=torch.int32"):
        segment_checksum(torch.zeros(16, dtype=torch.int32))


def test_no_blind_spots_of_the_linear_sums():
    """Hardening round two, item 8: format 1's sums (plain and position-weighted, mod 2^32)
    missed 8e-4 of random 2-bit errors, every pair of bit-31 flips at positions whose weights
    differ by an even number, and a fault that adds to one 32-bit word what it takes from the
    next (a 64-bit lane). The mixed sums catch all of them, on both variants."""
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 256, (1, 4096), dtype=torch.uint8, generator=g)
    base = segment_checksum_torch(x)
    rng = np.random.default_rng(8)
    cases = []
    for _ in range(1500):  # random 2-bit errors
        a, b = rng.choice(4096 * 8, 2, replace=False)
        cases.append(("2bit", [(a // 8, 1 << (a % 8)), (b // 8, 1 << (b % 8))]))
    for i in range(0, 1000, 2):  # paired top-bit flips, two words apart (weights differ by 2)
        cases.append(("bit31", [(4 * i + 3, 0x80), (4 * (i + 2) + 3, 0x80)]))
    ys = []
    for _, flips in cases:
        y = x.clone()
        for byte, mask in flips:
            y[0, byte] ^= mask
        ys.append(y)
    for i in range(0, 1000, 7):  # a 64-bit lane: word i gains what word i + 1 loses
        y = x.clone()
        yw = y.view(torch.int32).numpy().view(np.uint32)  # shares y's memory; uint32 wraps
        yw[0, i] += 0x1000
        yw[0, i + 1] -= 0x1000 * (i + 1) // (i + 2)
        ys.append(y)
    batch = torch.cat(ys)
    t = segment_checksum_torch(batch)
    pick = torch.arange(0, len(batch), 37)  # the Triton variant (interpreted here) on a sample of them
    assert torch.equal(t[pick], segment_checksum_triton(batch[pick]))
    bad = int((t == base).sum())
    assert bad == 0


def test_format_1s_blind_spot_is_real():
    """The negative control: under format 1's definition the paired bit-31 flips above collide."""
    x = np.random.default_rng(1).integers(0, 2**32, 64, dtype=np.uint64)

    def v1(w):
        return int(w.sum()) % 2**32, sum((i + 1) * int(v) for i, v in enumerate(w)) % 2**32

    y = x.copy()
    y[3] ^= 1 << 31
    y[5] ^= 1 << 31
    assert v1(x) == v1(y)
