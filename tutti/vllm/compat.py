"""Everything that differs between vLLM 0.26 and 0.33, in one place (see docs/vllm_api.md).

Features are detected (hasattr / try-import), not versions compared, so a point release
that back-ports an API keeps working.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _base

from tutti.engine.session import Geometry

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())

# 0.32+: workers report back through KVConnectorWorkerMetadata; 0.26 has no such channel.
if hasattr(_base, "KVConnectorWorkerMetadata"):
    WorkerMetadataBase = _base.KVConnectorWorkerMetadata
else:  # pragma: no cover - vLLM 0.26
    class WorkerMetadataBase:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError


def init_base(conn: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
    _base.KVConnectorBase_V1.__init__(conn, vllm_config, role, kv_cache_config)


# ------------------------------------------------------------------ ranks and geometry
def worker_ranks(vllm_config: Any) -> tuple[int, int]:
    """(tp_rank, pp_rank) of this process; (0, 0) where no parallel group exists (scheduler)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:  # noqa: BLE001 - groups are not initialised in the scheduler process
        return 0, 0


def worker_rank(vllm_config: Any) -> int:
    tp, pp = worker_ranks(vllm_config)
    return pp * vllm_config.parallel_config.tensor_parallel_size + tp


def _dtype_of(vllm_config: Any) -> tuple[str, int]:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype in ("auto", ""):
        dt = vllm_config.model_config.dtype
        name = str(dt).replace("torch.", "")
        return name, torch.empty((), dtype=dt).element_size()
    if cache_dtype.startswith("fp8") or cache_dtype.startswith("int8"):
        return cache_dtype, 1
    dt = getattr(torch, cache_dtype, None)
    if isinstance(dt, torch.dtype):
        return cache_dtype, torch.empty((), dtype=dt).element_size()
    raise ValueError(f"cache_dtype={cache_dtype!r}: tutti does not know its element size yet")


def geometry(vllm_config: Any, chunk_tokens: int) -> Geometry:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    dtype_name, es = _dtype_of(vllm_config)
    head = mc.get_head_size()
    mla = bool(getattr(mc, "use_mla", False))
    heads = 1 if mla else mc.get_num_kv_heads(pc)
    content = head * es if mla else 2 * head * es
    return Geometry(
        model=str(mc.model), cache_dtype=dtype_name, chunk_tokens=chunk_tokens,
        block_size=int(vllm_config.cache_config.block_size), num_layers=mc.get_num_layers(pc),
        num_heads=heads, content_bytes=content, tp_size=pc.tensor_parallel_size,
        pp_size=pc.pipeline_parallel_size,
    )


def check_single_group(kv_cache_config: Any) -> None:
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        raise ValueError(
            f"TuttiConnectorV1: this model has {len(groups)} KV cache groups (hybrid attention, e.g. sliding "
            "window or Mamba layers); tutti supports one group until hybrid support lands. Serve it without "
            "the connector, or with --disable-hybrid-kv-cache-manager if every layer can share one spec."
        )


# ------------------------------------------------------------------ layout discovery
def _backend_name(vllm_config: Any, layer_name: str | None) -> str:
    try:
        ctx = vllm_config.compilation_config.static_forward_context
        layer = ctx[layer_name] if layer_name else next(iter(ctx.values()))
        backend = layer.get_attn_backend() if hasattr(layer, "get_attn_backend") else layer.attn_backend
        return backend.get_name()
    except Exception:  # noqa: BLE001
        return "UNKNOWN"


