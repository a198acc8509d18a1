"""vLLM's private state, reached in one place: an in-process engine's scheduler and its
connector (the demo, tests and benchmarks look through them), and the process-global worker
connector that a failed start leaves behind. Not version differences (those are compat.py's):
paths into vLLM that no public API offers.
"""

from __future__ import annotations

from typing import Any


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
