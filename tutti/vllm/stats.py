"""tutti's counters as vLLM connector stats and Prometheus metrics.

Two halves report: each worker (bytes and seconds moved, stores skipped) from its
`get_kv_connector_stats()`, and the scheduler (lookups, hits, failed loads, evictions,
capacity) from its own instance's `get_kv_connector_stats()`, which vLLM calls every step and
aggregates with the workers' stats (docs/vllm_api.md §6). The payload is a flat
`{field: number}` dict so it survives vLLM's msgpack hop from the engine core to the API
server, where `TuttiPromMetrics.observe` turns it into Prometheus samples.

Names follow vLLM's `vllm:kv_offload_*` family: a `vllm:` prefix, base units (bytes,
seconds, tokens), counters registered without `_total` (prometheus_client appends it on
/metrics: `vllm:tutti_load_bytes` is exposed as `vllm:tutti_load_bytes_total`), and the
`model_name` and `engine` labels vLLM gives every connector metric.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTER = "counter"
GAUGE = "gauge"
MAX_TIERS = 8  # the most the `tiers` key takes


@dataclass(frozen=True)
class MetricDef:
    field: str  # key in the stats payload
    name: str  # Prometheus name as registered (counters get `_total` on /metrics)
    kind: str  # COUNTER (summed across workers and steps) or GAUGE (latest value wins)
    doc: str
    reason: str = ""  # several fields of one metric: each its `reason` label's value
    tier: str = ""  # or its `tier` label's value (0: the first, fastest tier)

    @property
    def exposed_name(self) -> str:
        return self.name + "_total" if self.kind == COUNTER else self.name


METRICS: tuple[MetricDef, ...] = (
    # worker side (summed over workers: with TP each rank moves its own share of the heads)
    MetricDef("bytes_loaded", "vllm:tutti_load_bytes", COUNTER,
              "Bytes loaded from tutti's store into the KV cache (all workers)."),
    MetricDef("load_seconds", "vllm:tutti_load_seconds", COUNTER,
              "Seconds from the first read of a step's loads to its last layer landing (a job launched from "
              "vLLM's thread: the device's time for it), summed over workers."),
    MetricDef("bytes_stored", "vllm:tutti_store_bytes", COUNTER,
              "Bytes written to tutti's store from the KV cache (all workers)."),
    MetricDef("store_seconds", "vllm:tutti_store_seconds", COUNTER,
              "Seconds from a store's first gather to its chunks being durable, summed over workers."),
    MetricDef("stores_skipped", "vllm:tutti_skipped_stores", COUNTER,
              "Chunk stores skipped because the staging ring was full or a layer was missed (future misses)."),
    MetricDef("worker_hook_seconds", "vllm:tutti_worker_hook_seconds", COUNTER,
              "Seconds tutti's worker hooks took on the thread that launches the forward pass (waits for "
              "layer-wise loads included), summed over workers."),
    MetricDef("worker_thread_cpu_seconds", "vllm:tutti_worker_thread_cpu_seconds", COUNTER,
              "CPU seconds used by tutti's own threads in the workers (writer, asynchronous loads, IO)."),
    MetricDef("worker_thread_wait_seconds", "vllm:tutti_worker_thread_wait_seconds", COUNTER,
              "Of those threads' time, seconds in waits that release the GIL (CUDA event and stream "
              "synchronisation, which spin): their CPU beyond it held the GIL or made system calls."),
    # scheduler side
    MetricDef("queried_tokens", "vllm:tutti_queried_tokens", COUNTER,
              "Prompt tokens looked up in tutti's index."),
    MetricDef("hit_tokens", "vllm:tutti_hit_tokens", COUNTER,
              "Tokens loaded from tutti's store beyond vLLM's own prefix cache (instead of computed)."),
    MetricDef("async_hit_tokens", "vllm:tutti_async_hit_tokens", COUNTER,
              "Of the hit tokens, those loaded asynchronously (the request waited outside the batch)."),
    MetricDef("async_wait_seconds", "vllm:tutti_async_wait_seconds", COUNTER,
              "Seconds asynchronous hits waited outside the batch, from their blocks' allocation to vLLM "
              "learning their loads were received, summed over hits (with tutti_async_waits: the mean wait)."),
    MetricDef("async_waits", "vllm:tutti_async_waits", COUNTER,
              "Asynchronous hits whose wait is counted in tutti_async_wait_seconds."),
    MetricDef("declined_hit_tokens", "vllm:tutti_declined_hit_tokens", COUNTER,
              "Tokens found in tutti's store and recomputed by the hit policy's choice (recomputing was faster)."),
    *(MetricDef(f"declined_{why}_tokens", "vllm:tutti_declined_hit_tokens_by_reason", COUNTER,
                "Declined hit tokens by why: rate (recomputing was faster), queue (loads queued ahead made "
                "loading slower), unmeasured (no read rate yet), budget (past a step's byte budget), state (a "
                "hybrid hit must end where a state is stored).", reason=why)
      for why in ("rate", "queue", "unmeasured", "budget", "state")),
    MetricDef("loads_failed", "vllm:tutti_failed_loads", COUNTER,
              "Chunks whose load failed (IO error or checksum mismatch); vLLM recomputed them."),
    MetricDef("stores_committed", "vllm:tutti_stored_chunks", COUNTER,
              "Chunks committed to tutti's store (durable on every worker)."),
    MetricDef("evictions", "vllm:tutti_evictions", COUNTER,
              "Chunks evicted from tutti's store to make room for new ones."),
    # per tier (the `tiers` key; tier 0 alone without it): fields tier<i>_<what>
    *(MetricDef(f"tier{i}_{what}", f"vllm:tutti_tier_{what}", COUNTER, doc, tier=str(i))
      for what, doc in (("hit_tokens", "Hit tokens loaded from each of this server's tiers (0: the first, fastest; "
                                       "other servers' chunks count in the tier they are shared in)."),
                        ("hit_bytes", "Bytes hits loaded from each tier."),
                        ("evictions", "Chunks each tier gave up to make room (still served from a tier below, if "
                                      "one holds it)."),
                        ("writedowns", "Chunks copied into each tier from the one above (write-through)."))
      for i in range(MAX_TIERS)),
    MetricDef("tier_promotions", "vllm:tutti_tier_promotions", COUNTER,
              "Chunks a hit loaded from a lower tier and copied back up into the first."),
    MetricDef("tier_borrowed", "vllm:tutti_tier_borrowed", COUNTER,
              "Of the promotions, chunks another server wrote (read from its files in the shared tier)."),
    MetricDef("tier_dropped", "vllm:tutti_tier_dropped", COUNTER,
              "Write-downs that failed or found no room below: the chunk left the tier above unwritten."),
    MetricDef("tier_staged_hits", "vllm:tutti_tier_staged_hits", COUNTER,
              "Hits whose chunks in a lower tier were copied up into the first before they loaded, the "
              "request waiting without GPU blocks (promote \"stage\")."),
    MetricDef("scheduler_hook_seconds", "vllm:tutti_scheduler_hook_seconds", COUNTER,
              "Seconds tutti's scheduler-side hooks took on the scheduler's thread (lookups, step plans, reports)."),
    MetricDef("scheduler_thread_cpu_seconds", "vllm:tutti_scheduler_thread_cpu_seconds", COUNTER,
              "CPU seconds used by tutti's journal follower beside the scheduler (replicas sharing a root)."),
    MetricDef("capacity_used_bytes", "vllm:tutti_capacity_used_bytes", GAUGE,
              "Bytes of tutti's store holding chunks (resident and being written), per worker rank."),
    MetricDef("capacity_bytes", "vllm:tutti_capacity_bytes", GAUGE,
              "Usable bytes of tutti's store (whole chunks within capacity_bytes), per worker rank."),
)

BY_FIELD: dict[str, MetricDef] = {m.field: m for m in METRICS}
WORKER_FIELDS = ("bytes_loaded", "load_seconds", "bytes_stored", "store_seconds", "stores_skipped",
                 "worker_hook_seconds", "worker_thread_cpu_seconds", "worker_thread_wait_seconds")
TIER_LISTS = ("hit_tokens", "hit_bytes", "evictions", "writedowns")  # TierStats' per-tier lists
SCHEDULER_FIELDS = ("queried_tokens", "hit_tokens", "async_hit_tokens", "async_wait_seconds", "async_waits",
                    "declined_hit_tokens", "loads_failed",
                    "stores_committed", "evictions",
                    *(m.field for m in METRICS if m.field.startswith("declined_") and m.reason))


@dataclass
class TuttiKVConnectorStats(KVConnectorStats):
    """One interval's counters: `data` maps a METRICS field to a number.

    Counters add up (across workers, across steps, across the logging interval); gauges keep
    the most recent value. Unknown keys are refused so a renamed field fails loudly.
    """

    def __post_init__(self) -> None:
        self.data = dict(self.data or {})
        for k, v in self.data.items():
            if k not in BY_FIELD:
                raise ValueError(f"tutti stats: unknown field {k!r}; known fields are {sorted(BY_FIELD)}")
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"tutti stats: {k}={v!r}: expected a number")

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TuttiKVConnectorStats":
        if other is None or other.is_empty():
            return self
        if not isinstance(other, TuttiKVConnectorStats):
            raise TypeError(f"cannot aggregate TuttiKVConnectorStats with {type(other).__name__}")
        for k, v in other.data.items():
            if BY_FIELD[k].kind == COUNTER:
                self.data[k] = self.data.get(k, 0) + v
            else:
                self.data[k] = v
        return self

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: the counters plus derived rates."""
        d = self.data
        out: dict[str, int | float] = {k: d[k] for k in BY_FIELD if k in d}
        if d.get("queried_tokens"):
            out["hit_rate"] = round(d.get("hit_tokens", 0) / d["queried_tokens"], 4)
        for kind, moved in (("load", "bytes_loaded"), ("store", "bytes_stored")):
            secs = d.get(f"{kind}_seconds", 0)
            if secs > 0:
                out[f"{kind}_GBps"] = round(d.get(moved, 0) / secs / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if BY_FIELD[k].kind == COUNTER) and not any(
            BY_FIELD[k].kind == GAUGE for k in self.data)


