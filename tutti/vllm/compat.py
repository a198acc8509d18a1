"""Everything that differs between vLLM 0.26 and 0.33, in one place (see docs/vllm_api.md).

Features are detected (hasattr / try-import), not versions compared, so a point release
that back-ports an API keeps working.

One idea (the boundary with vLLM's versions), however long: a shim anywhere else would make
`connector.py` more than a translation of callbacks.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _kvbase

from tutti.engine.geometry import Geometry

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())

# 0.32+: workers report back through KVConnectorWorkerMetadata; 0.26 has no such channel.
if hasattr(_kvbase, "KVConnectorWorkerMetadata"):
    WorkerMetadataBase = _kvbase.KVConnectorWorkerMetadata
else:  # pragma: no cover - vLLM 0.26
    class WorkerMetadataBase:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError


def init_base(conn: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
    _kvbase.KVConnectorBase_V1.__init__(conn, vllm_config, role, kv_cache_config)


try:  # vLLM 0.32+: the storage medium of KV events
    from vllm.distributed.kv_events import MEDIUM_STORAGE as KV_EVENT_MEDIUM
except ImportError:  # vLLM 0.26 names file-system tiers "FS"
    from vllm.distributed.kv_events import MEDIUM_FS as KV_EVENT_MEDIUM


def tier_medium() -> Any:
    """The medium a secondary tier of the OffloadingConnector declares: an enum on vLLM 0.32+,
    the KV event string on 0.26."""
    try:
        from vllm.v1.kv_offload.base import Medium

        return Medium.STORAGE
    except ImportError:
        return KV_EVENT_MEDIUM


def tier_job_slots(job: Any) -> list[int]:
    """The CPU-tier slots of a tier transfer job (`block_ids` in vLLM 0.26, `chunk_ids` later)."""
    ids = getattr(job, "chunk_ids", None)
    if ids is None:
        ids = job.block_ids
    return [int(i) for i in ids]


def engine_scheduler(llm: Any) -> Any:
    """The scheduler of an in-process vLLM engine (`vllm.LLM` with VLLM_ENABLE_V1_MULTIPROCESSING=0):
    vLLM's private path to it, written here once for the demo, tests and benchmarks."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def engine_connector(llm: Any) -> Any:
    """The scheduler-side KV connector of an in-process vLLM engine (see engine_scheduler)."""
    return engine_scheduler(llm).connector


def release_global_connector(conn: Any) -> None:
    """Unset vLLM's process-global worker connector if it is `conn`.

    vLLM sets it before the KV caches are registered and clears it only on a clean worker
    shutdown; when registration fails the engine never starts, nothing shuts it down, and every
    later engine in the process would reuse this broken instance (with the old configuration).
    """
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state as _state
    except ImportError:  # pragma: no cover - moved in some version: nothing to release
        return
    if getattr(_state, "_KV_CONNECTOR_AGENT", None) is conn:
        _state._KV_CONNECTOR_AGENT = None


# ------------------------------------------------------------------ CUDA graphs
def step_runs_layer_hooks(forward_context: Any | None) -> bool:
    """Whether vLLM will call the per-layer hooks (wait_for_layer_load / save_kv_layer) in the
    step whose connector metadata is being bound.

    A FULL CUDA graph replays the captured forward pass without them. The V1 model runner binds
    the metadata inside the step's forward context, whose cudagraph_runtime_mode says FULL; the
    V2 model runner (0.26+) binds it with no forward context at all before a FULL replay, and
    inside one (PIECEWISE or NONE) otherwise.
    """
    if forward_context is None:
        return False
    mode = getattr(forward_context, "cudagraph_runtime_mode", None)
    return getattr(mode, "name", None) != "FULL"


def schedules_async(vllm_config: Any) -> bool:
    """Whether vLLM schedules a step before the last one's output is read (its asynchronous
    scheduler, on by default since 0.11; resolved in the config by the time a connector exists)."""
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))


def step_tokens(vllm_config: Any) -> int | None:
    """vLLM's token budget of one step (max_num_batched_tokens), which sizes tutti's staging."""
    v = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    return int(v) if isinstance(v, int) and v > 0 else None


