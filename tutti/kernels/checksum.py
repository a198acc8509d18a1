"""Per-segment checksum (docs/format.md, format 2): two sums of mixed uint32 words.

Computed on the GPU right after gather and checked after loads, so a torn or misplaced
write of a stored segment is caught before its KV reaches the model. Each word is first
tied to its position and then mixed by the MurmurHash3 finalizer (a bijection whose every
output bit depends on every input bit), so a change in any word moves the sums by a
pseudo-random amount: two flipped bits, paired flips of the top bit or a wrong 64-bit lane
cancel with odds near 2^-64, where format 1's linear sums (sum, position-weighted sum) missed
8e-4 of random 2-bit errors and every paired bit-31 flip. Still a handful of integer ops per
word of a memory-bound pass. Integer arithmetic is exact, so the torch and Triton variants
agree bit for bit on any device.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_MASK32 = 0xFFFFFFFF
_POS = 0x9E3779B9  # position tie: x = w ^ (POS * (i + 1))
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # MurmurHash3 fmix32
_SALT2 = 0x68E31DA4  # the second sum mixes a_i + SALT2 again


def _fmix_torch(x: torch.Tensor) -> torch.Tensor:
    """fmix32 of int64 values in [0, 2^32): products wrap mod 2^64, masked back to 32 bits."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK32
    x = x ^ (x >> 13)
    x = (x * _M2) & _MASK32
    return x ^ (x >> 16)


def _check(segments: torch.Tensor) -> torch.Tensor:
    if not isinstance(segments, torch.Tensor):
        raise ValueError(f"segments={type(segments).__name__}: expected a uint8 torch.Tensor (..., S)")
    if segments.dtype != torch.uint8:
        raise ValueError(f"segments.dtype={segments.dtype}: expected torch.uint8")
    if segments.dim() < 1 or segments.shape[-1] % 4 != 0:
        raise ValueError(f"segments.shape={tuple(segments.shape)}: expected (..., S) with S a multiple of 4")
    seg = segments.reshape(-1, segments.shape[-1])
    if seg.shape[1] and (seg.stride(1) != 1 or seg.data_ptr() % 4 or seg.stride(0) % 4):
        seg = seg.contiguous()  # word access needs 4-byte aligned rows
    return seg


def _combine(s1: torch.Tensor, s2: torch.Tensor, shape) -> torch.Tensor:
    # (s2 << 32) | s1 as a signed int64 bit pattern: int64 shifts wrap, which is exactly that.
    return ((s2 & _MASK32) << 32 | (s1 & _MASK32)).reshape(shape)


STEP_TEMP_BYTES = 1 << 20  # one int64 temporary of a step, at most (whole rows; at least one)


