"""vLLM's configuration, translated once per half into what the engine takes: the geometry
of a chunk (dtype, heads, layers, ranks, the model's identity), the step's token budget, the
scheduling mode and the model's compute shape."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from tutti.engine.geometry import Geometry
from tutti.vllm.identity import model_identity

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


def kv_dtype_name(vllm_config: Any) -> str:
    """The KV cache's element type as a name ('bfloat16', 'fp8_e4m3', ...), 'auto' resolved."""
    return _dtype_of(vllm_config)[0]


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


def engine_id(vllm_config: Any) -> str:
    """vLLM's id of this engine, the same for its scheduler and workers ('' where it has none)."""
    return str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")


def hash_block_size(kv_cache_config: Any, block_size: int) -> int:
    """The block size of vLLM's block hashes (0.32+ may hash in blocks other than the cache's)."""
    return int(getattr(kv_cache_config, "hash_block_size", 0) or block_size)


def data_parallel_rank(vllm_config: Any) -> int:
    pc = vllm_config.parallel_config
    return int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)


def announces(vllm_config: Any, kv_events_endpoint: str) -> bool:
    """Whether KV events go anywhere (tutti's own endpoint or vLLM's --kv-events-config): then a
    writer records its chunks' extras and announces the other writers' chunks."""
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kv_events_endpoint or getattr(kec, "enable_kv_cache_events", False))


@dataclass(frozen=True)
class Setup:
    """What both halves of the connector take from vLLM's configuration, translated once per
    half: the parsed config, the chunk geometry (with its integrity scheme), how hits load and
    the secret. Built before anything touches the disk; every error names the key."""

    cfg: Any  # EngineConfig
    geom: Geometry
    hybrid: bool  # several KV cache groups (TuttiHybridConnectorV1)
    async_loads: bool  # every hit loads asynchronously (vLLM holds the request until received)
    async_why: str  # why, where "auto" decided it (tutti.engine.config.resolve)
    budgeted: bool  # layer-wise loads up to a step's byte budget, asynchronously past it
    mac: Any  # tutti.store.integrity.SegmentMac, or None
    engine_id: str
    hash_block_size: int
    gpu_blocks: int = 0  # vLLM's GPU KV blocks in all (its KVCacheConfig; 0 where it gives none)

    @property
    def load_mode(self) -> str:
        """How hits load, for the start-up line."""
        mode = "async" if self.async_loads else "layerwise+async_past_budget" if self.budgeted else "layerwise"
        return f"{mode} ({self.async_why})" if self.async_why else mode


def setup(vllm_config: Any, kv_cache_config: Any, *, hybrid_connector: bool) -> Setup:
    """Setup from vLLM's config; `hybrid_connector`: the class declares vLLM's hybrid manager."""
    from tutti.engine.build import check_geometry, segment_mac, with_integrity
    from tutti.engine.config import resolve
    from tutti.engine.config.settings import EngineConfig
    from tutti.vllm import compat, layout

    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    cfg = EngineConfig.from_dict(extra, rank=worker_rank(vllm_config))  # before anything touches the disk
    # hybrid models: full, sliding-window and state groups (anything else stops here, named)
    groups = layout.kv_groups(kv_cache_config)
    if len(groups) > 1 and not hybrid_connector:
        raise ValueError(
            f"TuttiConnectorV1: this model has {len(groups)} KV cache groups (vLLM's hybrid KV cache manager is "
            "on); use \"kv_connector\": \"TuttiHybridConnectorV1\" for hybrid models, or let vLLM turn the "
            "hybrid manager off (the default with TuttiConnectorV1)")
    geom = geometry(vllm_config, cfg.chunk_tokens)
    if groups:
        geom = replace(geom, groups=layout.groups_string(groups))
    if any(kind == "state" for kind, _ in groups):  # a chunk's segments: every layer with a cache
        geom = replace(geom, num_layers=sum(len(names) for _, names in groups))
    hybrid = bool(geom.groups)
    # Hits load asynchronously for hybrid models (vLLM takes their failures per request only)
    # and, by default, wherever vLLM schedules asynchronously (see EngineConfig.async_loads).
    async_loads = resolve.async_loads(cfg.async_loads, hybrid=hybrid, schedules_async=schedules_async(vllm_config))
    if hybrid and not compat.has_transfer_results():
        raise ValueError(
            f"TuttiHybridConnectorV1: vLLM {'.'.join(map(str, compat.vllm_version()))} cannot be told that an "
            "asynchronous load failed (no KVConnectorTransferResults), so a damaged chunk could be served; "
            "hybrid models need vLLM 0.32 or later with tutti, or TuttiConnectorV1 (hybrid manager off)")
    mac = segment_mac(cfg)  # validates the secret (if any) before any IO; read once for this half
    geom = with_integrity(geom, mac)  # the namespace of a keyed store is its own
    check_geometry(cfg, geom)  # chunk vs block size, capacity, staging: before any IO
    return Setup(cfg=cfg, geom=geom, hybrid=hybrid, async_loads=async_loads.value, async_why=async_loads.why,
                 budgeted=not async_loads.value and cfg.sync_load_budget_bytes != "off", mac=mac,
                 engine_id=engine_id(vllm_config), hash_block_size=hash_block_size(kv_cache_config, geom.block_size),
                 gpu_blocks=int(getattr(kv_cache_config, "num_blocks", 0) or 0))
