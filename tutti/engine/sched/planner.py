"""The planner: the scheduler-side half of the engine.

It tracks each request's chunks, answers prefix lookups, decides what each step loads and
stores (reserving slots in the index) and turns worker reports into commits, aborts and
drops. It knows nothing of vLLM: the connector feeds it plain ids, tokens and block lists.

One idea (a request's chunks from lookup to commit): the decisions it asks for live behind
seams of their own (tutti.engine.sched.hit_policy, admission, eviction; the slots in tutti.engine.sched.index).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from tutti.engine.sched.admission import AdmissionPolicy, AdmitAll, StoreCandidate
from tutti.engine.sched.hit_policy import (Always, HitPolicy, HitQuery, RateMeter, Rates, chunk_floor, prefill_work,
                                     token_work)
from tutti.engine.sched.index import ChunkIndex
from tutti.engine.keys import Identity, UnkeyableError, chunk_keys, state_key
from tutti.engine.plan import NULL_BLOCK, LoadChunk, StepPlan, StoreChunk, WorkerReport

log = logging.getLogger("tutti.engine")

# What the start-up probe's read rate (the disk alone, the GPU idle) is taken to be under a step:
# reads under a forward pass were slower on the H200's virtio disk in every run that measured
# both (load_or_compute.md: probe 2.35 / 1.84 / 2.55 GB/s, under a step 1.56 / 1.5 / 2.14, i.e.
# 0.66-0.84x); the first hit after start chose from the probe alone and loaded too much (run 7:
# 0.84x of recompute, the next hit with a measured rate 0.73x). Loads' own samples replace it.
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

    def since(self, earlier: "PlannerStats") -> dict[str, float]:
        """Counters accumulated since `earlier` (a copy taken before), without resetting: the
        metrics path reads the same cumulative counters as per-step deltas."""
        return {k: v - getattr(earlier, k) for k, v in vars(self).items()}

    def copy(self) -> "PlannerStats":
        return PlannerStats(**vars(self))


@dataclass
class _Request:
    req_id: str
    tokens: list[int]
    keys: list[bytes]
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # per KV cache group
    local_computed: int = 0  # tokens vLLM's own prefix cache had, at the last lookup
    hit_chunks: int = 0  # chunks found stored at the last lookup
    loads: list[LoadChunk] = field(default_factory=list)  # not yet sent to workers
    next_store_chunk: int = 0  # chunks below this were stored, skipped or loaded
    had_stores: bool = False
    finished: bool = False
    identity: Identity | None = None  # what besides token ids the KV depends on (extra keys)
    unkeyed: bool = False  # identity unknown: never stored, never served
    hit_sources: list[tuple[str | None, int]] = field(default_factory=list)  # (writer or None, slot) per hit chunk
    state_source: tuple[str | None, int] | None = None  # state groups: where the state at the hit's end is
    async_load: bool = False  # vLLM waits for the worker to report its loads received
    stored_state_upto: int = 0  # state groups: chunks whose end state was planned (or loaded)
    computed: int = 0  # prompt tokens computed or loaded (or to be loaded): the rest is prefill backlog
    in_backlog: int = 0  # its tokens in the planner's prefill backlog (taken out when it is looked up again)
    declined: int = 0  # hit tokens the policy chose to recompute at the last lookup
    prompt_len: int = 0  # the prompt's tokens (tokens grows with generated ones under store_decode)
    load_async: bool = False  # the last lookup's hit goes asynchronously (past the step's sync budget)
    holed: bool = False  # a chunk's store failed or was skipped: no hit reaches its later chunks
    tail: bool = False  # the last lookup's hit reaches into the prompt's last chunk (all but its last block)


@dataclass
class _Ticket:
    key: bytes
    req_id: str
    ok: int = 0  # workers that reported success
    state: bool = False  # a state entry (no vLLM block hashes to announce)


class Planner:
    def __init__(self, *, num_slots: int, chunk_tokens: int, block_size: int, seed: bytes,
                 num_workers: int = 1, slot_bytes: int = 0, store_decode: bool = False,
                 num_writers: int | None = None, foreign=None, num_groups: int = 1,
                 state_groups: Sequence[int] = (), hit_policy: HitPolicy | None = None,
                 step_tokens: int = 8192, asynchronous: bool = False, eviction=None,
                 admission: AdmissionPolicy | None = None) -> None:
        if chunk_tokens % block_size:
            raise ValueError(
                f"chunk_tokens={chunk_tokens}: must be a multiple of the KV cache's block_size={block_size}; "
                f"try {max(1, round(chunk_tokens / block_size)) * block_size}"
            )
        self.index = ChunkIndex(num_slots, eviction)  # eviction: tutti.engine.sched.eviction (LRU when None)
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.seed = seed
        self.num_workers = num_workers  # every worker reports each step's loads done
        # Workers that store each chunk: all ranks hold a shard, so a chunk is resident once all
        # of them committed it (fewer under MLA, where TP rank 0 alone stores the shared latent).
        self.num_writers = num_workers if num_writers is None else num_writers
        if not 1 <= self.num_writers <= num_workers:
            raise ValueError(f"num_writers={num_writers}: expected 1 <= num_writers <= num_workers={num_workers}")
        self.slot_bytes = slot_bytes
        self.store_decode = store_decode
        # vLLM's KV cache groups (hybrid models: full and sliding-window attention): each request
        # has one block list per group, and a chunk's blocks are every group's, group by group.
        self.num_groups = num_groups
        # State-space groups (Mamba / linear attention, vLLM's "align" mode: the state after each
        # block boundary lives in that block's column). Their state is valid only where it was
        # taken, so a chunk entry carries the attention groups' KV and a separate state entry
        # (tutti.engine.keys.state_key) the state groups' state at the chunk's end; a hit must end
        # on a chunk whose state is stored.
        self.state_groups = frozenset(state_groups)
        if any(not 0 <= g < num_groups for g in self.state_groups):
            raise ValueError(f"state_groups={sorted(self.state_groups)}: expected group indices below {num_groups}")
        self.stats = PlannerStats()
        self._reqs: dict[str, _Request] = {}
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)
        self._steps = itertools.count(1)
        self._step_pins: dict[int, list[bytes]] = {}
        self._step_done_count: dict[int, int] = {}
        self._events: list[tuple[str, list[bytes]]] = []  # ("stored"|"removed", keys)
        self._preempted: list[str] = []
        self._bad: set[bytes] = set()  # keys that failed to load, dropped once unpinned
        # The other writers of a shared namespace (tutti.engine.sharing.ForeignIndex), or None.
        self.foreign = foreign
        self.writer_id = ""  # the writer slot this server took (set by build_planner)
        self.extras = None  # tutti.store.extras.ExtrasWriter where chunks are announced (build_planner)
        self._foreign_loads: dict[bytes, tuple[str, int]] = {}  # in flight: key -> (writer, slot)
        self._step_foreign: dict[int, list[bytes]] = {}
        # Load or compute (tutti.engine.sched.hit_policy): the policy, the rates it is given, and the
        # queues it weighs (bytes of loads planned and not done, prompt tokens not computed).
        self.hit_policy: HitPolicy = hit_policy if hit_policy is not None else Always()
        self.meter = RateMeter()
        self.step_tokens = step_tokens
        # a token's compute per earlier token it attends to, relative to its other compute
        # (tutti.engine.sched.hit_policy.HitQuery.attention_weight; the connector sets it from the model)
        self.attention_weight = 0.0
        self.asynchronous = asynchronous  # the connector's load mode: outside the batch, or in the step
        self.admission = admission if admission is not None else AdmitAll()  # tutti.engine.sched.admission
        # Layer-wise mode only: the bytes one step may load in the step ("auto": what the read rate
        # moves while the GPU computes a full step; None: no budget), and whether a hit past it
        # can load asynchronously instead (the connector says; the worker then has async slots).
        self.sync_budget: int | str | None = None
        self.can_load_async = False
        self._step_sync_bytes = 0  # loaded in the step being scheduled
        self._unsent_load_bytes = 0
        self._step_load_bytes: dict[int, int] = {}
        self._backlog = 0  # prompt tokens not computed, as of the last step (plus lookups since)
        self._batch_ids: frozenset[str] = frozenset()  # requests of the last step: a prompt computed now
        # lengthens their steps (while they run: a finished one waits for nothing)

    # -- lookups --------------------------------------------------------------------------
    def _request(self, req_id: str, tokens: Sequence[int], identity: Identity | None = None) -> _Request:
        r = self._reqs.get(req_id)
        if r is None:
            r = _Request(req_id, list(tokens), [], [[] for _ in range(self.num_groups)], identity=identity,
                         prompt_len=len(tokens))
            try:
                r.keys = chunk_keys(tokens, self.chunk_tokens, self.seed, identity=identity)
            except UnkeyableError as exc:
                log.warning("tutti: request %s is neither stored nor served: %s", req_id, exc)
                r.unkeyed = True
                self.stats.unkeyed_requests += 1
            self._reqs[req_id] = r
        return r

    def match(self, req_id: str, tokens: Sequence[int], num_computed_tokens: int,
              identity: Identity | None = None, max_load_tokens: int | None = None) -> int:
        """Tokens beyond `num_computed_tokens` to load: whole chunks the store holds, as many as
        the hit policy chooses (at most `max_load_tokens`, the request's own cap), and always at
        least one prompt token left for vLLM to compute. `identity(start, end)` gives the bytes
        of what else tokens [start, end) depend on (see tutti.engine.keys).

        A prompt ending exactly on a stored chunk's end (an exact repeat) may load that chunk too,
        all but its last block (`_tail`): vLLM then computes block_size tokens instead of a chunk."""
        r = self._request(req_id, tokens, identity)
        self._backlog -= r.in_backlog  # looked up again (it waited for room): not queued ahead of itself
        r.in_backlog = 0
        r.tail = False
        usable = (len(tokens) - 1) // self.chunk_tokens
        r.hit_sources = self._locate(r.keys[:usable])
        if self.state_groups:  # the hit ends on the last chunk whose state is stored too
            r.state_source = None
            while r.hit_sources:
                where = self._locate([state_key(r.keys[len(r.hit_sources) - 1])])
                if where:
                    r.state_source = where[0]
                    break
                r.hit_sources.pop()
        hits = len(r.hit_sources)
        r.local_computed = num_computed_tokens
        r.hit_chunks = hits
        self.stats.queried_tokens += len(tokens)
        hit_tokens = hits * self.chunk_tokens
        r.computed = num_computed_tokens
        r.declined = 0
        if hit_tokens <= num_computed_tokens:
            r.hit_chunks = 0
            r.in_backlog = len(tokens) - num_computed_tokens
            self._backlog += r.in_backlog
            return 0
        found = hit_tokens - num_computed_tokens
        r.load_async = self.asynchronous
        batch = sum(1 for other in self._batch_ids if other != req_id and other in self._reqs)
        take = self._choose(found, len(tokens) - num_computed_tokens, max_load_tokens, context=num_computed_tokens,
                            batch=batch)
        if take > 0 and not self.asynchronous and self.can_load_async:
            # the step is at least as long as this prompt's own share of it: with attention counted,
            # the front of a long prompt's suffix takes longer than a step of fresh tokens
            q = self._query(found, len(tokens) - num_computed_tokens, max_load_tokens, False, num_computed_tokens)
            first = min(max(self.step_tokens, 1), q.prompt_tokens - take)
            prefill = self.meter.prefill_rate
            own_s = prefill_work(q, take, take + first) / prefill if prefill else 0.0
            budget = self.sync_budget_bytes(own_s)
            per_token = self.slot_bytes / self.chunk_tokens
            if budget is not None and self._step_sync_bytes + take * per_token > budget:
                # past what the step can load without waiting: the hit cut to what it can (the
                # policy's balance point lands a chunk either side of the budget, which is that
                # same balance), or asynchronously (the request waits outside the batch), as much
                # as the policy says for that mode: whichever loads more (it frees the GPU).
                # Before, a choice one chunk past the budget went asynchronous, where a slow disk
                # loads nothing: an H200 32k hit recomputed (1.00x) where it had loaded 0.86x.
                room = max(0.0, budget - self._step_sync_bytes)
                fit = chunk_floor(int(room // per_token), q) if room >= per_token else 0
                later = self._choose(found, len(tokens) - num_computed_tokens, max_load_tokens, asynchronous=True,
                                     context=num_computed_tokens, batch=batch)
                if later > fit:
                    r.load_async = True
                    take = later
                else:
                    take = fit
                    self._step_sync_bytes += int(take * per_token)
            else:
                self._step_sync_bytes += int(take * per_token)
        if self.state_groups and take < found:  # a shorter hit must end on a chunk whose state is stored
            take = 0
        r.declined = found - take  # counted once vLLM allocates (it may look a request up again)
        extra = self._tail(r, len(tokens), usable, num_computed_tokens + take, max_load_tokens)
        if extra:
            r.tail = True
            take += extra
            if not r.load_async and not self.asynchronous and self.can_load_async:
                self._step_sync_bytes += int(extra * self.slot_bytes / self.chunk_tokens)
        r.in_backlog = len(tokens) - num_computed_tokens - take
        self._backlog += r.in_backlog
        if take <= 0:
            r.hit_chunks = 0
            return 0
        r.hit_chunks = (num_computed_tokens + take) // self.chunk_tokens
        r.computed = num_computed_tokens + take
        return take

    def _tail(self, r: _Request, n_tokens: int, usable: int, end: int, max_load_tokens: int | None) -> int:
        """Tokens a hit ending at `end` grows by into the prompt's last chunk: all of it but the
        last block, which vLLM computes (it needs a token to compute, and tutti loads whole
        blocks). Only where the prompt ends on that chunk's end, the hit took every chunk before
        it (the policy chose among chunk boundaries and took all) and the chunk is stored; never
        for hybrid or state models (one block list, no state to end on). 0: no tail."""
        extra = self.chunk_tokens - self.block_size
        if (self.num_groups != 1 or self.state_groups or self.blocks_per_chunk < 2 or n_tokens % self.chunk_tokens
                or usable == 0 or end != usable * self.chunk_tokens or len(r.hit_sources) != usable
                or len(r.keys) <= usable):
            return 0
        if max_load_tokens is not None and end + extra - r.local_computed > max_load_tokens:
            return 0
        where = self._locate(r.keys[usable:usable + 1])
        if not where:
            return 0
        r.hit_sources.append(where[0])
        return extra

    def sync_budget_bytes(self, step_s: float = 0.0) -> float | None:
        """The bytes one step may load layer-wise now (None: no budget, or not measured yet); "auto":
        what the read rate moves while the GPU computes a full step, or `step_s` if longer."""
        if self.sync_budget is None or self.sync_budget == "off":
            return None
        if self.sync_budget != "auto":
            return float(self.sync_budget)
        overhead, rate = self.meter.load_model()
        prefill = self.meter.prefill_rate
        if not rate or not prefill:
            return None
        return max(0.0, rate * (max(self.step_tokens / prefill, step_s) - overhead))

    def wants_async(self, req_id: str) -> bool:
        """Whether the request's last lookup chose to load asynchronously."""
        r = self._reqs.get(req_id)
        return bool(r is not None and r.load_async)

    def _query(self, found: int, prompt_tokens: int, max_load_tokens: int | None, asynchronous: bool,
               context: int) -> HitQuery:
        return HitQuery(hit_tokens=found, prompt_tokens=prompt_tokens, chunk_tokens=self.chunk_tokens,
                        bytes_per_token=self.slot_bytes / self.chunk_tokens, step_tokens=self.step_tokens,
                        asynchronous=asynchronous, max_load_tokens=max_load_tokens, context_tokens=context,
                        attention_weight=self.attention_weight)

    def _choose(self, found: int, prompt_tokens: int, max_load_tokens: int | None,
                asynchronous: bool | None = None, context: int = 0, batch: int = 0) -> int:
        """The hit policy's choice among the loadable counts of a hit of `found` tokens; `batch`:
        the other requests running."""
        q = self._query(found, prompt_tokens, max_load_tokens,
                        self.asynchronous if asynchronous is None else asynchronous, context)
        overhead, load_rate = self.meter.load_model()
        rates = Rates(load_rate, self.meter.prefill_rate,
                      queued_load_bytes=self._unsent_load_bytes + sum(self._step_load_bytes.values()),
                      prefill_backlog_tokens=max(0, self._backlog), load_age_s=self.meter.load_age(),
                      load_overhead_s=overhead, step_s=self.meter.step_time, batch_requests=batch,
                      layerwise_extra_s=self.meter.layerwise_extra_s)
        try:
            want = self.hit_policy.decide(q, rates)
        except Exception:  # noqa: BLE001 - a research policy's bug costs its hits, never the step
            log.exception("tutti: hit policy %r failed; loading the whole hit", self.hit_policy)
            want = found
        try:
            return chunk_floor(want, q)
        except ValueError as exc:
            log.warning("tutti: %s; loading the whole hit", exc)
            return chunk_floor(found, q)

    def _locate(self, keys: Sequence[bytes]) -> list[tuple[str | None, int]]:
        """Where each chunk of the longest stored prefix of `keys` is: (None, slot) in our own
        store (touched: recently used), else (writer, slot) in another writer's."""
        out: list[tuple[str | None, int]] = []
        own: list[bytes] = []
        for key in keys:
            slot = self.index.slot_of(key)
            if slot is not None:
                own.append(key)
                out.append((None, slot))
                continue
            hit = self.foreign.get(key) if self.foreign is not None else None
            if hit is None:
                break
            out.append(hit)
        self.index.touch_prefix(own)  # tail first: the prefix's head ends the most recently used
        return out

    def _per_group(self, block_ids) -> list[list[int]]:
        """Block ids as one list per group (a flat list is the only group's)."""
        ids = list(block_ids or ())
        if ids and isinstance(ids[0], (list, tuple)):
            groups = [list(g) for g in ids]
        else:
            groups = [ids]
        if len(groups) != self.num_groups:
            raise ValueError(f"block ids for {len(groups)} KV cache groups; this planner has {self.num_groups}")
        return groups

    def _chunk_blocks(self, r: _Request, c: int, state: bool = False) -> tuple[int, ...]:
        """Chunk c's blocks, group after group (each group's `blocks_per_chunk` of them). With
        state groups, a chunk entry has vLLM's null block for them and a state entry (`state`)
        has it for every other group and, for a state group, only its last block: the column
        that holds the state after the chunk's last token (null blocks are never written)."""
        bpc = self.blocks_per_chunk
        out: list[int] = []
        for gi, g in enumerate(r.block_ids):
            if gi in self.state_groups:
                out.extend([NULL_BLOCK] * (bpc - 1) + [g[(c + 1) * bpc - 1]] if state else [NULL_BLOCK] * bpc)
            else:
                out.extend([NULL_BLOCK] * bpc if state else g[c * bpc:(c + 1) * bpc])
        return tuple(out)

    def _kept_blocks(self, r: _Request, c: int, state: bool) -> list[int]:
        """The blocks an entry must find held (not vLLM's null block) to be stored."""
        bpc = self.blocks_per_chunk
        if state:
            return [g[(c + 1) * bpc - 1] for gi, g in enumerate(r.block_ids) if gi in self.state_groups]
        return [b for gi, g in enumerate(r.block_ids) if gi not in self.state_groups for b in g[c * bpc:(c + 1) * bpc]]

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int, *,
                 async_load: bool = False) -> None:
        """Blocks were allocated for the request; plan the loads of its external tokens.
        `async_load`: vLLM does not schedule the request until its loads are reported received,
        so they go out in the next step whether or not the request is scheduled."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        r.async_load = async_load
        r.block_ids = self._per_group(block_ids)
        self.stats.declined_hit_tokens += r.declined
        r.declined = 0
        if num_external_tokens > 0 and r.hit_chunks:
            self.stats.hit_tokens += num_external_tokens
            if async_load:
                self.stats.async_hit_tokens += num_external_tokens
        if num_external_tokens <= 0 or r.hit_chunks == 0:
            return
        first = r.local_computed // self.chunk_tokens
        last = (r.local_computed + num_external_tokens) // self.chunk_tokens
        for c in range(first, last):
            key = r.keys[c]
            # Where match() found it. Our own chunks are pinned from there and cannot vanish; another
            # writer's may be evicted by its owner at any time: the worker checks it against that
            # writer's journal and checksums, and a chunk gone meanwhile is recomputed.
            source, slot = r.hit_sources[c] if c < len(r.hit_sources) else (None, None)
            if source is None and self.index.slot_of(key) != slot:
                raise RuntimeError(f"chunk {c} of request {req_id} vanished between lookup and allocation")
            skip = max(0, r.local_computed - c * self.chunk_tokens) // self.block_size
            r.loads.append(LoadChunk(req_id, key, slot, self._chunk_blocks(r, c), skip, source))
            self._unsent_load_bytes += self._load_bytes(r.loads[-1])
            self._hold(key, source, slot)
        if self.state_groups and last > first:  # the state at the hit's end
            if r.state_source is None:
                raise RuntimeError(f"request {req_id}: a hit of {last} chunks without the state at its end")
            source, slot = r.state_source
            skey = state_key(r.keys[last - 1])
            if source is None and self.index.slot_of(skey) != slot:
                raise RuntimeError(f"the state of chunk {last - 1} of request {req_id} vanished before allocation")
            r.loads.append(LoadChunk(req_id, skey, slot, self._chunk_blocks(r, last - 1, state=True), 0, source))
            self._hold(skey, source, slot)
            r.stored_state_upto = max(r.stored_state_upto, last)
        if r.tail and self._plan_tail(r, last, r.local_computed + num_external_tokens):
            last += 1  # the prompt's last chunk, stored already: never stored again
        r.next_store_chunk = max(r.next_store_chunk, last)

    def _plan_tail(self, r: _Request, c: int, end: int) -> bool:
        """The load of chunk `c`, the prompt's last, up to token `end` (its last block is vLLM's to
        compute); False when the allocated hit does not reach into it."""
        keep = (end - c * self.chunk_tokens) // self.block_size
        skip = max(0, r.local_computed - c * self.chunk_tokens) // self.block_size
        if c >= len(r.hit_sources) or not 0 < keep < self.blocks_per_chunk or skip >= keep:
            return False
        blocks = self._chunk_blocks(r, c)
        if len(blocks) < keep:
            return False
        # vLLM allocates an asynchronous load's blocks for its external tokens alone (the last
        # block comes once the request is scheduled): the chunk's list is padded with the null
        # block, which the load never writes (it ends at keep)
        blocks += (NULL_BLOCK,) * (self.blocks_per_chunk - len(blocks))
        key = r.keys[c]
        source, slot = r.hit_sources[c]
        if source is None and self.index.slot_of(key) != slot:
            raise RuntimeError(f"chunk {c} of request {r.req_id} vanished between lookup and allocation")
        r.loads.append(LoadChunk(r.req_id, key, slot, blocks, skip, source, keep_blocks=keep))
        self._unsent_load_bytes += self._load_bytes(r.loads[-1])
        self._hold(key, source, slot)
        return True

    def _load_bytes(self, ld: LoadChunk) -> int:
        """The bytes of the blocks a load writes (a chunk's share of its slot)."""
        bpc = self.blocks_per_chunk
        keep = bpc if ld.keep_blocks is None else min(ld.keep_blocks, bpc)
        return self.slot_bytes * max(0, keep - min(ld.skip_blocks, bpc)) // bpc

    def _drop_unsent(self, loads: Sequence[LoadChunk]) -> None:
        self._unsent_load_bytes = max(0, self._unsent_load_bytes - sum(self._load_bytes(ld) for ld in loads))

    def _hold(self, key: bytes, source: str | None, slot: int) -> None:
        if source is None:
            self.index.pin([key])
        else:
            self._foreign_loads[key] = (source, slot)

    # -- per step -------------------------------------------------------------------------
    def update_request(self, req_id: str, *, new_block_ids: Sequence[int] = (), tokens: Sequence[int] | None = None,
                       all_block_ids: Sequence[int] | None = None) -> None:
        """Record blocks (and, for a request first seen here, tokens) from the scheduler's output."""
        r = self._reqs.get(req_id)
        if r is None:
            if tokens is None:
                return
            r = self._request(req_id, tokens)
        if all_block_ids is not None:
            r.block_ids = self._per_group(all_block_ids)
        elif new_block_ids:
            for mine, new in zip(r.block_ids, self._per_group(new_block_ids)):
                mine.extend(new)

    def append_tokens(self, req_id: str, tokens: Sequence[int]) -> None:
        """Generated tokens (stored only with store_decode)."""
        r = self._reqs.get(req_id)
        if r is None or not self.store_decode or r.unkeyed:
            return
        r.tokens.extend(tokens)
        n_have = len(r.keys)
        parent = r.keys[-1] if r.keys else None
        try:
            r.keys.extend(chunk_keys(r.tokens, self.chunk_tokens, self.seed, start=n_have, parent=parent,
                                     identity=r.identity))
        except UnkeyableError as exc:
            log.warning("tutti: generated chunks of request %s are not stored: %s", req_id, exc)
            r.unkeyed = True

    def sync_tokens(self, req_id: str, all_tokens: Sequence[int]) -> None:
        """With store_decode: catch up with the request's prompt + generated tokens."""
        r = self._reqs.get(req_id)
        if r is not None and self.store_decode and len(all_tokens) > len(r.tokens):
            self.append_tokens(req_id, list(all_tokens[len(r.tokens):]))

    def build_step(self, scheduled: Mapping[str, int], computed_before: Mapping[str, int]) -> StepPlan:
        """The loads and stores of one step. `scheduled[req]` tokens are computed this step on
        top of `computed_before[req]`."""
        plan = StepPlan(step=next(self._steps), idle=not any(scheduled.values()))  # idle: no forward pass runs
        work = sum(token_work(n, computed_before.get(r, 0), self.attention_weight) for r, n in scheduled.items())
        self.meter.on_scheduled(plan.step, sum(scheduled.values()), work=work)
        self._batch_ids = frozenset(scheduled)
        self._step_sync_bytes = 0  # the next step's lookups start a new budget
        pins: list[bytes] = []
        foreign_keys: list[bytes] = []
        want: list[tuple[_Request, int]] = []
        for req_id, n_sched in scheduled.items():
            r = self._reqs.get(req_id)
            if r is None:
                continue
            if r.loads:
                plan.loads.extend(r.loads)
                self.meter.loads_in(plan.step, sum(self._load_bytes(ld) for ld in r.loads))
                pins.extend(ld.key for ld in r.loads if ld.source is None)
                foreign_keys.extend(ld.key for ld in r.loads if ld.source is not None)
                r.loads = []
            done_tokens = computed_before.get(req_id, 0) + n_sched
            if done_tokens > r.computed:
                r.computed = done_tokens
            if r.next_store_chunk >= len(r.keys) and not self.state_groups:
                continue  # every chunk of its tokens was planned: a decoding request has nothing to store
            limit = min(done_tokens, len(r.tokens)) // self.chunk_tokens
            limit = min(limit, len(r.keys), min(len(g) for g in r.block_ids) // self.blocks_per_chunk)
            if r.holed:  # not planned: planning evicts resident chunks for stores no hit could reach
                self.stats.stores_declined += max(0, limit - r.next_store_chunk)
                r.next_store_chunk = max(r.next_store_chunk, limit)
                continue
            for c in range(r.next_store_chunk, limit):
                want.append((r, c, False))
            if self.state_groups and limit and done_tokens == limit * self.chunk_tokens and not r.unkeyed \
                    and limit > r.stored_state_upto:
                # this step ends exactly on a chunk boundary: the state groups hold the state there
                want.append((r, limit - 1, True))
                r.stored_state_upto = limit
            r.next_store_chunk = max(r.next_store_chunk, limit)
        if want:
            keys = [state_key(r.keys[c]) if st else r.keys[c] for r, c, st in want]
            # never stored twice: not if we hold it, are storing it, or another writer holds it
            fresh = [k for k in keys if k not in self.index and not self.index.is_pending(k)
                     and not (self.foreign is not None and k in self.foreign)]
            if fresh and not isinstance(self.admission, AdmitAll):
                fresh = self._admitted(fresh, want, keys)
            self.index.touch_prefix(keys)  # the resident ones used again, tail first
            res = self.index.plan_store(fresh)
            if res.evicted:
                self.stats.evictions += len(res.evicted)
                self._events.append(("removed", list(res.evicted)))
            self.stats.stores_declined += len(res.declined)
            for (r, c, st), key in zip(want, keys):
                slot = res.slots.pop(key, None)
                if slot is None:
                    continue
                blocks = self._chunk_blocks(r, c, st)
                if self.num_groups > 1 and NULL_BLOCK in self._kept_blocks(r, c, st):
                    # a sliding-window group already dropped blocks of this chunk (vLLM's null block),
                    # or a state group holds no state there: it cannot be stored whole
                    self.index.abort(key)
                    self.stats.stores_declined += 1
                    continue
                ticket = next(self._ticket_ids)
                self._tickets[ticket] = _Ticket(key, r.req_id, state=st)
                plan.stores.append(StoreChunk(r.req_id, key, slot, blocks, ticket))
                r.had_stores = True
                self.stats.stores_planned += 1
        if plan.loads:
            self._sent(plan.step, plan.loads)
        if pins:
            self._step_pins[plan.step] = pins
        if foreign_keys:
            self._step_foreign[plan.step] = foreign_keys
        waiting = [r for r in self._reqs.values() if r.async_load and r.loads and r.req_id not in scheduled]
        if waiting:
            plan.async_step = next(self._steps)  # its own pins: released when the worker reports it done
            for r in waiting:
                plan.async_loads.extend(r.loads)
                r.loads = []
            self._step_pins[plan.async_step] = [ld.key for ld in plan.async_loads if ld.source is None]
            self._step_foreign[plan.async_step] = [ld.key for ld in plan.async_loads if ld.source is not None]
            self._sent(plan.async_step, plan.async_loads)
        plan.preempted, self._preempted = self._preempted, []
        self._backlog = 0
        for r in self._reqs.values():
            r.in_backlog = max(0, len(r.tokens) - r.computed)
            self._backlog += r.in_backlog
        return plan

    def _admitted(self, fresh: list[bytes], want: list, keys: list[bytes]) -> list[bytes]:
        """The admission policy's yes among the fresh chunks; its no is declined (counted)."""
        where = {k: w for w, k in zip(want, keys)}
        resident, out = len(self.index), []
        for k in fresh:
            r, c, st = where[k]
            cand = StoreCandidate(key=k, req_id=r.req_id, chunk=c, prompt_chunks=r.prompt_len // self.chunk_tokens,
                                  state=st, resident=resident, capacity=self.index.num_slots,
                                  first_key=r.keys[0], counters=self.stats)
            try:
                ok = bool(self.admission.admit(cand))
            except Exception:  # noqa: BLE001 - a research policy's bug costs its stores, never the step
                log.exception("tutti: store admission %r failed; storing the chunk", self.admission)
                ok = True
            if ok:
                out.append(k)
            else:
                self.stats.stores_declined += 1
        return out

    def _sent(self, step: int, loads: Sequence[LoadChunk]) -> None:
        """These loads went out with `step`: queued until every worker reports the step done."""
        self._drop_unsent(loads)
        self._step_load_bytes[step] = self._step_load_bytes.get(step, 0) + sum(self._load_bytes(ld) for ld in loads)

    # -- lifecycle ------------------------------------------------------------------------
    def preempted(self, req_id: str) -> None:
        """vLLM preempted the request: its blocks are freed and it will be scheduled again.

        The request stays known (so `finished` still reports stores the workers track); it
        gets new blocks and, on resumption, a fresh lookup and allocation.
        """
        r = self._reqs.get(req_id)
        if r is None:
            return
        for ld in r.loads:
            if ld.source is None:
                self.index.unpin([ld.key])
        self._drop_unsent(r.loads)
        r.loads = []
        r.computed = 0
        r.block_ids = [[] for _ in range(self.num_groups)]
        r.hit_chunks = 0
        r.next_store_chunk = 0  # chunks stored meanwhile are skipped as resident or pending
        r.stored_state_upto = 0
        self._preempted.append(req_id)

    def finished(self, req_id: str) -> bool:
        """The request is done. True: keep its blocks until the workers report its stores done."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return False
        self._backlog -= r.in_backlog  # an aborted prompt no longer waits ahead of anyone
        for ld in r.loads:  # planned but never sent (aborted before its step)
            if ld.source is None:
                self.index.unpin([ld.key])
        self._drop_unsent(r.loads)
        return r.had_stores

    # -- reports --------------------------------------------------------------------------
    def on_report(self, report: WorkerReport) -> None:
        s = self.stats
        s.bytes_loaded += report.bytes_loaded
        s.bytes_stored += report.bytes_stored
        s.load_seconds += report.load_seconds
        s.store_seconds += report.store_seconds
        s.stores_skipped += report.stores_skipped
        if report.rate_bytes or report.rate_seconds:
            self.meter.on_loads(report.rate_bytes, report.rate_seconds)
        elif report.bytes_loaded:
            self.meter.on_loads(0, 0.0)  # loads that hid under compute: the rate is not stale
        for step in report.steps_done:  # the step's output is here: it is done (the meter's step times)
            self.meter.on_done(step)
        if report.probe_bytes and report.workers:  # the start-up probe: per worker, as loads are
            self.meter.on_loads(report.probe_bytes // report.workers, report.probe_seconds / PROBE_UNDER_STEP)
        for t in report.store_failed:
            tk = self._tickets.pop(t, None)
            if tk is not None and self.index.abort(tk.key):
                s.stores_failed += 1
            r = self._reqs.get(tk.req_id) if tk is not None and not tk.state else None
            if r is not None:
                r.holed = True  # its later chunks are not planned (the worker skips those in flight)
        ready: list[_Ticket] = []
        for t in report.stored:
            tk = self._tickets.get(t)
            if tk is None:
                continue
            tk.ok += 1  # vLLM's KVOutputAggregator concatenates every worker's report: one entry per rank
            if tk.ok >= self.num_writers:
                del self._tickets[t]
                ready.append(tk)
        # Committed tail first (a request's stores come in chunk order), then each request's whole
        # resident prefix touched tail first: its first chunks become the most recently used, so a
        # policy by recency evicts a prefix from its end, never the chunk every hit needs first.
        committed = {id(tk) for tk in reversed(ready) if self.index.commit(tk.key)}
        for tk in ready:  # events in chunk order (a child's parent announced first)
            if id(tk) in committed:
                s.stores_committed += 1
                if not tk.state:
                    self._events.append(("stored", [tk.key]))
        for req_id in dict.fromkeys(tk.req_id for tk in ready if id(tk) in committed):
            r = self._reqs.get(req_id)
            if r is not None:
                self.index.lookup_prefix(r.keys)
        for key in set(report.load_failed):
            s.loads_failed += 1
            where = self._foreign_loads.pop(key, None)
            if where is not None and self.foreign is not None:
                self.foreign.failed(key, *where)  # not served from there again; its owner decides the rest
                continue
            # A chunk that failed to load is not trusted again: drop it once unpinned.
            self._bad.add(key)
        for step in report.steps_done:
            n = self._step_done_count.get(step, 0) + 1
            if n >= self.num_workers:
                self._step_done_count.pop(step, None)
                self._step_load_bytes.pop(step, None)
                self.index.unpin(self._step_pins.pop(step, []))
                for key in self._step_foreign.pop(step, []):
                    self._foreign_loads.pop(key, None)
            else:
                self._step_done_count[step] = n
        for key in list(self._bad):
            if not self.index.is_pinned(key):
                self._bad.discard(key)
                if self.index.drop(key):
                    self._events.append(("removed", [key]))


    def take_events(self) -> list[tuple[str, list[bytes]]]:
        ev, self._events = self._events, []
        return ev

    def rebuild(self, entries: Mapping[int, bytes]) -> None:
        self.index.rebuild(entries)

    def capacity_used_bytes(self) -> int:
        return self.index.used_slots * self.slot_bytes


def rebuild_entries(per_rank: Iterable[Mapping[int, bytes]]) -> dict[int, bytes]:
    """Slots whose chunk every rank holds (same key in the same slot): those are resident."""
    per_rank = list(per_rank)
    if not per_rank:
        return {}
    first, rest = per_rank[0], per_rank[1:]
    return {slot: key for slot, key in first.items() if all(other.get(slot) == key for other in rest)}
