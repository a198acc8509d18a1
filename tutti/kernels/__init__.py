"""Triton kernels that move KV between vLLM's paged cache and packed layer segments.

A canonical segment (docs/format.md, FORMAT_VERSION) holds one chunk of one layer in
token-major ``[T, H, C]`` order whatever the cache layout, so what one vLLM configuration
saved another can load.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .checks import CopyPlan, check_args, word_bytes
from .checksum import segment_checksum, segment_checksum_definition, segment_checksum_torch, segment_checksum_triton
from .conformance import ConformanceReport, check_variant
from .layout import PagedLayout, infer_roles
from .reference import kernel_block_ids, layer_byte_views
from .registry import KernelVariant, available_variants, get_variant, register_variant

from tutti.format import FORMAT_VERSION  # noqa: E402 - re-exported: the kernels write this format


def gather(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    out: torch.Tensor,
    *,
    kernel_blocks_per_block: int = 1,
    variant="auto",
    **kwargs,
) -> None:
    """Copy chunks ``block_ids`` (N, blocks_per_chunk) of every layer into segments ``out`` (L, N, S)."""
    get_variant(variant).gather(caches, layout, block_ids, out, kernel_blocks_per_block=kernel_blocks_per_block, **kwargs)


def scatter(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    src: torch.Tensor,
    *,
    kernel_blocks_per_block: int = 1,
    variant="auto",
    **kwargs,
) -> None:
    """Copy segments ``src`` (L, N, S) back into chunks ``block_ids`` of every layer."""
    get_variant(variant).scatter(caches, layout, block_ids, src, kernel_blocks_per_block=kernel_blocks_per_block, **kwargs)


__all__ = [
    "FORMAT_VERSION",
    "PagedLayout",
    "infer_roles",
    "gather",
    "scatter",
    "KernelVariant",
    "get_variant",
    "register_variant",
    "available_variants",
    "segment_checksum",
    "segment_checksum_definition",
    "segment_checksum_torch",
    "segment_checksum_triton",
    "check_variant",
    "ConformanceReport",
    "check_args",
    "CopyPlan",
    "word_bytes",
    "layer_byte_views",
    "kernel_block_ids",
]