def stats_from(values: Mapping[str, Any]) -> TuttiKVConnectorStats | None:
    """Stats holding the non-zero counters and every gauge of `values`; None when nothing to say
    (most decode steps: vLLM asks every step, so a quiet one builds nothing)."""
    data = {k: v for k, v in values.items() if v or BY_FIELD[k].kind == GAUGE}
    return TuttiKVConnectorStats(data=data) if data else None


class SchedulerStatsTracker:
    """Turns the planner's cumulative PlannerStats into per-step deltas.

    Deltas, not snapshot-and-reset: the planner's cumulative counters stay readable by tests
    and tools. Capacity gauges are sent when they change (and once at the start), so quiet
    steps send nothing.
    """

    # the planner's counters, under the same names as their metrics' fields (METRICS)

    _read = staticmethod(operator.attrgetter(*SCHEDULER_FIELDS))

    def __init__(self, capacity_bytes: int) -> None:
        self._last: tuple = (0,) * len(SCHEDULER_FIELDS)
        self._capacity = capacity_bytes
        self._last_used: int | None = None

    def take(self, planner_stats: Any, used_bytes: int, *, hook_seconds: float = 0.0,
             thread_cpu_seconds: float = 0.0, tiers: Any = None) -> TuttiKVConnectorStats | None:
        """`tiers`: the planner's TierStats (tutti.engine.sched.tiers)."""
        now = self._read(planner_stats)  # one C call for every field
        if tiers is not None:
            now = now + tuple(v for what in TIER_LISTS for v in getattr(tiers, what)) + (
                tiers.promotions, tiers.borrowed, tiers.dropped, tiers.staged_hits)
            fields = SCHEDULER_FIELDS + tuple(f"tier{i}_{what}" for what in TIER_LISTS
                                              for i in range(len(getattr(tiers, what)))) + (
                "tier_promotions", "tier_borrowed", "tier_dropped", "tier_staged_hits")
        else:
            fields = SCHEDULER_FIELDS
        if len(self._last) != len(now):
            self._last = (0,) * len(now)
        if now == self._last and used_bytes == self._last_used and not hook_seconds and not thread_cpu_seconds:
            return None  # a quiet step: nothing to send
        values: dict[str, Any] = {"scheduler_hook_seconds": hook_seconds,
                                  "scheduler_thread_cpu_seconds": thread_cpu_seconds}
        for field, new, old in zip(fields, now, self._last):
            values[field] = new - old
        self._last = now
        if used_bytes != self._last_used:
            values["capacity_used_bytes"] = used_bytes
            if self._last_used is None:
                values["capacity_bytes"] = self._capacity
            self._last_used = used_bytes
        return stats_from(values)


class TuttiPromMetrics(KVConnectorPromMetrics):
    """Registers METRICS once per server and feeds them from each step's stats payload."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[tuple[str, int], Any] = {}
        made: dict[str, Any] = {}  # one Prometheus metric per name; fields with a reason share it
        for m in METRICS:
            names = list(labelnames) + (["reason"] if m.reason else []) + (["tier"] if m.tier else [])
            metric = made.get(m.name)
            if metric is None and m.kind == COUNTER:
                metric = made[m.name] = self._counter_cls(name=m.name, documentation=m.doc, labelnames=names)
            elif metric is None:
                metric = made[m.name] = self._gauge_cls(name=m.name, documentation=m.doc, labelnames=names,
                                                        multiprocess_mode="mostrecent")
            for idx, values in per_engine_labelvalues.items():
                self._bound[(m.field, idx)] = metric.labels(*values, *([m.reason] if m.reason else []),
                                                            *([m.tier] if m.tier else []))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in (transfer_stats_data or {}).items():
            m = BY_FIELD.get(k)
            metric = self._bound.get((k, engine_idx)) if m else None
            if metric is None:
                continue
            if m.kind == COUNTER:
                if v > 0:
                    metric.inc(v)
            else:
                metric.set(v)
