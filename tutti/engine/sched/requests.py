"""The planner's plain data: a request's chunks from lookup to commit, a store's ticket, the
counters, and how far the start-up probe's read rate is trusted under a step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tutti.engine.keys import Identity
from tutti.engine.plan import LoadChunk

# What the start-up probe's read rate (the disk alone, the GPU idle) is taken to be under a step:
# reads under a forward pass measured 0.66-0.84x of the probe on a virtio disk
# (bench/load_or_compute.py --trace prints both); a first hit priced with the probe alone loaded
# too much. Loads' own samples replace it.
PROBE_UNDER_STEP = 0.8


@dataclass
class PlannerStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    stores_planned: int = 0
    stores_committed: int = 0
    stores_failed: int = 0
    stores_declined: int = 0
    loads_failed: int = 0
    evictions: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    stores_skipped: int = 0
    unkeyed_requests: int = 0  # requests whose identity could not be keyed: neither stored nor served
    async_hit_tokens: int = 0  # of hit_tokens, loaded asynchronously (the request waited outside the batch)
    declined_hit_tokens: int = 0  # stored, and recomputed by the hit policy's choice (faster than loading)
    # of those, why (tutti.engine.sched.hits.HitPlanning._declined_by): the parts add up to the total
    declined_rate_tokens: int = 0  # the policy's rate model: recomputing was faster
    declined_queue_tokens: int = 0  # loads queued ahead made loading slower than recomputing
    declined_unmeasured_tokens: int = 0  # no read rate measured yet: one load measures it, the rest wait
    declined_budget_tokens: int = 0  # past the step's byte budget (layer-wise loads)
    declined_state_tokens: int = 0  # a hybrid hit must end on a chunk whose state is stored
    # asynchronous hits: seconds from allocation to vLLM learning their loads were received (the
    # wait outside the batch), summed, and how many (their mean: the wait a hit adds to its TTFT)
    async_wait_seconds: float = 0.0
    async_waits: int = 0

    def since(self, earlier: "PlannerStats") -> dict[str, float]:
        """Counters accumulated since `earlier` (a copy taken before), without resetting: the
        metrics path reads the same cumulative counters as per-step deltas."""
        return {k: v - getattr(earlier, k) for k, v in vars(self).items()}

    def copy(self) -> "PlannerStats":
        return PlannerStats(**vars(self))


@dataclass
class RequestState:
    req_id: str
    tokens: list[int]
    keys: list[bytes]
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # per KV cache group
    local_computed: int = 0  # tokens vLLM's own prefix cache had, at the last lookup
    async_since: float | None = None  # when an asynchronous hit's blocks were allocated (time.monotonic)
    hit_chunks: int = 0  # chunks found stored at the last lookup
    loads: list[LoadChunk] = field(default_factory=list)  # not yet sent to workers
    next_store_chunk: int = 0  # chunks below this were stored, skipped or loaded
    had_stores: bool = False
    finished: bool = False
    identity: Identity | None = None  # what besides token ids the KV depends on (extra keys)
    unkeyed: bool = False  # identity unknown: never stored, never served
    # (writer or None, slot, tier) per hit chunk: another writer's slot, or our own in one of our tiers
    hit_sources: list[tuple[str | None, int, int]] = field(default_factory=list)
    state_source: tuple[str | None, int, int] | None = None  # state groups: where the state at the hit's end is
    async_load: bool = False  # vLLM waits for the worker to report its loads received
    stored_state_upto: int = 0  # state groups: chunks whose end state was planned (or loaded)
    computed: int = 0  # prompt tokens computed or loaded (or to be loaded): the rest is prefill backlog
    in_backlog: int = 0  # its tokens in the planner's prefill backlog (taken out when it is looked up again)
    declined: int = 0  # hit tokens the policy chose to recompute at the last lookup
    declined_by: dict = field(default_factory=dict)  # why, in tokens (counted with `declined`)
    prompt_len: int = 0  # the prompt's tokens (tokens grows with generated ones under store_decode)
    load_async: bool = False  # the last lookup's hit goes asynchronously (past the step's sync budget)
    holed: bool = False  # a chunk's store failed or was skipped: no hit reaches its later chunks
    tail: bool = False  # the last lookup's hit reaches into the prompt's last chunk (all but its last block)
    staging: tuple[bytes, ...] = ()  # promote "stage": its hit's lower-tier chunks being copied up first
    staging_since: float = 0.0  # when they were asked for (time.monotonic)
    staged: bool = False  # staged once already: the hit now loads from wherever its chunks are
    # its prompt is in queried_tokens: counted at its first lookup, not again while it waits for
    # blocks (vLLM asks at every step) or for a staged copy; again after a preemption
    counted: bool = False


@dataclass
class StoreTicket:
    key: bytes
    req_id: str
    ok: int = 0  # workers that reported success
    state: bool = False  # a state entry (no vLLM block hashes to announce)
    copy: tuple[int, int] | None = None  # a copy between tiers: (from, to) (tutti.engine.sched.tiers)
    borrowed: bool = False  # the copy's source is another writer's chunk (a promotion of a shared hit)