def segment_checksum_torch(segments: torch.Tensor, *, rows_per_step: int = 64) -> torch.Tensor:
    """Torch definition; int64 products wrap mod 2^64, which keeps them exact mod 2^32. Rows go
    `rows_per_step` at a time, fewer where their int64 temporaries would pass STEP_TEMP_BYTES:
    on the CPU 64 rows of 256 KiB segments (a whole load's group) made int64 temporaries of
    32 MiB, allocated and faulted in afresh for every op: 0.08 GB/s where rows of 1 MiB of
    temporaries made 0.4-0.7 GB/s (bench/whole_load_calls.py's machine)."""
    seg = _check(segments)
    m, s = seg.shape
    out_shape = segments.shape[:-1]
    if m == 0:
        return torch.zeros(out_shape, dtype=torch.int64, device=segments.device)
    nw = s // 4
    rows_per_step = max(1, min(rows_per_step, STEP_TEMP_BYTES // max(1, 8 * nw)))
    pos = (torch.arange(1, nw + 1, dtype=torch.int64, device=seg.device) * _POS) & _MASK32
    s1 = torch.empty(m, dtype=torch.int64, device=seg.device)
    s2 = torch.empty(m, dtype=torch.int64, device=seg.device)
    for i in range(0, m, rows_per_step):  # bounded temporaries
        w = seg[i : i + rows_per_step].view(torch.int32).to(torch.int64) & _MASK32
        a = _fmix_torch(w ^ pos)
        b = _fmix_torch((a + _SALT2) & _MASK32)
        s1[i : i + rows_per_step] = a.sum(-1)
        s2[i : i + rows_per_step] = b.sum(-1)
    return _combine(s1, s2, out_shape)


@triton.jit
def _fmix(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _checksum_kernel(seg_ptr, seg_stride, nwords, words_per_split, part_ptr, BLOCK: tl.constexpr):
    # uint32 arithmetic wraps mod 2^32, which is exactly the definition, and is far cheaper
    # on GPUs than int64 multiplies.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    nsplit = tl.num_programs(1)
    lo = split * words_per_split
    acc1 = tl.zeros([BLOCK], dtype=tl.uint32)
    acc2 = tl.zeros([BLOCK], dtype=tl.uint32)
    base = seg_ptr + row * seg_stride
    for start in range(0, words_per_split, BLOCK):
        i = lo + start + tl.arange(0, BLOCK).to(tl.int64)
        mask = (i < nwords) & (i < lo + words_per_split)
        w = tl.load(base + i, mask=mask, other=0).to(tl.uint32, bitcast=True)
        a = _fmix(w ^ ((i + 1).to(tl.uint32) * 0x9E3779B9))
        b = _fmix(a + 0x68E31DA4)
        acc1 += tl.where(mask, a, 0)
        acc2 += tl.where(mask, b, 0)
    out = part_ptr + (row * nsplit + split) * 2
    tl.store(out, tl.sum(acc1, axis=0).to(tl.int64))
    tl.store(out + 1, tl.sum(acc2, axis=0).to(tl.int64))


def segment_checksum_triton(segments: torch.Tensor, *, splits: int | None = None, block: int | None = None) -> torch.Tensor:
    """Triton variant: (rows x splits) programs write partial sums, torch folds them."""
    seg = _check(segments)
    m, s = seg.shape
    out_shape = segments.shape[:-1]
    if m == 0:
        return torch.zeros(out_shape, dtype=torch.int64, device=segments.device)
    nw = s // 4
    interp = seg.device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"
    if block is None:
        block = min(triton.next_power_of_2(max(nw, 1)), 8192 if interp else 2048)
    if splits is None:
        # enough programs to fill a GPU even for few segments; one per row when interpreted
        splits = 1 if interp else max(1, min(triton.cdiv(nw, 4 * block), triton.cdiv(4096, m)))
    per = triton.cdiv(triton.cdiv(nw, splits), block) * block
    splits = max(1, triton.cdiv(nw, per)) if nw else 1
    per = max(per, block)
    part = torch.empty((m, splits, 2), dtype=torch.int64, device=seg.device)
    words = seg.view(torch.int32)
    _checksum_kernel[(m, splits)](words, words.stride(0), nw, per, part, BLOCK=block)
    sums = part.sum(1)  # int64 sums of values < 2^32: exact for < 2^31 splits
    return _combine(sums[:, 0], sums[:, 1], out_shape)


def segment_checksum_definition(seg: bytes) -> int:
    """One segment's checksum as docs/format.md writes it, in plain Python integers with the
    document's literal constants: the slow, independent reference the torch and Triton variants
    are checked against (tests, scripts/gpu_checksum.py)."""
    import struct

    def fmix(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x85EBCA6B) % 2**32
        x ^= x >> 13
        x = (x * 0xC2B2AE35) % 2**32
        return x ^ (x >> 16)

    s1 = s2 = 0
    for i, (w,) in enumerate(struct.iter_unpack("<I", seg)):
        a = fmix(w ^ ((0x9E3779B9 * (i + 1)) % 2**32))
        s1 += a
        s2 += fmix((a + 0x68E31DA4) % 2**32)
    v = (s2 % 2**32) << 32 | s1 % 2**32
    return v - 2**64 if v >= 2**63 else v


def segment_checksum(segments: torch.Tensor) -> torch.Tensor:
    """uint8 (..., S) with S % 4 == 0 -> int64 (...): Triton on CUDA, torch elsewhere."""
    if isinstance(segments, torch.Tensor) and segments.device.type == "cuda":
        return segment_checksum_triton(segments)
    return segment_checksum_torch(segments)
