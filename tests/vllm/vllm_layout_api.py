"""Test helpers over vLLM's layout API (0.26 to 0.33): the logical shape and stride order vLLM
builds for a layer, and where a registered tensor's blocks live. For checking what
`register_kv_caches` received (tests/vllm), not used by the connector, which reads layouts
from the tensors' shapes and strides (tutti.vllm.layout)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

@functools.cache
def has_layout_api() -> bool:
    """0.32+: ``vllm.v1.kv_cache_layout.KVCacheLayout`` and ``KVCacheConfig.kv_cache_layout``."""
    try:
        import vllm.v1.kv_cache_layout  # noqa: F401
    except ImportError:
        return False
    return True


def kv_cache_layout_name(kv_cache_config: Any, vllm_config: Any = None) -> str | None:
    """The resolved physical layout ('LBHNC', 'BLHNC', ...) on 0.32+; None on 0.26,
    where the layout is only visible in the tensors' strides (use ``block_geometry``)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None and vllm_config is not None:
        name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name is None:
        return None
    return getattr(name, "name", str(name))


def attention_groups(kv_cache_config: Any) -> list[tuple[list[str], Any]]:
    """[(layer_names, kv_cache_spec)] for each KV cache group (same fields 0.26-0.33)."""
    return [(list(g.layer_names), g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]


def single_attention_spec(kv_cache_config: Any) -> Any:
    """The one full-attention spec tutti supports (block_size, num_kv_heads, head_size, dtype).

    Raises ValueError naming what was found for hybrid / multi-group models.
    """
    groups = attention_groups(kv_cache_config)
    if len(groups) != 1:
        kinds = [type(s).__name__ for _, s in groups]
        raise ValueError(f"kv_cache_config has {len(groups)} KV cache groups ({kinds}); "
                         "tutti supports one full-attention group: use a model without "
                         "sliding-window/mamba layers")
    spec = groups[0][1]
    for f in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, f):
            raise ValueError(f"kv_cache_spec {type(spec).__name__} has no {f!r}; "
                             "tutti needs an attention spec")
    return spec


def layer_kv_cache_shape_and_order(backend: type, spec: Any, num_blocks: int,
                                   layout_name: str | None = None
                                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Logical per-layer KV cache shape and its physical stride order, as vLLM builds it.

    0.26: ``backend.get_kv_cache_shape(...)`` and ``get_kv_cache_stride_order()``
    (identity when absent). 0.32+: logical ``(B, H, N, C)`` with ``C = head_size +
    head_size_v`` elements and ``KVCacheLayout[layout_name].layer_view_order``.
    For checking what ``register_kv_caches`` received, not for deriving layouts.
    """
    if hasattr(backend, "get_kv_cache_shape"):
        shape = tuple(backend.get_kv_cache_shape(num_blocks, spec.block_size,
                                                 spec.num_kv_heads, spec.head_size))
        try:
            order = tuple(backend.get_kv_cache_stride_order())
        except (AttributeError, NotImplementedError):
            order = tuple(range(len(shape)))
        return shape, order
    if layout_name is None:
        raise ValueError("layout_name is required on vLLM without get_kv_cache_shape (0.32+): "
                         "pass kv_cache_layout_name(kv_cache_config)")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    head_v = getattr(spec, "head_size_v", None) or spec.head_size
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_size + head_v)
    return shape, tuple(KVCacheLayout[layout_name].layer_view_order)


@dataclass(frozen=True)
class BlockGeometry:
    """Where a layer's blocks live: block ``b`` is ``page_bytes`` contiguous bytes
    at ``base_ptr + b * block_stride_bytes``. Whole pages are the unit tutti moves:
    backends disagree on how K and V sit inside a page (docs/vllm_api.md §5)."""

    num_blocks: int
    page_bytes: int
    block_stride_bytes: int
    base_ptr: int
    dtype: Any
    page_shape: tuple[int, ...]


def block_geometry(name: str, kv: Any) -> BlockGeometry:
    """Describe a tensor from ``register_kv_caches`` (dim 0 = blocks in 0.26-0.33).

    Raises ValueError when a block's interior is not one dense run (e.g. a
    head-outer LHBNC layout), since page-wise copies would then be wrong.
    """
    if kv.dim() < 2:
        raise ValueError(f"kv cache {name!r} has shape {tuple(kv.shape)}; expected "
                         "[num_blocks, ...] with at least 2 dims")
    es = kv.element_size()
    inner = kv[0]
    if not inner.is_contiguous():
        raise ValueError(f"kv cache {name!r}: a block (shape {tuple(inner.shape)}, strides "
                         f"{inner.stride()}) is not contiguous; set VLLM_KV_CACHE_LAYOUT "
                         "to a block-contiguous layout (LBHNC/LBNHC/BLHNC/BLNHC)")
    page = math.prod(kv.shape[1:]) * es
    stride = kv.stride(0) * es
    if kv.shape[0] > 1 and stride < page:
        raise ValueError(f"kv cache {name!r}: block stride {stride} B < page {page} B")
    return BlockGeometry(num_blocks=int(kv.shape[0]), page_bytes=page, block_stride_bytes=stride,
                         base_ptr=kv.data_ptr(), dtype=kv.dtype, page_shape=tuple(kv.shape[1:]))