def attention_weight(vllm_config: Any) -> float:
    """How a prompt token's compute grows with its position (`HitQuery.attention_weight`), from the
    model's config; 0 (every token alike) where the config does not say its shape."""
    from tutti.engine.sched.hit_policy import attention_weight as weight

    mc = getattr(vllm_config, "model_config", None)
    hf = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    try:
        hidden = int(hf.hidden_size)
        layers = int(hf.num_hidden_layers)
        q = int(hf.num_attention_heads)
        kv = int(getattr(hf, "num_key_value_heads", None) or q)
        d = int(getattr(hf, "head_dim", None) or hidden // q)
        mlp = getattr(hf, "intermediate_size", None)
        if getattr(hf, "num_experts_per_tok", None) and getattr(hf, "moe_intermediate_size", None):
            mlp = int(hf.num_experts_per_tok) * int(hf.moe_intermediate_size)  # the experts a token runs
        mlp = int(mlp or 4 * hidden)
        kinds = getattr(hf, "layer_types", None)  # hybrid models: only attention layers attend
        attn_layers = (sum(1 for k in kinds if str(k) in ("attention", "full_attention"))
                       if isinstance(kinds, (list, tuple)) and kinds else None)  # "full_attention" or "attention"
        return weight(hidden=hidden, q_heads=q, kv_heads=kv, head_dim=d, mlp=mlp, layers=layers,
                      attention_layers=attn_layers)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0.0


def current_forward_context() -> Any | None:
    """The forward context vLLM has set for this step, or None outside of one."""
    from vllm import forward_context as _fc

    available = getattr(_fc, "is_forward_context_available", None)
    if available is not None and not available():
        return None
    try:
        return _fc.get_forward_context()
    except (AssertionError, RuntimeError):
        return None


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


def constructing_vllm_config(max_frames: int = 24) -> Any | None:
    """The VllmConfig of whatever vLLM code is constructing us, or None.

    vLLM 0.32 builds the scheduler inside `set_current_vllm_config`; vLLM 0.26 does not, and
    its offloading tiers are handed only a digest of the config (KV dtype 'auto' unresolved).
    The OffloadingConnector that builds the tier holds the whole config as a local, so look a
    few frames up for one (by type, never by guessing)."""
    import sys

    try:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
        if getattr(cfg, "model_config", None) is not None:
            return cfg
    except Exception:  # noqa: BLE001 - not set in this process: look at the callers
        pass
    from vllm.config import VllmConfig

    f = sys._getframe(1)
    for _ in range(max_frames):
        if f is None:
            break
        v = f.f_locals.get("vllm_config")
        if isinstance(v, VllmConfig) and v.model_config is not None:
            return v
        f = f.f_back
    return None


def kv_dtype_name(vllm_config: Any) -> str:
    """The KV cache's element type as a name ('bfloat16', 'fp8_e4m3', ...), 'auto' resolved."""
    return _dtype_of(vllm_config)[0]


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json", ".model")
_SAMPLE_PAGES, _PAGE = 16, 4096


def _file_identity(path: str) -> bytes:
    """Size plus a hash of the first 64 KiB (a safetensors header: names, shapes, offsets) and of
    16 pages spread over the file. Cheap on a 100 GB checkpoint, stable across copies, and a
    retrained or re-quantised checkpoint differs in every sampled page."""
    import hashlib
    import os

    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        for i in range(_SAMPLE_PAGES):
            f.seek(max(0, (size - _PAGE) * i // max(1, _SAMPLE_PAGES - 1)))
            h.update(f.read(_PAGE))
    return h.digest()


def model_identity(vllm_config: Any) -> str:
    """What the model's name does not say about its KV values: the weights and config behind it.

    A checkpoint replaced under the same path (a fine-tune, a new revision) keeps every shape,
    so without this its old chunks would be served as if they were still right.
    """
    import hashlib
    import os

    mc, lc = vllm_config.model_config, getattr(vllm_config, "load_config", None)
    load_format = str(getattr(lc, "load_format", "auto"))
    h = hashlib.sha256()
    for part in (load_format, getattr(mc, "quantization", None), getattr(mc, "hf_overrides", None),
                 getattr(mc, "revision", None)):
        h.update(repr(part).encode() + b"\0")
    path = str(mc.model)
    if not os.path.isdir(path):  # a hub id: the cached snapshot directory is named by its commit
        try:
            from huggingface_hub import try_to_load_from_cache

            cfg = try_to_load_from_cache(path, "config.json", revision=getattr(mc, "revision", None))
            if isinstance(cfg, str):
                path = os.path.dirname(cfg)
        except Exception:  # noqa: BLE001 - no hub client: name and revision only
            pass
    if os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full) and name.endswith(_WEIGHT_SUFFIXES) and ("dummy" not in load_format
                                                                             or name.endswith(".json")):
                h.update(name.encode() + b"\0" + _file_identity(full))
    return h.hexdigest()[:16]


def check_context_parallel(parallel_config: Any) -> None:
    """Context parallelism is refused: with decode or prefill context parallel sizes above 1 each
    rank holds another shard of a request's tokens, which tutti's chunks (a rank's whole KV of
    `chunk_tokens` consecutive tokens) do not describe; serving one rank's shard to another would
    be wrong KV."""
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        v = int(getattr(parallel_config, name, 1) or 1)
        if v > 1:
            raise ValueError(f"TuttiConnectorV1: {name}={v}: context parallelism is not supported (each rank holds "
                             f"a different shard of the tokens); serve with {name}=1, or without the connector")


def geometry(vllm_config: Any, chunk_tokens: int) -> Geometry:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    check_context_parallel(pc)
    dtype_name, es = _dtype_of(vllm_config)
    head = mc.get_head_size()
    mla = bool(getattr(mc, "use_mla", False))
    heads = 1 if mla else mc.get_num_kv_heads(pc)
    content = head * es if mla else 2 * head * es
    return Geometry(
        model=str(mc.model), cache_dtype=dtype_name, chunk_tokens=chunk_tokens,
        block_size=int(vllm_config.cache_config.block_size), num_layers=mc.get_num_layers(pc),
        num_heads=heads, content_bytes=content, tp_size=pc.tensor_parallel_size,
        pp_size=pc.pipeline_parallel_size, kv_replicated=mla, model_id=model_identity(vllm_config),
    )


# ------------------------------------------------------------------ hybrid models (KV cache groups)
# vLLM's hybrid KV cache manager (HMA) gives a model several KV cache groups, each with its own
# block table. tutti declares SupportsHMA on every version that has it (0.26 onwards), so vLLM
# keeps HMA on; each group must be full or sliding-window attention.
HMA_MIXINS: tuple[type, ...] = (_kvbase.SupportsHMA,) if hasattr(_kvbase, "SupportsHMA") else ()


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


# ------------------------------------------------------------------ layout discovery
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


# ------------------------------------------------------------------ requests and blocks
# ------------------------------------------------------------------ chunk identity
def _extra_keys_fn():
    """vLLM's own per-block extra keys (LoRA, multimodal identifiers and offsets, cache salt,
    prompt-embedding hashes): the same function vLLM's block hash uses, on 0.26 and 0.32+, so a
    field vLLM adds there becomes part of tutti's keys too."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return generate_block_hash_extra_keys


@functools.lru_cache(maxsize=256)
def _adapter_identity(path: str, signature: tuple) -> bytes:
    """Content identity of a LoRA adapter directory (its files' sizes and sampled pages): an
    adapter replaced under the same name and path gets new keys."""
    import hashlib
    import os

    h = hashlib.sha256()
    for name, _ in signature:
        h.update(name.encode() + b"\0" + _file_identity(os.path.join(path, name)))
    return h.digest()


def lora_identity(lora_request: Any) -> bytes:
    if lora_request is None:
        return b""
    import os

    path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
    if not os.path.isdir(path):
        return b""  # a hub id or a remote path: vLLM's extra keys (name, path) are the identity
    try:
        sig = tuple(sorted((n, os.stat(os.path.join(path, n)).st_mtime_ns) for n in os.listdir(path)
                           if os.path.isfile(os.path.join(path, n))))
        return _adapter_identity(path, sig)
    except OSError:
        return b""


def request_identity(request: Any, hash_block_size: int):
    """identity(start, end) -> bytes for tutti's chunk keys: vLLM's extra keys of every vLLM
    block in [start, end), plus the LoRA adapter's content identity. None for a request with
    none of them (token ids alone say what its KV is)."""
    from tutti.engine.keys import canonical

    lora = getattr(request, "lora_request", None)
    mm = getattr(request, "mm_features", None) or getattr(request, "mm_hashes", None)
    if not (lora or mm or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None):
        return None
    extra_keys = _extra_keys_fn()
    adapter = lora_identity(lora)

    def identity(start: int, end: int) -> bytes:
        parts: list[Any] = [adapter]
        for b in range(start, end, hash_block_size):
            keys, _ = extra_keys(request, b, b + hash_block_size, 0)
            parts.append(keys)
        return canonical(parts)

    return identity


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


# ------------------------------------------------------------------ feature detection and layout facts



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


@functools.cache
def has_layout_api() -> bool:
    """0.32+: ``vllm.v1.kv_cache_layout.KVCacheLayout`` and ``KVCacheConfig.kv_cache_layout``."""
    try:
        import vllm.v1.kv_cache_layout  # noqa: F401
    except ImportError:
        return False
    return True


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


def max_load_tokens(request: Any) -> int | None:
    """The request's own cap on loaded tokens (vLLM 0.33's `kv_transfer_params["max_load_tokens"]`,
    0 = load nothing), or None. A value that is not a non-negative integer is ignored, said once."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or "max_load_tokens" not in params:
        return None
    v = params["max_load_tokens"]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        from vllm.logger import init_logger

        init_logger(__name__).warning("tutti: request %s: kv_transfer_params max_load_tokens=%r ignored (expected an integer >= 0)",
                       getattr(request, "request_id", "?"), v)
        return None
    return v

