"""Triton gather/scatter between a paged KV cache and canonical segments.

One launch moves every chunk of a wave and every layer: work item = (layer, chunk, kernel
block), programs loop over items persistent-style (``max_programs`` caps the grid, e.g. to
leave SMs to the model). Each item is one contiguous run of ``block_size*H*C`` bytes in the
segment and ``block_size*H*P`` strided pieces in the cache. Bytes move as the widest word
that divides every address, stride and size, so any dtype (fp8, inline scales, int8 views)
moves exactly, and all index math is int64 so caches past 2 GiB work.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .checks import CopyPlan, check_args, word_bytes
from .layout import PagedLayout

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


# Sizes and strides that change from call to call are not specialized on (Triton would compile
# a new kernel when one of them happens to be 1 or a multiple of 16): a request never pays a
# compilation that the warm-up at start-up did not already do.
@triton.jit(do_not_specialize=["ids_sn", "seg_sl", "seg_sn", "num_items", "num_chunks", "kb_per_chunk",
                               "pad_words"])
def _paged_copy_kernel(
    cache_ptr,  # word pointer: storage start of caches[0]
    layer_off_ptr,  # int64 [L]: word offset of each layer's base from cache_ptr (may be < 0)
    ids_ptr,  # int32/int64 [N, M] manager block ids
    ids_sn,
    ids_sm,
    seg_ptr,  # word pointer: segments [L, N, S]
    seg_sl,  # words
    seg_sn,  # words
    num_items,  # L * N * KB
    num_chunks,  # N
    kb_per_chunk,  # KB = M * K
    pad_words,  # words of zero padding after each segment's data (gather only)
    stride_block,  # words
    stride_token,
    stride_head,
    stride_piece,
    K: tl.constexpr,  # kernel blocks per manager block
    BS: tl.constexpr,  # tokens per kernel block
    H: tl.constexpr,
    P: tl.constexpr,
    WW: tl.constexpr,  # words per piece
    VEC: tl.constexpr,  # words known contiguous and aligned together (vectorization hint)
    G: tl.constexpr,  # items per group
    GATHER: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,  # programs sharing one group along grid axis 1, each every SPLIT-th tile
):
    E: tl.constexpr = BS * H * P * WW  # words of one kernel block of one layer
    SPAN: tl.constexpr = G * E  # words of one group of G consecutive items
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    part = tl.program_id(1)
    num_groups = (num_items + G - 1) // G
    for grp in range(pid, num_groups, nprog):
        g0 = (tl.full([], 0, tl.int64) + grp) * G  # first item of the group
        if G == 1:  # one big item: its block id and bases once, as scalars
            j = g0 % kb_per_chunk
            r = g0 // kb_per_chunk
            n = r % num_chunks
            l = r // num_chunks
            m = tl.load(ids_ptr + n * ids_sn + (j // K) * ids_sm).to(tl.int64)
            cbase = tl.load(layer_off_ptr + l) + (m * K + j % K) * stride_block
            sbase = l * seg_sl + n * seg_sn + j * E
        for start in range(part * BLOCK, SPAN, SPLIT * BLOCK):
            f = start + tl.arange(0, BLOCK)
            if G == 1:
                e = f
                mask = f < E
                cb = cbase
                sb = sbase
            else:  # small items (MLA): several per tile so each program moves enough bytes
                it = g0 + f // E
                e = f % E
                mask = (f < SPAN) & (it < num_items)
                jv = it % kb_per_chunk
                rv = it // kb_per_chunk
                nv = rv % num_chunks
                lv = rv // num_chunks
                mv = tl.load(ids_ptr + nv * ids_sn + (jv // K) * ids_sm, mask=mask, other=0).to(tl.int64)
                cb = tl.load(layer_off_ptr + lv, mask=mask, other=0) + (mv * K + jv % K) * stride_block
                sb = lv * seg_sl + nv * seg_sn + jv * E
            w = e % WW
            q = e // WW
            p = q % P
            q = q // P
            h = q % H
            t = q // H
            coff = cb + t.to(tl.int64) * stride_token + h.to(tl.int64) * stride_head + p.to(tl.int64) * stride_piece + w
            soff = sb + e
            coff = tl.max_contiguous(tl.multiple_of(coff, VEC), VEC)
            soff = tl.max_contiguous(tl.multiple_of(soff, VEC), VEC)
            if GATHER:
                tl.store(seg_ptr + soff, tl.load(cache_ptr + coff, mask=mask), mask=mask)
            else:
                tl.store(cache_ptr + coff, tl.load(seg_ptr + soff, mask=mask), mask=mask)
        if GATHER and part == 0:
            for gi in tl.static_range(G):  # zero the padding after each chunk's last block
                pit = g0 + gi
                pj = pit % kb_per_chunk
                if (pit < num_items) & (pj == kb_per_chunk - 1):
                    pr = pit // kb_per_chunk
                    pbase = (pr // num_chunks) * seg_sl + (pr % num_chunks) * seg_sn + (pj + 1) * E
                    for s in range(0, pad_words, BLOCK):
                        o = s + tl.arange(0, BLOCK)
                        zero = tl.zeros([BLOCK], dtype=seg_ptr.dtype.element_ty)
                        tl.store(seg_ptr + pbase + o, zero, mask=o < pad_words)


_offset_cache: dict = {}
_GROUP_WORDS = 8192  # items smaller than this are moved several per program
_DEFAULT_WARPS = 4


def _layer_offsets(addrs: Sequence[int], base: int, ws: int, device: torch.device) -> torch.Tensor:
    """Per-layer word offsets, cached: vLLM's cache tensors stay put for the whole run."""
    key = (device, base, ws, tuple(addrs))
    t = _offset_cache.get(key)
    if t is None:
        if len(_offset_cache) > 64:
            _offset_cache.clear()
        t = torch.tensor([(a - base) // ws for a in addrs], dtype=torch.int64)
        if device.type == "cuda":  # pinned and asynchronous: a pageable copy would make the host wait
            t = t.pin_memory().to(device, non_blocking=True)
        _offset_cache[key] = t
    return t


def _coalesce(layout: PagedLayout) -> tuple[int, int, int, int, int, int, int]:
    """Merge adjacent dims whose bytes follow each other in segment order.

    Pieces, heads and tokens nest in the segment exactly as (token, head, piece, byte), so when
    a dim's stride equals the bytes of everything inside it, it folds into a longer contiguous
    piece: fewer index ops and longer vector runs (e.g. NHD K|V blocks become one run).
    Returns (block_size, heads, pieces, piece_bytes, stride_token, stride_head, stride_piece).
    """
    bs, h, p, w = layout.block_size, layout.num_heads, layout.num_pieces, layout.piece_bytes
    st, sh, sp = layout.stride_token, layout.stride_head, layout.stride_piece
    if p == 2 and sp == w:
        p, w, sp = 1, 2 * w, 0
    if p == 1 and (h == 1 or sh == w):
        h, w, sh = 1, h * w, 0
    if p == 1 and h == 1 and (bs == 1 or st == w):
        bs, w, st = 1, bs * w, 0
    return bs, h, p, w, st, sh, sp


def _interpreted(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    seg: torch.Tensor,
    k: int,
    gather_dir: bool,
    max_programs: Optional[int],
    block: Optional[int],
    num_warps: Optional[int] = None,
    group: Optional[int] = None,
    id_range: Optional[tuple[int, int]] = None,
    split: Optional[int] = None,
) -> None:
    plan: CopyPlan = check_args(caches, layout, block_ids, seg, k, "out" if gather_dir else "src", id_range)
    if max_programs is not None and (not isinstance(max_programs, int) or max_programs < 1):
        raise ValueError(f"max_programs={max_programs!r}: expected None or a positive int")
    if group is not None and (not isinstance(group, int) or group < 1 or group & (group - 1)):
        raise ValueError(f"group={group!r}: expected None or a power of two (items per program step)")
    if split is not None and (not isinstance(split, int) or isinstance(split, bool) or split < 1):
        raise ValueError(f"split={split!r}: expected None or a positive int (programs per group of items)")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps={num_warps!r}: expected None or a power of two up to 32")
    if plan.num_chunks == 0:
        return
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    storage = caches[0].untyped_storage()
    base = storage.data_ptr()
    sg = plan.seg
    S = sg.shape[2]
    bs, nh, npc, pw, st, sh, sp = _coalesce(layout)
    strides = (layout.stride_block, st, sh, sp)
    values = [pw, S, sg.data_ptr(), sg.stride(0), sg.stride(1), base, *strides, *plan.layer_addrs]
    ws = word_bytes(values)
    wdt = _WORD_DTYPES[ws]
    cache_w = torch.empty(0, dtype=wdt, device=plan.device).set_(storage, 0, (storage.nbytes() // ws,), (1,))
    seg_w = sg.view(wdt) if ws > 1 else sg
    offsets = _layer_offsets(plan.layer_addrs, base, ws, plan.device)
    words = [v // ws for v in values]
    vec = 1
    for v in (2, 4):  # 16 bytes at most per vector access
        if v * ws <= 16 and all(x % v == 0 for x in words):
            vec = v
    ww = pw // ws
    E = bs * nh * npc * ww
    items = plan.num_layers * plan.num_chunks * plan.kernel_blocks_per_chunk
    interp = _interpreted(plan.device)
    if group is None:
        # On an H200 grouping small (MLA) blocks measured no faster than one item per program
        # step, so compiled launches keep one; the interpreter groups to cut per-program cost.
        group = 1 if (E >= _GROUP_WORDS or not interp) else min(16, triton.next_power_of_2(triton.cdiv(_GROUP_WORDS, E)))
    span = group * E
    if block is None:
        # H200 sweep (bench/kernel_sweep.py; results/kernels.md, kernel_sweep_h200_2026-12-01.json): tiles of up to
        # 4096 words, one program each, 4 warps, reach 0.92-0.93x of a same-bytes copy_ for both
        # directions on FlashAttention, packed K|V and MLA layouts; an MLA item (2304 words)
        # moves best as ONE masked 4096-word tile (small tiles that divide it measured 0.59x).
        block = min(triton.next_power_of_2(span), 4096)
    tiles = triton.cdiv(span, block)
    if split is None:
        # Compiled: every tile of a group its own program, so many loads are in flight at once
        # (a program looping over tiles waits for each load before its store). Interpreted: one
        # program per group (each program costs milliseconds there).
        split = 1 if interp else tiles
    split = min(split, tiles)
    if num_warps is None:
        num_warps = _DEFAULT_WARPS
    groups = triton.cdiv(items, group)
    grid = groups if max_programs is None else min(groups, max(1, max_programs // split))
    _paged_copy_kernel[(grid, split)](
        cache_w,
        offsets,
        block_ids,
        block_ids.stride(0),
        block_ids.stride(1),
        seg_w,
        seg_w.stride(0),
        seg_w.stride(1),
        items,
        plan.num_chunks,
        plan.kernel_blocks_per_chunk,
        (S - plan.data_bytes) // ws,
        layout.stride_block // ws,
        st // ws,
        sh // ws,
        sp // ws,
        K=k,
        BS=bs,
        H=nh,
        P=npc,
        WW=ww,
        VEC=vec,
        G=group,
        GATHER=gather_dir,
        BLOCK=block,
        SPLIT=split,
        num_warps=num_warps,
    )


def gather(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    kernel_blocks_per_block: int = 1,
    max_programs: Optional[int] = None,
    block: Optional[int] = None,
    num_warps: Optional[int] = None,
    group: Optional[int] = None,
    id_range: Optional[tuple[int, int]] = None,
    split: Optional[int] = None,
) -> None:
    """Copy the blocks of each chunk of every layer into ``out[l, n]`` (padding zeroed), one launch.
    Tuning (None = the defaults measured on an H200): `block` words per tile, `num_warps`,
    `group` items per program step, `split` programs per group, `max_programs` caps the grid."""
    _launch(caches, layout, block_ids, out, kernel_blocks_per_block, True, max_programs, block, num_warps, group,
            id_range, split)


def scatter(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    src: torch.Tensor,
    *,
    kernel_blocks_per_block: int = 1,
    max_programs: Optional[int] = None,
    block: Optional[int] = None,
    num_warps: Optional[int] = None,
    group: Optional[int] = None,
    id_range: Optional[tuple[int, int]] = None,
    split: Optional[int] = None,
) -> None:
    """Copy segments ``src[l, n]`` of every layer back into the blocks of each chunk, one launch
    (tuning arguments as for gather)."""
    _launch(caches, layout, block_ids, src, kernel_blocks_per_block, False, max_programs, block, num_warps, group,
            id_range, split)
