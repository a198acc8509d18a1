"""TuttiConnectorV1: vLLM's KV connector interface, translated to tutti's engine.

Load it with
    --kv-transfer-config '{"kv_connector": "TuttiConnectorV1",
                           "kv_connector_module_path": "tutti.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"root": "/mnt/nvme/tutti", "capacity_bytes": "64GiB"}}'

The scheduler half owns the chunk index (tutti.engine.planner); each worker half moves bytes
layer by layer (tutti.engine.worker). This module only translates callbacks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from tutti.engine.config import EngineConfig
from tutti.engine.plan import StepPlan, WorkerReport
from tutti.engine.session import Geometry, build_planner, build_worker, check_geometry
from tutti.vllm import compat

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


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


class TuttiConnectorV1(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        compat.init_base(self, vllm_config, role, kv_cache_config)
        self._extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        # Validate the config before anything touches the disk: errors name key, value, range.
        self._cfg = EngineConfig.from_dict(self._extra, rank=compat.worker_rank(vllm_config))
        compat.check_single_group(kv_cache_config)
        self._geom = compat.geometry(vllm_config, self._cfg.chunk_tokens)
        check_geometry(self._cfg, self._geom)  # chunk vs block size, capacity, staging: before any IO
        self._planner = None
        self._worker = None
        self._layer_index: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._planner = build_planner(self._extra, self._geom)
            logger.info(
                "tutti: scheduler ready: roots=%s capacity=%d B (%d chunks of %d tokens), %d chunks resident",
                list(self._cfg.roots), self._cfg.capacity_bytes, self._planner.index.num_slots,
                self._cfg.chunk_tokens, len(self._planner.index),
            )

    # ------------------------------------------------------------------ properties
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # full CUDA-graph replay would skip the per-layer hooks

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # every layout is read from shapes and strides

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.shutdown()  # registered again (a new engine in this process): release the old store first
        names = list(kv_caches)
        self._layer_index = {n: i for i, n in enumerate(names)}
        caches = [kv_caches[n] for n in names]
        layout, views, kbpb = compat.discover_layout(self._vllm_config, caches, layer_name=names[0])
        geom = self._geom.for_rank(*compat.worker_ranks(self._vllm_config))
        try:
            self._worker = build_worker(self._extra, geom, caches=views, layout=layout,
                                        kernel_blocks_per_block=kbpb, rank=compat.worker_rank(self._vllm_config))
        except Exception:
            compat.release_global_connector(self)  # the engine will not start: do not haunt the next one
            raise
        logger.info(
            "tutti: worker ready: backend=%s roots=%s capacity=%d B layout=%s kernel=%s layers=%d",
            self._worker.queue.caps().backend, list(self._worker.cfg.roots), self._cfg.capacity_bytes,
            layout, self._worker.kernel.name, len(caches),
        )

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any = None) -> None:
        """vLLM 0.26: one tensor holding every layer."""
        layout, views, kbpb = compat.discover_layout(self._vllm_config, [kv_cache], cross_layer=True)
        geom = self._geom.for_rank(*compat.worker_ranks(self._vllm_config))
        self._layer_index = {}
        self._worker = build_worker(self._extra, geom, caches=views, layout=layout,
                                    kernel_blocks_per_block=kbpb, rank=compat.worker_rank(self._vllm_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Start here, not in start_load_kv: vLLM calls that one after the forward pass when the
        # step has no synchronous loads, and stores must be ready before the first layer runs.
        if self._worker is not None and isinstance(connector_metadata, TuttiConnectorMetadata):
            self._worker.start_step(connector_metadata.plan)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # the step was started in bind_connector_metadata

    def _layer(self, layer_name: str) -> int:
        idx = self._layer_index.get(layer_name)
        if idx is None:
            idx = self._layer_index[layer_name] = len(self._layer_index)
        return idx

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(self._layer(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(self._layer(layer_name))

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done = self._worker.finished_requests(set(finished_req_ids))
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed_blocks() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return None if report.is_empty() else TuttiWorkerMetadata(report)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, TuttiConnectorMetadata):
            self._worker.preempt(kv_connector_metadata.plan.preempted)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._planner is not None
        tokens = compat.prompt_tokens(request)
        n = self._planner.match(request.request_id, tokens, num_computed_tokens)
        return n, False  # synchronous: loading is layer-wise inside the step

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.on_alloc(request.request_id, compat.block_ids_of(blocks), num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._planner is not None
        p = self._planner
        computed: dict[str, int] = {}
        for req_id in scheduler_output.preempted_req_ids or ():
            p.preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            p.update_request(new.req_id, tokens=new.prompt_token_ids or [],
                             all_block_ids=compat.first_group(new.block_ids))
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                if req_id in resumed:
                    p.update_request(req_id, all_block_ids=compat.first_group(blocks))
                else:
                    p.update_request(req_id, new_block_ids=compat.first_group(blocks))
            computed[req_id] = cached.num_computed_tokens[i]
        plan = p.build_step(scheduler_output.num_scheduled_tokens, computed)
        return TuttiConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._planner is None:
            return
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TuttiWorkerMetadata):
            self._planner.on_report(meta.report)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        return self._planner.finished(request.request_id), None

    def take_events(self) -> Iterable[Any]:
        if self._planner is None:
            return ()
        return compat.kv_events(self._planner.take_events(), self._cfg.chunk_tokens, self._geom.block_size)

    def get_kv_connector_stats(self) -> Any:
        return None

    # ------------------------------------------------------------------ helpers for tests and tools
    @property
    def planner(self):
        return self._planner

    @property
    def worker(self):
        return self._worker
