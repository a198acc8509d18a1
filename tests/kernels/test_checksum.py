"""Segment checksum: torch and Triton agree exactly and match the written definition."""

import numpy as np
import pytest
import torch

from tutti.kernels import segment_checksum, segment_checksum_torch, segment_checksum_triton


def _by_definition(seg: bytes) -> int:
    w = np.frombuffer(seg, dtype="<u4").astype(np.uint64)
    s1 = int(w.sum()) % 2**32
    s2 = sum((i + 1) * int(v) for i, v in enumerate(w)) % 2**32
    v = (s2 << 32) | s1
    return v - 2**64 if v >= 2**63 else v


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
