"""The scheduler's half of TuttiConnectorV1: vLLM's scheduler callbacks translated to the
planner (tutti.engine.sched.planner), which owns the chunk index and every decision, plus tutti's
KV events and the scheduler's metrics. Moves no bytes."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Iterable

from vllm.logger import init_logger

from tutti.engine.build import build_planner
from tutti.engine.hostcost import HookClock, ThreadCPU, scheduler_threads, timed
from tutti.engine.keys import UnkeyableError, chunk_keys
from tutti.engine.plan import StepPlan, WorkerReport
from tutti.vllm import compat, identity, layout, translate
from tutti.vllm.events import EventPublisher, KVEventTracker, expand_topic
from tutti.vllm.stats import SchedulerStatsTracker, TuttiKVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.tutti.connector")


class SchedulerHalf:
    def __init__(self, vllm_config: "VllmConfig", setup: translate.Setup) -> None:
        self.setup = s = setup
        cfg = s.cfg
        self._hooks = HookClock()  # host time of the scheduler's hooks, as a metric
        self._threads = ThreadCPU(scheduler_threads, interval_s=0.0)
        self._requests: dict[str, Any] = {}  # with store_decode: live Request objects
        self._publisher: EventPublisher | None = None
        self.planner = p = build_planner(
            cfg, s.geom, engine_id=s.engine_id, mac=s.mac, announce=translate.announces(vllm_config, cfg.kv_events_endpoint),
            asynchronous=s.async_loads, budgeted=s.budgeted, step_tokens=translate.step_tokens(vllm_config) or 8192,
            attention_weight=translate.attention_weight(vllm_config), gpu_blocks=s.gpu_blocks)
        self._stats = SchedulerStatsTracker(p.index.num_slots * p.slot_bytes)
        self._events = KVEventTracker(chunk_tokens=cfg.chunk_tokens, hash_block_size=s.hash_block_size, seed=p.seed)
        if cfg.kv_events_endpoint:
            self._publisher = EventPublisher(
                cfg.kv_events_endpoint, data_parallel_rank=translate.data_parallel_rank(vllm_config),
                topic=expand_topic(cfg.kv_events_topic, str(vllm_config.model_config.served_model_name), p.writer_id))
        foreign, extras = p.foreign, p.extras
        self._startup_events: list = []
        self._startup_at = time.monotonic()
        self._startup_lock = threading.Lock()
        if extras is not None:
            # what this server can load from its first step: its own chunks from an earlier run (as
            # recorded) and the other writers' (as found by the first refresh); translated when
            # sent, since vLLM sets its hash seed after this connector is built
            self._events.lookup = extras.lookup
            self._startup_events = [(False, [("stored", k, x) for k, x in extras.items()])]
            if foreign is not None:
                self._startup_events.append((True, foreign.take_events()))
        if foreign is not None and self._publisher is not None and extras is not None:
            foreign.on_events = self._publish_foreign  # as found, whether this server steps or not
        logger.debug(
            "tutti: scheduler ready: roots=%s capacity=%d B (%d chunks of %d tokens), %d chunks resident, writer %r, "
            "%d chunks of %d other writers, events=%s", list(cfg.roots), cfg.capacity_bytes, p.index.num_slots,
            cfg.chunk_tokens, len(p.index), cfg.writer_id, len(foreign) if foreign else 0,
            len(foreign.writers) if foreign else 0, cfg.kv_events_endpoint or "vLLM only")
        self._say_other_namespaces()
        if p.stage:
            if p.gpu_blocks and p.stage_pressure > 0:
                logger.info("tutti: promote 'stage': a hit from a lower tier is copied up before it loads while the "
                            "requests in flight hold more than %d%% of vLLM's %d GPU blocks (stage_pressure)",
                            round(100 * p.stage_pressure), p.gpu_blocks)
            else:
                logger.info("tutti: promote 'stage': every hit from a lower tier is copied up before it loads (%s)",
                            "stage_pressure 0" if p.gpu_blocks else "vLLM gave no GPU block count")
        inflight = compat.max_inflight_kv_loads(vllm_config)
        if inflight is not None:
            logger.info("tutti: hits that load asynchronously start while the batch is full "
                        "(--max-num-inflight-kv-loads=%d; hits load %s)", inflight, s.load_mode)

    def _say_other_namespaces(self, limit: int = 3) -> None:
        """Name what keeps this server from the chunks of other namespaces in its first root (an
        upgrade that changed the dtype, the block size, the chunk size, the weights, tutti's format
        or key version...): they are never loaded here, and "zero hits after an upgrade" should say
        why. Other ranks' namespaces of this layout are siblings, not differences. Advisory."""
        from tutti.engine.build import with_codec, with_integrity
        from tutti.store.namespace import list_namespaces

        s = self.setup
        try:
            geom = with_codec(with_integrity(s.geom, s.mac), s.cfg)
            tp, pp, _ = geom.store_ranks[0]
            ours = geom.for_rank(tp, pp).fingerprint()
            found = list_namespaces(s.cfg.roots[0])
        except Exception as exc:  # noqa: BLE001 - advisory only
            logger.debug("tutti: other namespaces not listed: %s", exc)
            return
        mine = ours.to_dict()
        mine["extra"] = dict(mine.get("extra") or ())
        diffs = []
        for ns in found:
            there = dict((ns.manifest or {}).get("fingerprint") or {})
            if ns.digest == ours.digest() or not there:
                continue
            there["extra"] = dict(there.get("extra") or ())
            if (there.get("tp_rank"), there.get("pp_rank")) != (mine["tp_rank"], mine["pp_rank"]) and all(
                    there.get(k) == mine[k] for k in mine if k not in ("tp_rank", "pp_rank")):
                continue  # the same layout's other ranks
            parts = [f"{k} {mine.get(k)!r} here, {there.get(k)!r} there" for k in sorted(set(mine) | set(there))
                     if k not in ("extra", "tp_rank", "pp_rank") and mine.get(k) != there.get(k)]
            for k in sorted(set(mine["extra"]) | set(there["extra"])):
                if mine["extra"].get(k) != there["extra"].get(k):
                    parts.append(f"{k} {mine['extra'].get(k)!r} here, {there['extra'].get(k)!r} there")
            diffs.append(f"tutti-{ns.digest} ({'; '.join(parts) or 'rank'})")
        if diffs:
            logger.info("tutti: %s also holds %d namespace(s) this server cannot load (chunks stored under another "
                        "model, dtype, layout or tutti format; never mixed, see README 'Upgrades'): %s%s",
                        s.cfg.roots[0], len(diffs), ", ".join(diffs[:limit]),
                        f" and {len(diffs) - limit} more" if len(diffs) > limit else "")

    @timed("_hooks")
    def may_load_async(self, request: "Request") -> bool:
        """vLLM 0.34+, with --max-num-inflight-kv-loads: whether this request's hit may load
        asynchronously, so that vLLM starts its load while the running batch is full (the request
        waits in vLLM's async_kv_waiting queue instead of for a batch slot).

        vLLM asks when the request enters a waiting queue, before its lookup, so the answer reads
        the store's index without pricing, touching or counting anything: True where the request's
        last lookup chose an asynchronous load (the hit policy's choice, `wants_async`), else where
        every hit loads asynchronously (`async_loads`) and the store holds the prompt's first
        chunk, else where hits past the step's byte budget load asynchronously (`budgeted`) and the
        prompt's stored prefix is larger than that budget. False for everything else (layer-wise
        hits load inside a step, in a batch slot). A wrong True costs little: the lookup at the head
        of vLLM's queue decides, and a hit that then loads synchronously waits for a slot as before
        (holding back the other asynchronous loads until one frees)."""
        p = self.planner
        if p.wants_async(request.request_id):
            return True
        if not (self.setup.async_loads or self.setup.budgeted):
            return False
        tokens = identity.prompt_tokens(request)
        usable = (len(tokens) - 1) // p.chunk_tokens  # a hit leaves at least one token to compute
        if self.setup.async_loads:
            need = 1
        else:
            budget = p.sync_budget_bytes()
            if budget is None:  # no budget measured yet: hits load layer-wise
                return False
            need = int(budget // max(p.slot_bytes, 1)) + 1  # the first chunk past the budget
        if usable < need:
            return False
        try:
            keys = chunk_keys(tokens[:need * p.chunk_tokens], p.chunk_tokens, p.seed,
                              identity=identity.request_identity(request, self.setup.hash_block_size))
        except UnkeyableError:
            return False
        return all(self._held(k) for k in keys)

    def _held(self, key: bytes) -> bool:
        """A chunk some tier of this store or another writer's holds (not touched: a peek)."""
        p = self.planner
        return p.held_anywhere(key) or (p.foreign is not None and p.foreign.get(key) is not None)

    def _async(self, req_id: str) -> bool:
        """Whether a hit loads asynchronously: every hit where vLLM schedules asynchronously, else
        those past the step's byte budget."""
        return self.setup.async_loads or self.planner.wants_async(req_id)

    def _blocks(self, block_ids: Any) -> list:
        """vLLM's block ids for the planner: every group's for a hybrid model, else the one group's."""
        return layout.all_groups(block_ids) if self.setup.hybrid else layout.block_ids_of(block_ids)

    @timed("_hooks")
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = identity.prompt_tokens(request)
        # everything vLLM's block hash covers besides the token ids (LoRA, images, salt, embeds)
        ident = identity.request_identity(request, self.setup.hash_block_size)
        n = self.planner.match(request.request_id, tokens, num_computed_tokens, ident,
                               max_load_tokens=translate.max_load_tokens(request))
        if self.setup.cfg.store_decode:
            self._requests[request.request_id] = request  # its generated tokens, read each step
        self._events.add_request(request)
        return n, bool(n and self._async(request.request_id))

    @timed("_hooks")
    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        self.planner.on_alloc(request.request_id, self._blocks(blocks), num_external_tokens,
                              async_load=self._async(request.request_id))

    @timed("_hooks")
    def build_step(self, scheduler_output: "SchedulerOutput") -> StepPlan:
        p = self.planner
        computed: dict[str, int] = {}
        for req_id in scheduler_output.preempted_req_ids or ():
            p.preempted(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            p.update_request(new.req_id, tokens=new.prompt_token_ids or [], all_block_ids=self._blocks(new.block_ids))
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = compat.resumed_requests(cached)
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                if req_id in resumed:
                    p.update_request(req_id, all_block_ids=self._blocks(blocks))
                else:
                    p.update_request(req_id, new_block_ids=self._blocks(blocks))
            computed[req_id] = cached.num_computed_tokens[i]
        if self.setup.cfg.store_decode:
            for req_id in scheduler_output.num_scheduled_tokens:
                req = self._requests.get(req_id)
                if req is not None:
                    p.sync_tokens(req_id, req.all_token_ids)
        plan = p.build_step(scheduler_output.num_scheduled_tokens, computed)
        if plan.stores:
            self._events.planned(plan.stores)
        return plan

    @timed("_hooks")
    def on_report(self, report: WorkerReport) -> None:
        self.planner.on_report(report)

    @timed("_hooks")
    def received(self, req_ids: Iterable[str]) -> None:
        """vLLM's finished_recving: asynchronous hits it may now schedule (their wait is counted)."""
        self.planner.received(req_ids)

    @timed("_hooks")
    def request_finished(self, request: "Request") -> bool:
        self._requests.pop(request.request_id, None)
        self._events.drop_request(request.request_id)
        return self.planner.finished(request.request_id)

    # ------------------------------------------------------------------ events
    @timed("_hooks")
    def take_events(self) -> Iterable[Any]:
        """BlockStored/BlockRemoved (medium STORAGE) for chunks committed/evicted since the last
        step; also sent on tutti's own publisher when kv_events_endpoint is set."""
        p = self.planner
        events = self._take_startup_events() + self._events.translate(p.take_events())
        recorded, removed = self._events.take_recorded()
        if p.extras is not None and (recorded or removed):
            try:
                p.extras.append(recorded)
                p.extras.forget(removed)
            except OSError as exc:  # advisory: other servers then do not announce these chunks
                logger.warning("tutti: recording chunk extras failed: %s", exc)
        if p.foreign is not None and p.extras is not None and p.foreign.on_events is None:
            # no publisher of tutti's own: vLLM's publisher carries them, when this server steps
            events = events + self._events.translate_foreign(p.foreign.take_events(), own=p.index.__contains__)
        if events and self._publisher is not None:
            self._publisher.publish(events)
        return events

    def _publish_foreign(self, found: list) -> None:
        """From the follow thread: other writers' chunks (and removals) on tutti's publisher,
        after the start-up announcements (held for a second: subscribers connect first)."""
        publisher = self._publisher
        if publisher is None:
            return
        events = self._take_startup_events(wait_s=1.0)
        events += self._events.translate_foreign(found, own=self.planner.index.__contains__)
        if events:
            publisher.publish(events)

    def _take_startup_events(self, wait_s: float = 0.0) -> list:
        if not self._startup_events or time.monotonic() - self._startup_at < wait_s:
            return []
        with self._startup_lock:  # the scheduler's thread or the follow thread: taken once
            raw, self._startup_events = self._startup_events, []
        own = self.planner.index.__contains__
        return [e for foreign, found in raw
                for e in self._events.translate_foreign(found, own=own if foreign else (lambda key: False))]

    def stats(self, host_costs: bool) -> TuttiKVConnectorStats:
        """Lookups, hits, failed loads, commits, evictions and capacity since the last call."""
        return self._stats.take(self.planner.stats, self.planner.capacity_used_bytes(),
                                hook_seconds=self._hooks.take() if host_costs else 0.0,
                                thread_cpu_seconds=self._threads.take() if host_costs else 0.0,
                                tiers=self.planner.tier_stats if self.planner.lower else None)

    def shutdown(self) -> None:
        p = self.planner
        p.save_hints()  # the rates measured in this run, for the next start's first lookups
        if p.foreign is not None:
            p.foreign.close()  # stops following the other writers (and announcing them)
            p.foreign = None
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None
        if p.extras is not None:
            p.extras.close()
            p.extras = None
