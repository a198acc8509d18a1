"""TuttiConnectorV1: vLLM's KV connector interface, translated to tutti's engine.

Load it with
    --kv-transfer-config '{"kv_connector": "TuttiConnectorV1",
                           "kv_connector_module_path": "tutti.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"root": "/mnt/nvme/tutti", "capacity_bytes": "64GiB"}}'

vLLM builds one instance per role: the scheduler's half (tutti.vllm.scheduler_side, over the
planner that owns the chunk index) or a worker's (tutti.vllm.worker_side, over the pipeline that
moves bytes layer by layer). This module only forwards callbacks to the half of its role.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.engine.hostcost import HOST_COST_INTERVAL_S
from tutti.engine.plan import StepPlan, WorkerReport
from tutti.vllm import compat, translate
from tutti.vllm.logs import route_tutti_logs
from tutti.vllm.scheduler_side import SchedulerHalf
from tutti.vllm.stats import TuttiKVConnectorStats, TuttiPromMetrics
from tutti.vllm.worker_side import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class TuttiConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: one step's plan."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class TuttiWorkerMetadata(compat.WorkerMetadataBase):
    """Workers -> scheduler: what was stored, what failed. Merged across workers."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: "TuttiWorkerMetadata") -> "TuttiWorkerMetadata":
        return TuttiWorkerMetadata(self.report.merge(other.report))


@contextmanager
def _config_errors():
    """The engine names its configuration's keys plainly; here they are vLLM's extra config."""
    try:
        yield
    except ConfigError as exc:
        raise ValueError(exc.qualified("kv_connector_extra_config")) from None


class TuttiConnectorV1(KVConnectorBase_V1):
    """A facade: each callback forwards to the scheduler's half (`tutti.vllm.scheduler_side`) or
    the worker's (`tutti.vllm.worker_side`), as vLLM builds one instance per role."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        route_tutti_logs()
        self._sched: SchedulerHalf | None = None
        self._work: WorkerHalf | None = None
        self._host_costs_at = float("-inf")
        with _config_errors():
            setup = translate.setup(vllm_config, kv_cache_config, hybrid_connector=isinstance(self, compat.HMA_MIXINS))
            if role == KVConnectorRole.SCHEDULER:
                self._sched = SchedulerHalf(vllm_config, setup)
            else:
                self._work = WorkerHalf(vllm_config, setup)

    # ------------------------------------------------------------------ properties
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM asks this while it builds its config, in the API server's process, long before the
        # model loads: a bad configuration stops the server here, in seconds, naming the key.
        with _config_errors():
            EngineConfig.from_dict(extra_config or {})
        # FULL graphs stay on: a step that replays one runs no per-layer hooks, so its loads are
        # all done before the forward (start_step(layerwise=False)) and stores never need hooks.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # every layout is read from shapes and strides

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with _config_errors():
            self._work.register(kv_caches, owner=self)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Start here, not in start_load_kv: vLLM 0.32 calls that one after the forward pass when
        # the step has no synchronous loads, and loads must be under way before layer 0.
        w = self._work
        if w is not None and w.worker is not None and isinstance(connector_metadata, TuttiConnectorMetadata):
            w.start_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # the step was started in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._work.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._work.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self._work.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32+: stores done, asynchronous loads received, and those that failed (vLLM
        recomputes those requests)."""
        return self._work.transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.failed_blocks() if self._work is not None else set()

    def build_connector_worker_meta(self) -> Any:
        report = self._work.take_report() if self._work is not None else None
        return None if report is None else TuttiWorkerMetadata(report)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._work is not None and isinstance(kv_connector_metadata, TuttiConnectorMetadata):
            self._work.preempt(kv_connector_metadata.plan)

    def shutdown(self) -> None:
        for half in (self._work, self._sched):
            if half is not None:
                half.shutdown()

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return TuttiConnectorMetadata(self._sched.build_step(scheduler_output))

    def may_load_async(self, request: "Request") -> bool:
        """vLLM 0.34+ (--max-num-inflight-kv-loads): whether this request's hit may load while the
        running batch is full (tutti.vllm.scheduler_side.SchedulerHalf.may_load_async). Earlier
        vLLMs never ask."""
        return self._sched.may_load_async(request) if self._sched is not None else False

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._sched is not None and isinstance(meta, TuttiWorkerMetadata):
            self._sched.on_report(meta.report)
        received = getattr(connector_output, "finished_recving", None)
        if self._sched is not None and received:
            self._sched.received(received)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA: vLLM calls this instead of request_finished once tutti declares hybrid support."""
        return self.request_finished(request, [])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request), None

    def take_events(self) -> Iterable[Any]:
        return self._sched.take_events() if self._sched is not None else ()

    def get_kv_connector_stats(self) -> TuttiKVConnectorStats | None:
        """Worker: bytes/seconds moved and stores skipped since the last call. Scheduler (vLLM
        calls its instance every step too): lookups, hits, failed loads, commits, evictions
        and capacity. vLLM aggregates both into one payload (tutti.vllm.stats)."""
        due = self._host_costs_due()
        if self._work is not None:
            return self._work.stats(due)
        return self._sched.stats(due) if self._sched is not None else None

    def _host_costs_due(self, interval_s: float = HOST_COST_INTERVAL_S) -> bool:
        """Whether the host-cost counters go out with this step's stats: walking the threads and
        sending three more counters every step cost more than the step's other stats."""
        now = time.monotonic()
        if now - self._host_costs_at < interval_s:
            return False
        self._host_costs_at = now
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TuttiKVConnectorStats:
        return TuttiKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TuttiPromMetrics:
        return TuttiPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------ for tests and tools
    @property
    def planner(self):
        return self._sched.planner if self._sched is not None else None

    @property
    def worker(self):
        return self._work.worker if self._work is not None else None


class TuttiHybridConnectorV1(TuttiConnectorV1, *compat.HMA_MIXINS):
    """TuttiConnectorV1 with vLLM's hybrid KV cache manager kept on (SupportsHMA): models with
    sliding-window layers beside full attention keep one block table per KV cache group, and a
    sliding-window layer stores every chunk but loads only the chunks inside its window at the
    hit's end. Mamba/linear-attention state groups are refused at start.

    Its hits load asynchronously (tutti.engine.worker.async_loads): vLLM holds the request until the
    worker reports it received, and with several KV cache groups it takes a failed load only per
    request (get_transfer_results' failed_recving), never block by block; a failed request is
    recomputed. vLLM 0.32 or later (the API that carries those failures).
    """
