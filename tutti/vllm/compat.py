"""The vLLM version differences tutti's connector has to bridge (0.26 to 0.33).

Why one module: everything that moved between releases (see docs/vllm_api.md) is
resolved here by feature detection, so the connector code reads the same on every
supported vLLM. vLLM is imported lazily: importing this module never needs vLLM.

What differs, in short:
- 0.26 has ``prefer_cross_layer_blocks`` / ``register_cross_layers_kv_cache`` and
  backends with ``get_kv_cache_shape`` / ``get_kv_cache_stride_order``;
  ``KVCacheTensor.shared_by``; one tensor per layer.
- 0.32+ has ``get_transfer_results`` (with ``failed_recving``), a ``KVCacheLayout``
  enum resolved once per engine (``KVCacheConfig.kv_cache_layout``), and
  ``KVCacheTensor.layers`` placing all layers in one allocation.
- 0.33 adds ``unregister_kv_caches`` / ``restore_kv_caches`` (sleep mode).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "parse_version", "vllm_version", "has_transfer_results", "has_cross_layer_api",
    "has_layout_api", "connector_classes", "make_transfer_results", "kv_cache_layout_name",
    "attention_groups", "single_attention_spec", "layer_kv_cache_shape_and_order",
    "BlockGeometry", "block_geometry",
]


def parse_version(s: str) -> tuple[int, int, int]:
    """'0.32.0', '0.26.0+cpu', '0.33.1rc1.dev5' -> (0, 32, 0); raises ValueError otherwise."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", s)
    if not m:
        raise ValueError(f"vllm version {s!r} is not of the form MAJOR.MINOR[.PATCH]")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@functools.cache
def vllm_version() -> tuple[int, int, int]:
    """The installed vLLM's version (for messages and logs; branch on features, not this)."""
    import vllm

    return parse_version(vllm.__version__)


def _base():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return base


def has_transfer_results() -> bool:
    """0.32+: the worker reports ``get_transfer_results`` (with failed receives)."""
    return hasattr(_base(), "KVConnectorTransferResults")


def has_cross_layer_api() -> bool:
    """0.26: ``register_cross_layers_kv_cache`` replaces ``register_kv_caches`` when
    the connector's ``prefer_cross_layer_blocks`` is True."""
    return hasattr(_base().KVConnectorBase_V1, "register_cross_layers_kv_cache")


@functools.cache
def has_layout_api() -> bool:
    """0.32+: ``vllm.v1.kv_cache_layout.KVCacheLayout`` and ``KVCacheConfig.kv_cache_layout``."""
    try:
        import vllm.v1.kv_cache_layout  # noqa: F401
    except ImportError:
        return False
    return True


def connector_classes() -> tuple[type, type, type]:
    """(KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole): same path in 0.26-0.33."""
    b = _base()
    return b.KVConnectorBase_V1, b.KVConnectorMetadata, b.KVConnectorRole


def make_transfer_results(finished_sending: set[str], finished_recving: set[str],
                          failed_recving: set[str] = frozenset()) -> Any:
    """What ``get_transfer_results`` returns on 0.32+.

    Failed receives must also be reported as finished (vLLM's contract), so they are
    added to ``finished_recving`` here. Raises on vLLM without the API (0.26), where
    the connector answers ``get_finished`` and reports failures as invalid blocks only.
    """
    if not has_transfer_results():
        raise RuntimeError(
            f"vLLM {'.'.join(map(str, vllm_version()))} has no KVConnectorTransferResults; "
            "report completions through get_finished() instead")
    return _base().KVConnectorTransferResults(
        finished_sending=set(finished_sending),
        finished_recving=set(finished_recving) | set(failed_recving),
        failed_recving=set(failed_recving))


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
