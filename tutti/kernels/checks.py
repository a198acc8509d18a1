"""Argument checks shared by every gather/scatter implementation.

A wrong stride or an out-of-range block id would silently scramble or overwrite KV, so all
launchers validate everything here, before any kernel runs, and raise ValueError that names
the argument, the value and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .layout import PagedLayout


@dataclass(frozen=True)
class CopyPlan:
    """What a launcher needs once the arguments are known to be sane."""

    device: torch.device
    num_layers: int  # total layers moved: len(caches) * layout.num_layers
    num_chunks: int  # N
    kernel_blocks_per_chunk: int  # blocks_per_chunk * k
    chunk_tokens: int  # T
    data_bytes: int  # T*H*C
    segment_bytes: int  # data_bytes rounded up to 4 KiB
    layer_addrs: tuple[int, ...]  # absolute byte address of each moved layer's base
    seg: torch.Tensor  # (L, N, S) uint8 view of out/src


def _byte_offset(t: torch.Tensor) -> int:
    return t.storage_offset() * t.element_size()


def check_args(
    caches: Sequence[torch.Tensor],
    layout: PagedLayout,
    block_ids: torch.Tensor,
    seg: torch.Tensor,
    kernel_blocks_per_block: int,
    seg_name: str,
    id_range: tuple[int, int] | None = None,
) -> CopyPlan:
    """Validate a gather/scatter call from host-side values only.

    Block ids are range-checked from the host: a CPU ``block_ids`` is read directly; a device
    ``block_ids`` needs ``id_range=(min, max)`` known on the host (the engine builds its ids
    from host lists and passes it), else its min and max are read back, which makes the host
    wait for the GPU: fine in a notebook, never on the serving path.
    """
    if not isinstance(layout, PagedLayout):
        raise ValueError(f"layout={type(layout).__name__}: expected a PagedLayout (PagedLayout.from_tensor(t, roles))")
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    caches = list(caches)
    if not caches or not all(isinstance(c, torch.Tensor) for c in caches):
        raise ValueError(f"caches={type(caches).__name__} of length {len(caches)}: expected a non-empty sequence of torch.Tensor, one per layer")
    device = caches[0].device
    k = kernel_blocks_per_block
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"kernel_blocks_per_block={k!r}: expected a positive int (manager block size / kernel block size)")
    if layout.num_blocks < k:
        raise ValueError(f"kernel_blocks_per_block={k} exceeds layout.num_blocks={layout.num_blocks}")
    extent = layout.extent_bytes()
    ref_shape, ref_es = tuple(caches[0].shape), caches[0].element_size()
    ref_strides = tuple(s * ref_es for s in caches[0].stride())
    addrs = []
    for i, c in enumerate(caches):
        if c.device != device:
            raise ValueError(f"caches[{i}].device={c.device}: expected {device} like caches[0]")
        es = c.element_size()
        if tuple(c.shape) != ref_shape or tuple(s * es for s in c.stride()) != ref_strides:
            raise ValueError(
                f"caches[{i}] has shape {tuple(c.shape)} and byte strides {tuple(s * es for s in c.stride())}; "
                f"expected shape {ref_shape} and byte strides {ref_strides} like caches[0] (one layout for all layers)"
            )
        avail = c.untyped_storage().nbytes() - _byte_offset(c)
        if extent > avail:
            raise ValueError(
                f"layout reaches {extent} bytes past the start of caches[{i}] but its storage holds only {avail}; "
                "expected a layout built from this tensor (PagedLayout.from_tensor)"
            )
        for l in range(layout.num_layers):
            addrs.append(c.data_ptr() + l * layout.stride_layer)

    if not isinstance(block_ids, torch.Tensor):
        raise ValueError(f"block_ids={type(block_ids).__name__}: expected a torch.Tensor of shape (N, blocks_per_chunk)")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids.dtype={block_ids.dtype}: expected torch.int32 or torch.int64")
    if block_ids.dim() != 2 or block_ids.shape[1] < 1:
        raise ValueError(f"block_ids.shape={tuple(block_ids.shape)}: expected (N, blocks_per_chunk) with blocks_per_chunk >= 1")
    if block_ids.device != device:
        raise ValueError(f"block_ids.device={block_ids.device}: expected {device} (the caches' device)")
    n_manager = layout.num_blocks // k
    if block_ids.numel():
        if id_range is not None:
            if not (isinstance(id_range, tuple) and len(id_range) == 2 and all(isinstance(v, int) for v in id_range)):
                raise ValueError(f"id_range={id_range!r}: expected a (min, max) tuple of ints, the bounds of block_ids")
            lo, hi = id_range
        else:  # free for a CPU tensor; for a device tensor a host sync (hot paths pass id_range)
            lo, hi = int(block_ids.min()), int(block_ids.max())
        if lo < 0 or hi >= n_manager:
            raise ValueError(
                f"block_ids hold values in [{lo}, {hi}]: expected manager block ids in [0, {n_manager}) "
                f"(layout.num_blocks={layout.num_blocks} kernel blocks / kernel_blocks_per_block={k})"
            )
    n = block_ids.shape[0]
    kb = block_ids.shape[1] * k
    t = kb * layout.block_size
    data = t * layout.token_bytes
    sbytes = layout.segment_bytes(t)
    n_layers = len(addrs)

    if not isinstance(seg, torch.Tensor):
        raise ValueError(f"{seg_name}={type(seg).__name__}: expected a uint8 torch.Tensor of shape (L, N, S)")
    if seg.dtype != torch.uint8:
        raise ValueError(f"{seg_name}.dtype={seg.dtype}: expected torch.uint8 (segments are raw bytes)")
    if seg.device != device:
        raise ValueError(f"{seg_name}.device={seg.device}: expected {device} (the caches' device)")
    if seg.dim() == 2:
        if n_layers != 1:
            raise ValueError(f"{seg_name}.shape={tuple(seg.shape)}: expected (L={n_layers}, N, S) for {n_layers} layers")
        seg = seg.unsqueeze(0)
    if seg.dim() != 3:
        raise ValueError(f"{seg_name}.shape={tuple(seg.shape)}: expected (L, N, S) or (N, S) for one layer")
    if seg.shape[0] != n_layers or seg.shape[1] != n or seg.shape[2] < sbytes:
        raise ValueError(
            f"{seg_name}.shape={tuple(seg.shape)}: expected ({n_layers}, {n}, S>={sbytes}) "
            f"for {n_layers} layers, {n} chunks of {t} tokens x {layout.token_bytes} bytes (4 KiB aligned)"
        )
    if seg.shape[2] > 1 and seg.stride(2) != 1:
        raise ValueError(f"{seg_name}.stride()={seg.stride()}: expected the last dim contiguous (stride 1)")
    if any(s < 0 for s in seg.stride()):
        raise ValueError(f"{seg_name}.stride()={seg.stride()}: negative strides are not supported")
    return CopyPlan(device, n_layers, n, kb, t, data, sbytes, tuple(addrs), seg)


def word_bytes(values: Sequence[int]) -> int:
    """Widest word (8, 4, 2 or 1 bytes) that divides every value: bytes then move exactly."""
    for w in (8, 4, 2):
        if all(v % w == 0 for v in values):
            return w
    return 1
