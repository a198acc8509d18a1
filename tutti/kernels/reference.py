"""Plain-torch gather/scatter: the definition the Triton kernels are checked against.

It is also the fast path on CPU, where torch indexing beats the Triton interpreter by far.
Each layer is seen as a uint8 ``(blocks, tokens, heads, pieces, bytes)`` strided view of its
storage, so one advanced index moves every dtype exactly.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .checks import CopyPlan, check_args
from .layout import PagedLayout


def layer_byte_views(caches: Sequence[torch.Tensor], layout: PagedLayout) -> list[torch.Tensor]:
    """Each moved layer as a uint8 ``(blocks, tokens, heads, pieces, bytes)`` strided view of its
    cache's storage (one per layer of `layout` in every tensor): index it with kernel block ids
    and any dtype moves exactly. What a new variant can start from."""
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    size = (layout.num_blocks, layout.block_size, layout.num_heads, layout.num_pieces, layout.piece_bytes)
    stride = (layout.stride_block, layout.stride_token, layout.stride_head, layout.stride_piece, 1)
    views = []
    for c in caches:
        # Whole storage as bytes: as_strided then addresses any byte of it, whatever c's dtype.
        raw = torch.empty(0, dtype=torch.uint8, device=c.device).set_(c.untyped_storage())
        base = c.storage_offset() * c.element_size()
        for l in range(layout.num_layers):
            views.append(raw.as_strided(size, stride, base + l * layout.stride_layer))
    return views


def kernel_block_ids(block_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Manager block m covers kernel blocks m*k .. m*k+k-1: (N, M) -> (N, M*k)."""
    ids = block_ids.to(torch.int64)
    if k == 1:
        return ids
    return (ids.unsqueeze(-1) * k + torch.arange(k, device=ids.device)).reshape(ids.shape[0], -1)


def gather(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    kernel_blocks_per_block: int = 1,
    id_range: tuple[int, int] | None = None,
) -> None:
    """Copy the blocks of each chunk into canonical segments ``out[l, n]`` (padding zeroed)."""
    plan: CopyPlan = check_args(caches, layout, block_ids, out, kernel_blocks_per_block, "out", id_range)
    seg = plan.seg
    if plan.num_chunks == 0:
        return
    kb = kernel_block_ids(block_ids, kernel_blocks_per_block)
    d = plan.data_bytes
    for l, v in enumerate(layer_byte_views(caches, layout)):
        seg[l, :, :d].copy_(v[kb].reshape(plan.num_chunks, d))
    if seg.shape[2] > d:
        seg[:, :, d:].zero_()


def scatter(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    src: torch.Tensor,
    *,
    kernel_blocks_per_block: int = 1,
    id_range: tuple[int, int] | None = None,
) -> None:
    """Copy canonical segments ``src[l, n]`` back into the blocks of each chunk."""
    plan: CopyPlan = check_args(caches, layout, block_ids, src, kernel_blocks_per_block, "src", id_range)
    seg = plan.seg
    if plan.num_chunks == 0:
        return
    kb = kernel_block_ids(block_ids, kernel_blocks_per_block).reshape(-1)
    d = plan.data_bytes
    shape = (kb.numel(), layout.block_size, layout.num_heads, layout.num_pieces, layout.piece_bytes)
    for l, v in enumerate(layer_byte_views(caches, layout)):
        v[kb] = seg[l, :, :d].reshape(shape)
