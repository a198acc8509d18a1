"""TuttiConnectorV1: vLLM's KV connector interface, translated to tutti's engine.

Load it with
    --kv-transfer-config '{"kv_connector": "TuttiConnectorV1",
                           "kv_connector_module_path": "tutti.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"root": "/mnt/nvme/tutti", "capacity_bytes": "64GiB"}}'

The scheduler half owns the chunk index (tutti.engine.sched.planner); each worker half moves bytes
layer by layer (tutti.engine.worker.pipeline). This module only translates callbacks.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.engine.plan import StepPlan, WorkerReport
from tutti.engine import claims
from tutti.engine.build import build_planner, build_worker, check_geometry, segment_mac, with_integrity
from tutti.engine.hostcost import (HOST_COST_INTERVAL_S, WAITS, HookClock, ThreadCPU, scheduler_threads, timed,
                                   worker_threads)
from tutti.vllm import compat
from tutti.vllm.logs import route_tutti_logs
from tutti.vllm.events import EventPublisher, KVEventTracker, expand_topic
from tutti.vllm.stats import SchedulerStatsTracker, TuttiKVConnectorStats, TuttiPromMetrics, stats_from

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under "vllm." so the lines go through vLLM's log handler and level (VLLM_LOGGING_LEVEL).
logger = init_logger("vllm.tutti.connector")


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
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        compat.init_base(self, vllm_config, role, kv_cache_config)
        route_tutti_logs()
        with _config_errors():
            self._init(vllm_config, role, kv_cache_config)

    def _init(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any) -> None:
        self._extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        # Validate the config before anything touches the disk: errors name key, value, range.
        self._cfg = EngineConfig.from_dict(self._extra, rank=compat.worker_rank(vllm_config))
        # hybrid models: full, sliding-window and state groups (anything else stops here, named)
        groups = compat.kv_groups(kv_cache_config)
        if len(groups) > 1 and not isinstance(self, compat.HMA_MIXINS):
            raise ValueError(
                f"TuttiConnectorV1: this model has {len(groups)} KV cache groups (vLLM's hybrid KV cache manager is "
                "on); use \"kv_connector\": \"TuttiHybridConnectorV1\" for hybrid models, or let vLLM turn the "
                "hybrid manager off (the default with TuttiConnectorV1)")
        geom = compat.geometry(vllm_config, self._cfg.chunk_tokens)
        if groups:
            geom = replace(geom, groups=compat.groups_string(groups))
        if any(kind == "state" for kind, _ in groups):  # a chunk's segments: every layer with a cache
            geom = replace(geom, num_layers=sum(len(names) for _, names in groups))
        self._hybrid = bool(geom.groups)
        # Hits load asynchronously for hybrid models (vLLM takes their failures per request only)
        # and, by default, wherever vLLM schedules asynchronously: a layer-wise load failing its
        # checksum there would already have a token sampled from its KV in flight (see async_loads).
        mode = self._cfg.async_loads
        self._async_loads = self._hybrid or mode is True or (mode == "auto" and compat.schedules_async(vllm_config))
        # Layer-wise loads with a per-step byte budget: a hit past it loads asynchronously, so the
        # worker keeps a quarter of its load slots for those (sync_load_budget_bytes)
        self._budgeted = not self._async_loads and self._cfg.sync_load_budget_bytes != "off"
        self._failed_async_blocks: set[int] = set()
        if self._hybrid and not compat.has_transfer_results():
            raise ValueError(
                f"TuttiHybridConnectorV1: vLLM {'.'.join(map(str, compat.vllm_version()))} cannot be told that an "
                "asynchronous load failed (no KVConnectorTransferResults), so a damaged chunk could be served; "
                "hybrid models need vLLM 0.32 or later with tutti, or TuttiConnectorV1 (hybrid manager off)")
        # validates the secret (if any) before any IO; the namespace of a keyed store is its own
        self._mac = segment_mac(self._cfg)  # the secret, read once for this half
        self._geom = with_integrity(geom, self._mac)
        check_geometry(self._cfg, self._geom)  # chunk vs block size, capacity, staging: before any IO
        self._planner = None
        self._worker = None
        # vLLM's id of this engine, the same for its scheduler and workers: "auto" writer ids
        # are handed from the worker to the scheduler under it (tutti.engine.claims)
        self._engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", "") or "")
        self._hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or self._geom.block_size)
        self._layer_index: dict[str, int] = {}
        self._layer_work = False  # this step has layer-wise loads: the per-layer hooks have work
        self._requests: dict[str, Any] = {}  # scheduler side, with store_decode: live Request objects
        self._events: KVEventTracker | None = None
        self._publisher: EventPublisher | None = None
        # host time of tutti's hooks, and CPU of its threads (tutti.engine.hostcost), as metrics
        self._hooks = HookClock()
        # host costs go out at most every quarter second (cumulative counters: nothing is lost)
        self._threads = ThreadCPU(scheduler_threads if role == KVConnectorRole.SCHEDULER else worker_threads,
                                  interval_s=0.0)
        self._host_costs_at = float("-inf")
        if role == KVConnectorRole.SCHEDULER:
            # chunks are announced where events go anywhere: then this writer records its chunks'
            # extras and announces the other writers' (any replica can load them)
            kec = getattr(vllm_config, "kv_events_config", None)
            announce = bool(self._cfg.kv_events_endpoint or getattr(kec, "enable_kv_cache_events", False))
            self._planner = build_planner(self._cfg, self._geom, engine_id=self._engine_id, announce=announce,
                                          mac=self._mac)
            self._planner.asynchronous = self._async_loads  # the hit policy models this load mode
            if self._budgeted:
                self._planner.sync_budget = self._cfg.sync_load_budget_bytes
                self._planner.can_load_async = True
            self._planner.step_tokens = compat.step_tokens(vllm_config) or 8192
            self._planner.attention_weight = compat.attention_weight(vllm_config)
            self._sched_stats = SchedulerStatsTracker(self._planner.index.num_slots * self._planner.slot_bytes)
            hash_bs = self._hash_block_size
            self._events = KVEventTracker(chunk_tokens=self._cfg.chunk_tokens, hash_block_size=hash_bs,
                                          seed=self._planner.seed)
            if self._cfg.kv_events_endpoint:
                pc = vllm_config.parallel_config
                dp = int(getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0)
                self._publisher = EventPublisher(
                    self._cfg.kv_events_endpoint, data_parallel_rank=dp,
                    topic=expand_topic(self._cfg.kv_events_topic, str(vllm_config.model_config.served_model_name),
                                       self._planner.writer_id))
            foreign = self._planner.foreign
            self._startup_events: list = []
            self._startup_at = time.monotonic()
            self._startup_lock = threading.Lock()
            extras = self._planner.extras
            if extras is not None:
                # what this server can load from its first step: its own chunks from an earlier run
                # (as recorded) and the other writers' (as found by the first refresh)
                # (translated when sent: vLLM sets its hash seed after this connector is built)
                self._events.lookup = extras.lookup
                self._startup_events = [(False, [("stored", k, x) for k, x in extras.items()])]
                if foreign is not None:
                    self._startup_events.append((True, foreign.take_events()))
            if foreign is not None and self._publisher is not None and extras is not None:
                foreign.on_events = self._publish_foreign  # as found, whether this server steps or not
            logger.debug(
                "tutti: scheduler ready: roots=%s capacity=%d B (%d chunks of %d tokens), %d chunks resident, "
                "writer %r, %d chunks of %d other writers, events=%s", list(self._cfg.roots), self._cfg.capacity_bytes,
                self._planner.index.num_slots, self._cfg.chunk_tokens, len(self._planner.index), self._cfg.writer_id,
                len(foreign) if foreign else 0, len(foreign.writers) if foreign else 0,
                self._cfg.kv_events_endpoint or "vLLM only",
            )

    # ------------------------------------------------------------------ properties
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is only a future miss

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # FULL graphs stay on: a step that replays one runs no per-layer hooks, so its loads are
        # all done before the forward (start_step(layerwise=False)) and stores never need hooks.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # every layout is read from shapes and strides

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with _config_errors():
            self._register(kv_caches)

    def _register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.shutdown()  # registered again (a new engine in this process): release the old store first
        # a hybrid model's segments follow the model's layer order, as its namespace says
        names = compat.layer_order(list(kv_caches)) if self._hybrid else list(kv_caches)
        if self._hybrid and len(names) != len(self._geom.groups.split(",")):
            raise ValueError(f"TuttiConnectorV1: {len(names)} KV cache tensors registered for "
                             f"{len(self._geom.groups.split(','))} attention layers in the KV cache groups")
        self._layer_index = {n: i for i, n in enumerate(names)}
        caches = [kv_caches[n] for n in names]
        kinds = self._geom.kind_of_layer
        if "state" in kinds:  # Mamba / linear-attention layers: their pages seen as an attention layer's
            like = next(c for c, k in zip(caches, kinds) if k != "state")
            caches = [compat.state_page_view(c, like, n) if k == "state" else c
                      for c, k, n in zip(caches, kinds, names)]
        first_attn = next((n for n, k in zip(names, kinds) if k != "state"), names[0])
        layout, views, kbpb = compat.discover_layout(self._vllm_config, caches, layer_name=first_attn)
        geom = self._geom.for_rank(*compat.worker_ranks(self._vllm_config))
        try:
            self._worker = build_worker(self._cfg, geom, caches=views, layout=layout,
                                        kernel_blocks_per_block=kbpb, rank=compat.worker_rank(self._vllm_config),
                                        async_loads=(self._async_loads and not self._hybrid) or
                                        ("split" if self._budgeted else False),
                                        step_tokens=compat.step_tokens(self._vllm_config),
                                        engine_id=self._engine_id, mac=self._mac)
        except Exception:
            compat.release_global_connector(self)  # the engine will not start: do not haunt the next one
            raise
        self._worker.warm_up()
        self._log_ready(layout, len(caches))

    def _log_ready(self, layout: Any, num_layers: int) -> None:
        """The one start-up line (INFO, rank 0; other ranks at DEBUG)."""
        w = self._worker
        rank = compat.worker_rank(self._vllm_config)
        (logger.info if rank == 0 else logger.debug)(
            "tutti: ready: backend=%s roots=%s capacity=%d B layout=%s kernel=%s layers=%d chunk=%d tokens "
            "resident=%d chunks rank=%d staging=%d B (%d store chunks) mapped=%d B in %.2f s%s hits=%s "
            "read probe=%d B in %.3f s gil_switch_interval=%g s idle_load_wait=%g s; start-up took %.2f s",
            w.queue.caps().backend, list(w.cfg.roots), self._cfg.capacity_bytes, layout, w.kernel.name,
            num_layers, self._cfg.chunk_tokens, w.resident_chunks, rank, w.cfg.staging_bytes,
            w.stores.arena.num_regions, w.mapped_bytes, w.map_seconds,
            f" (stores copy into it: {w.stores.map_copy})" if w.stores.into_maps else "", self._load_mode(), w.probe[0], w.probe[1],
            sys.getswitchinterval(), w.idle_wait_s, w.warmup_seconds,
        )

    def _load_mode(self) -> str:
        """How hits load, for the start-up line: asynchronously (the request waits outside the
        batch), layer-wise in the step, or layer-wise up to the step's byte budget and
        asynchronously past it."""
        if self._async_loads:
            return "async"
        return "layerwise+async_past_budget" if self._budgeted else "layerwise"

    @timed("_hooks")
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Start here, not in start_load_kv: vLLM 0.32 calls that one after the forward pass when
        # the step has no synchronous loads, and loads must be under way before layer 0.
        if self._worker is not None and isinstance(connector_metadata, TuttiConnectorMetadata):
            plan = connector_metadata.plan
            # whether this step's forward runs the per-layer hooks matters only to its loads and
            # stores (a quiet decode step does not ask the forward context)
            layerwise = bool(plan.loads or plan.stores) and compat.step_runs_layer_hooks(compat.current_forward_context())
            self._worker.start_step(plan, layerwise=layerwise)
            self._layer_work = bool(plan.loads) and layerwise

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None  # the step was started in bind_connector_metadata

    def _layer(self, layer_name: str) -> int:
        idx = self._layer_index.get(layer_name)
        if idx is None:
            idx = self._layer_index[layer_name] = len(self._layer_index)
        return idx

    def wait_for_layer_load(self, layer_name: str) -> None:
        # called for every layer of every piecewise step: a step without layer-wise loads returns
        # at once (its stores are gathered after the forward, in wait_for_save)
        if self._layer_work:
            self._wait_layer(layer_name)

    @timed("_hooks")
    def _wait_layer(self, layer_name: str) -> None:
        self._worker.wait_layer(self._layer(layer_name))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self._layer_work:
            self._save_layer(layer_name)

    @timed("_hooks")
    def _save_layer(self, layer_name: str) -> None:
        self._worker.save_layer(self._layer(layer_name))

    @timed("_hooks")
    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.end_step()

    def _completions(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(requests whose stores are done, asynchronous loads received, asynchronous loads failed).
        With one KV cache group a failed request is received, its bad blocks reported with this
        step's invalid blocks (vLLM recomputes from the first); hybrid models fail per request."""
        if self._worker is None:
            return set(), set(), set()
        received, failed, blocks = self._worker.received_requests()
        if not self._hybrid:
            received, failed = received | failed, set()
            self._failed_async_blocks |= blocks
        return self._worker.finished_requests(set(finished_req_ids)), received, failed

    @timed("_hooks")
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, received, failed = self._completions(finished_req_ids)
        # failures are told through get_transfer_results; a vLLM without it is refused for hybrid models at start
        assert not failed, "asynchronous load failures need get_transfer_results (refused at start otherwise)"
        return (done or None), received or None

    @timed("_hooks")
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.32+: stores done, asynchronous loads received, and those that failed (vLLM
        recomputes those requests)."""
        return compat.make_transfer_results(*self._completions(finished_req_ids))

    @timed("_hooks")
    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        out, self._failed_async_blocks = self._failed_async_blocks, set()
        return out | self._worker.take_failed_blocks()

    @timed("_hooks")
    def build_connector_worker_meta(self) -> Any:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return None if report.is_empty() else TuttiWorkerMetadata(report)

    @timed("_hooks")
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, TuttiConnectorMetadata):
            self._worker.preempt(kv_connector_metadata.plan.preempted)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
            claims.release(self._engine_id)  # its writer slot's lock is gone with its store
        if self._planner is not None and self._planner.foreign is not None:
            self._planner.foreign.close()  # stops following the other writers (and announcing them)
            self._planner.foreign = None
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None
        if self._planner is not None and self._planner.extras is not None:
            self._planner.extras.close()
            self._planner.extras = None

    # ================================================================== scheduler side
    @timed("_hooks")
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._planner is not None
        tokens = compat.prompt_tokens(request)
        # everything vLLM's block hash covers besides the token ids (LoRA, images, salt, embeds)
        identity = compat.request_identity(request, self._hash_block_size)
        n = self._planner.match(request.request_id, tokens, num_computed_tokens, identity,
                                max_load_tokens=compat.max_load_tokens(request))
        if self._cfg.store_decode:
            self._requests[request.request_id] = request  # its generated tokens, read each step
        if self._events is not None:
            self._events.add_request(request)
        # layer-wise inside the step, or asynchronously (vLLM holds the request until received):
        # every hit where vLLM schedules asynchronously, else those past the step's byte budget
        return n, bool(n and (self._async_loads or self._planner.wants_async(request.request_id)))

    @timed("_hooks")
    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        self._planner.on_alloc(request.request_id, self._blocks(blocks), num_external_tokens,
                               async_load=self._async_loads or self._planner.wants_async(request.request_id))

    @timed("_hooks")
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._planner is not None
        p = self._planner
        computed: dict[str, int] = {}
        for req_id in scheduler_output.preempted_req_ids or ():
            p.preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            p.update_request(new.req_id, tokens=new.prompt_token_ids or [],
                             all_block_ids=self._blocks(new.block_ids))
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                if req_id in resumed:
                    p.update_request(req_id, all_block_ids=self._blocks(blocks))
                else:
                    p.update_request(req_id, new_block_ids=self._blocks(blocks))
            computed[req_id] = cached.num_computed_tokens[i]
        if self._cfg.store_decode:
            for req_id in scheduler_output.num_scheduled_tokens:
                req = self._requests.get(req_id)
                if req is not None:
                    p.sync_tokens(req_id, req.all_token_ids)
        plan = p.build_step(scheduler_output.num_scheduled_tokens, computed)
        if self._events is not None and plan.stores:
            self._events.planned(plan.stores)
        return TuttiConnectorMetadata(plan)

    @timed("_hooks")
    def update_connector_output(self, connector_output: Any) -> None:
        if self._planner is None:
            return
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, TuttiWorkerMetadata):
            self._planner.on_report(meta.report)

    def _blocks(self, block_ids: Any) -> list:
        """vLLM's block ids for the planner: every group's for a hybrid model, else the one group's."""
        return compat.all_groups(block_ids) if self._hybrid else compat.block_ids_of(block_ids)

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA: vLLM calls this instead of request_finished once tutti declares hybrid support."""
        return self.request_finished(request, [])

    @timed("_hooks")
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._planner is not None
        self._requests.pop(request.request_id, None)
        if self._events is not None:
            self._events.drop_request(request.request_id)
        return self._planner.finished(request.request_id), None

    @timed("_hooks")
    def take_events(self) -> Iterable[Any]:
        """BlockStored/BlockRemoved (medium STORAGE) for chunks committed/evicted since the last
        step; also sent on tutti's own publisher when kv_events_endpoint is set."""
        if self._planner is None or self._events is None:
            return ()
        events = self._take_startup_events() + self._events.translate(self._planner.take_events())
        recorded, removed = self._events.take_recorded()
        extras = self._planner.extras
        if extras is not None and (recorded or removed):
            try:
                extras.append(recorded)
                extras.forget(removed)
            except OSError as exc:  # advisory: other servers then do not announce these chunks
                logger.warning("tutti: recording chunk extras failed: %s", exc)
        foreign = self._planner.foreign
        if foreign is not None and extras is not None and foreign.on_events is None:
            # no publisher of tutti's own: vLLM's publisher carries them, when this server steps
            events = events + self._events.translate_foreign(foreign.take_events(), own=self._planner.index.__contains__)
        if events and self._publisher is not None:
            self._publisher.publish(events)
        return events

    def _publish_foreign(self, found: list) -> None:
        """From the follow thread: other writers' chunks (and removals) on tutti's publisher,
        after the start-up announcements (held for a second: subscribers connect first)."""
        planner, publisher = self._planner, self._publisher
        if planner is None or publisher is None or self._events is None:
            return
        events = self._take_startup_events(wait_s=1.0)
        events += self._events.translate_foreign(found, own=planner.index.__contains__)
        if events:
            publisher.publish(events)

    def _take_startup_events(self, wait_s: float = 0.0) -> list:
        if not self._startup_events or time.monotonic() - self._startup_at < wait_s:
            return []
        with self._startup_lock:  # the scheduler's thread or the follow thread: taken once
            raw, self._startup_events = self._startup_events, []
        own = self._planner.index.__contains__
        return [e for foreign, found in raw
                for e in self._events.translate_foreign(found, own=own if foreign else (lambda key: False))]

    def get_kv_connector_stats(self) -> TuttiKVConnectorStats | None:
        """Worker: bytes/seconds moved and stores skipped since the last call. Scheduler (vLLM
        calls its instance every step too): lookups, hits, failed loads, commits, evictions
        and capacity. vLLM aggregates both into one payload (tutti.vllm.stats)."""
        due = self._host_costs_due()
        if self._worker is not None:
            w = self._worker.take_stats()  # the engine's counter names are the metrics' fields
            if due:
                w["worker_hook_seconds"], w["worker_thread_cpu_seconds"] = self._hooks.take(), self._threads.take()
                w["worker_thread_wait_seconds"] = WAITS.take()
            return stats_from(w)
        if self._planner is not None:
            return self._sched_stats.take(self._planner.stats, self._planner.capacity_used_bytes(),
                                          hook_seconds=self._hooks.take() if due else 0.0,
                                          thread_cpu_seconds=self._threads.take() if due else 0.0)
        return None

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

    # ------------------------------------------------------------------ helpers for tests and tools
    @property
    def planner(self):
        return self._planner

    @property
    def worker(self):
        return self._worker


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
