"""The KV cache vLLM hands over, read from its shapes and strides: the paged layout of the
registered tensors, the KV cache groups of hybrid models (full, sliding-window, state), their
layer order, and the block ids vLLM passes per group."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

def kv_groups(kv_cache_config: Any) -> list[tuple[str, list[str]]]:
    """(kind, layer names) of each KV cache group: kind "full", "sw<window>" or "state" (Mamba /
    linear-attention state in vLLM's "align" mode, where the state after each block boundary
    sits in that block's column). A group of any other kind (chunked local attention, a state
    group without prefix caching, ...) stops the server with a message naming it."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        name = type(spec).__name__
        window = getattr(spec, "sliding_window", None)
        layers = f"{list(g.layer_names)[:4]}{'...' if len(g.layer_names) > 4 else ''}"
        if name in ("FullAttentionSpec", "MLAAttentionSpec"):
            kind = "full"
        elif name == "SlidingWindowSpec" and isinstance(window, int) and window > 0:
            kind = f"sw{window}"
        elif "Mamba" in name:
            mode = getattr(spec, "mamba_cache_mode", None)
            if mode != "align":
                raise ValueError(
                    f"TuttiHybridConnectorV1: KV cache group {i} (layers {layers}) holds Mamba/linear-attention "
                    f"state with mamba_cache_mode={mode!r}: vLLM keeps states at block boundaries only in 'align' "
                    "mode, which tutti needs to store a state where a chunk ends; serve with prefix caching on "
                    "(enable_prefix_caching=True, the default; mamba_cache_mode='align')")
            kind = "state"
        else:
            raise ValueError(
                f"TuttiConnectorV1: KV cache group {i} of this model is a {name} group (layers {layers}); tutti "
                "stores full attention, sliding-window attention and Mamba/linear-attention states ('align' "
                "mode). Serve this model without the connector")
        out.append((kind, list(g.layer_names)))
    return out


def state_page_view(state: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """A state-space layer's cache seen as an attention layer's: same dtype, shape and strides
    over the state layer's own memory. vLLM pads a state page to the attention page and keeps
    each block's page contiguous (the groups share one allocation), so block b of the view is
    exactly the state page of block b: the kernels then move a state like any block."""
    es_s, es_a = state.element_size(), like.element_size()
    page = state.stride(0) * es_s
    # the block dimension of the attention tensor (vLLM re-strides FlashAttention's (2, blocks, ...)
    # for hybrid models so that a block's K and V share its page): its stride is one page, and the
    # other dimensions cover that page densely
    dims = [d for d in range(like.dim()) if like.shape[d] == state.shape[0] and like.stride(d) * es_a == page]
    rest = [d for d in range(like.dim()) if not dims or d != dims[0]]
    numel = math.prod(like.shape[d] for d in rest)
    span = sum((like.shape[d] - 1) * like.stride(d) for d in rest) + 1
    if not dims or numel * es_a != page or span != numel or any(st < 0 for st in like.stride()):
        raise ValueError(
            f"TuttiHybridConnectorV1: state layer {name!r} (shape {tuple(state.shape)}, block stride {page} B) and "
            f"the attention layers (shape {tuple(like.shape)}, stride {tuple(like.stride())}, {es_a} B elements) do "
            "not share one contiguous page per block; this attention backend's layout is not supported with "
            "state-space layers")
    off = state.storage_offset() * es_s
    if off % es_a or state.untyped_storage().nbytes() < off + state.shape[0] * page:
        raise ValueError(f"TuttiHybridConnectorV1: state layer {name!r}: its memory does not hold "
                         f"{state.shape[0]} pages of {page} B at offset {off}")
    return torch.empty(0, dtype=like.dtype, device=state.device).set_(
        state.untyped_storage(), off // es_a, like.shape, like.stride())


def layer_order(names: Sequence[str]) -> list[str]:
    """Attention layer names in model order (by layer index): the order of a chunk's segments
    for a hybrid model, the same on the scheduler (from the groups) and the workers (from the
    registered tensors)."""
    from vllm.model_executor.models.utils import extract_layer_index

    def index(n: str) -> tuple[int, str]:
        try:
            return extract_layer_index(n), n
        except Exception:  # noqa: BLE001 - a name without an index sorts after, by name
            return 1 << 30, n

    return sorted(names, key=index)


def groups_string(groups: list[tuple[str, list[str]]]) -> str:
    """Geometry.groups for these groups ("" when one full-attention group: nothing changes)."""
    if len(groups) <= 1 and all(kind == "full" for kind, _ in groups):
        return ""
    group_of = {name: (i, kind) for i, (kind, names) in enumerate(groups) for name in names}
    return ",".join(f"{group_of[n][0]}:{group_of[n][1]}" for n in layer_order(list(group_of)))


def all_groups(block_ids: Any) -> list[list[int]]:
    """vLLM's per-group block ids (a tuple of lists; KVCacheBlocks via get_block_ids()) as lists."""
    if block_ids is None:
        return []
    if hasattr(block_ids, "get_block_ids"):
        block_ids = block_ids.get_block_ids()
    if isinstance(block_ids, (tuple, list)) and block_ids and isinstance(block_ids[0], (list, tuple)):
        return [list(g) for g in block_ids]
    return [list(block_ids)]


def _backend_name(vllm_config: Any, layer_name: str | None) -> str:
    try:
        ctx = vllm_config.compilation_config.static_forward_context
        layer = ctx[layer_name] if layer_name else next(iter(ctx.values()))
        backend = layer.get_attn_backend() if hasattr(layer, "get_attn_backend") else layer.attn_backend
        return backend.get_name()
    except Exception:  # noqa: BLE001
        return "UNKNOWN"


def discover_layout(vllm_config: Any, caches: Sequence[torch.Tensor], *,
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
    num_blocks = _num_blocks(t, kernel_bs, heads, head)
    roles = infer_roles(tuple(t.shape), num_blocks=num_blocks, block_size=kernel_bs, num_heads=heads,
                        head_size=head, mla=mla)
    layout = PagedLayout.from_tensor(t, roles)
    return layout, list(caches), manager_bs // layout.block_size


def _num_blocks(t: torch.Tensor, block_size: int, heads: int, head: int) -> int:
    """The one dimension that is not the block size, heads, K/V or head size."""
    small = {block_size, heads, 2, head, 2 * head, 1}
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