def discover_layout(vllm_config: Any, caches: Sequence[torch.Tensor], *, cross_layer: bool = False,
                    layer_name: str | None = None) -> tuple[Any, list[torch.Tensor], int]:
    """The PagedLayout of the tensors vLLM registered, the tensors to hand the kernels (possibly
    re-viewed), and how many kernel blocks one manager block spans.

    Dimension roles come from the shape (matched against the model's block size, heads and
    head size) and from how the backend reads a page: the CPU backend stores a (block, head)
    page [N, 2D] as N rows of K then N rows of V, FlashAttention as [K|V] per token; both
    become the same canonical [T, H, K|V] segment.
    """
    from tutti.kernels import PagedLayout, infer_roles

    t = caches[0]
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    mla = bool(getattr(mc, "use_mla", False))
    heads = 1 if mla else mc.get_num_kv_heads(pc)
    head = mc.get_head_size()
    manager_bs = int(vllm_config.cache_config.block_size)
    backend = _backend_name(vllm_config, layer_name)
    if "CPU" in backend.upper() and not mla and t.dim() == 4 and t.shape[-1] == 2 * head:
        views = [_cpu_page_view(c, head) for c in caches]
        layout = PagedLayout.from_tensor(views[0], ("block", "head", "kv", "token", "dim"))
        return layout, views, manager_bs // layout.block_size
    kernel_bs = _kernel_block_size(t, manager_bs)
    num_layers = mc.get_num_layers(pc) if cross_layer else None
    num_blocks = _num_blocks(t, kernel_bs, heads, head, num_layers)
    roles = infer_roles(tuple(t.shape), num_blocks=num_blocks, block_size=kernel_bs, num_heads=heads,
                        head_size=head, num_layers=num_layers, mla=mla)
    layout = PagedLayout.from_tensor(t, roles)
    return layout, list(caches), manager_bs // layout.block_size


def _num_blocks(t: torch.Tensor, block_size: int, heads: int, head: int, num_layers: int | None) -> int:
    """The one dimension that is not the block size, heads, K/V, head size or layers."""
    small = {block_size, heads, 2, head, 2 * head, 1}
    if num_layers:
        small.add(num_layers)
    cands = [n for n in t.shape if n not in small]
    return max(cands) if cands else max(t.shape)


def _cpu_page_view(c: torch.Tensor, head: int) -> torch.Tensor:
    b, h, n, two_d = c.shape
    if two_d != 2 * head or c.stride(-1) != 1 or c.stride(-2) != two_d:
        raise ValueError(f"CPU KV cache: expected [B, H, N, 2*{head}] with contiguous pages, got shape "
                         f"{tuple(c.shape)} strides {c.stride()}")
    return c.as_strided((b, h, 2, n, head), (c.stride(0), c.stride(1), head * n, head, 1))


def _kernel_block_size(t: torch.Tensor, manager_bs: int) -> int:
    for n in t.shape:
        if n == manager_bs:
            return manager_bs
    for n in sorted(t.shape):
        if n > 1 and manager_bs % n == 0:
            return n
    return manager_bs


# ------------------------------------------------------------------ requests and blocks
def prompt_tokens(request: Any) -> list[int]:
    toks = getattr(request, "prompt_token_ids", None)
    return list(toks) if toks is not None else []


def first_group(block_ids: Any) -> list[int]:
    """vLLM hands block ids per KV cache group: a tuple of lists. tutti uses group 0."""
    if block_ids is None:
        return []
    if isinstance(block_ids, (tuple, list)) and block_ids and isinstance(block_ids[0], (list, tuple)):
        return list(block_ids[0])
    return list(block_ids)


def block_ids_of(blocks: Any) -> list[int]:
    if hasattr(blocks, "get_block_ids"):
        return first_group(blocks.get_block_ids())
    return first_group(blocks)


def kv_events(events: Iterable[tuple[str, list[bytes]]], chunk_tokens: int, block_size: int) -> list[Any]:
    """Planner events as vLLM KV cache events, marked as coming from storage."""
    out: list[Any] = []
    try:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
    except ImportError:  # pragma: no cover
        return out
    for kind, keys in events:
        hashes = [int.from_bytes(k[:8], "little") for k in keys]
        if kind == "stored":
            out.append(_make_event(BlockStored, block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                   block_size=chunk_tokens, lora_id=None, medium="tutti"))
        else:
            out.append(_make_event(BlockRemoved, block_hashes=hashes, medium="tutti"))
    return [e for e in out if e is not None]


def _make_event(cls: Any, **fields: Any) -> Any:
    import inspect

    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    kw = {k: v for k, v in fields.items() if k in params}
    try:
        return cls(**kw)
    except TypeError:
        return None
