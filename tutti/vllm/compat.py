"""Everything that differs between vLLM 0.26 and 0.34, in one place (see docs/vllm_api.md).

Features are detected (hasattr / try-import), not versions compared, so a point release
that back-ports an API keeps working.

One idea (the boundary with vLLM's versions), however long: a shim anywhere else would make
`connector.py` more than a translation of callbacks.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _kvbase

VLLM_VERSION = tuple(int(p) for p in vllm.__version__.split("+")[0].split(".")[:2] if p.isdigit())

# 0.32+: workers report back through KVConnectorWorkerMetadata; 0.26 has no such channel.
if hasattr(_kvbase, "KVConnectorWorkerMetadata"):
    WorkerMetadataBase = _kvbase.KVConnectorWorkerMetadata
else:  # pragma: no cover - vLLM 0.26
    class WorkerMetadataBase:  # type: ignore[no-redef]
        def aggregate(self, other):
            raise NotImplementedError


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


def resumed_requests(cached: Any) -> set[str]:
    """Requests of a step's cached part (CachedRequestData) that resumed after preemption: their
    block ids replace the old ones instead of extending them. vLLM 0.32/0.33 list them in
    `resumed_req_ids`; 0.34 dropped the field and re-sends a resumed request in full among the
    step's new requests (NewRequestData, whose block ids replace a known request's), so none here."""
    return getattr(cached, "resumed_req_ids", set()) or set()


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


# ------------------------------------------------------------------ asynchronous loads while the batch is full
# vLLM 0.34: with --max-num-inflight-kv-loads, the scheduler asks the connector's may_load_async(request)
# when a request enters its waiting queues; a request it answers True for waits in a queue whose loads
# start while the running batch is full. Before 0.34 nothing asks (TuttiConnectorV1's answer goes unused).
HAS_MAY_LOAD_ASYNC = hasattr(_kvbase.KVConnectorBase_V1, "may_load_async")


def max_inflight_kv_loads(vllm_config: Any) -> int | None:
    """vLLM 0.34's --max-num-inflight-kv-loads (None: unset, or a vLLM without it): where set, the
    requests may_load_async answers True for start their loads while the running batch is full."""
    if not HAS_MAY_LOAD_ASYNC:
        return None
    v = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_inflight_kv_loads", None)
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


# ------------------------------------------------------------------ the OffloadingConnector's secondary tier
def tier_touched_by_vllm() -> bool:
    """vLLM 0.26-0.33 call a secondary tier's touch(keys) for every hit (recency for eviction);
    0.34 removed touch() from OffloadingManager and SecondaryTierManager, so a tier keeps recency
    from what it is asked to load (tutti.vllm.tier touches a load job's keys on every version)."""
    try:
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    except ImportError:  # pragma: no cover - a vLLM without tiered offloading
        return False
    return hasattr(SecondaryTierManager, "touch")


# ------------------------------------------------------------------ hybrid models (KV cache groups)
# vLLM's hybrid KV cache manager (HMA) gives a model several KV cache groups, each with its own
# block table. tutti declares SupportsHMA on every version that has it (0.26 onwards), so vLLM
# keeps HMA on; each group must be full or sliding-window attention.
HMA_MIXINS: tuple[type, ...] = (_kvbase.SupportsHMA,) if hasattr(_kvbase, "SupportsHMA") else ()


# ------------------------------------------------------------------ versions, for messages


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


