"""The planner's lookups: how much of a request's prompt is stored, how much of it to load
(the hit policy, priced with the rates measured), where each chunk is (this writer's slots or
another writer's), and the loads planned once vLLM allocated the blocks."""

from __future__ import annotations

import logging
import time
from typing import Iterable, Sequence

from tutti.engine.sched.hit_policy import UNMEASURED, HitQuery, Rates, chunk_floor, prefill_work
from tutti.engine.keys import Identity, UnkeyableError, chunk_keys, state_key
from tutti.engine.plan import NULL_BLOCK, LoadChunk
from tutti.engine.sched.requests import RequestState

log = logging.getLogger("tutti.engine")


class HitPlanning:
    """Planner's lookup half (a mixin over the state Planner.__init__ sets)."""

    # -- lookups --------------------------------------------------------------------------
    def _request(self, req_id: str, tokens: Sequence[int], identity: Identity | None = None) -> RequestState:
        r = self._reqs.get(req_id)
        if r is None:
            r = RequestState(req_id, list(tokens), [], [[] for _ in range(self.num_groups)], identity=identity,
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
              identity: Identity | None = None, max_load_tokens: int | None = None) -> int | None:
        """Tokens beyond `num_computed_tokens` to load: whole chunks the store holds, as many as
        the hit policy chooses (at most `max_load_tokens`, the request's own cap), and always at
        least one prompt token left for vLLM to compute. `identity(start, end)` gives the bytes
        of what else tokens [start, end) depend on (see tutti.engine.keys).

        A prompt ending exactly on a stored chunk's end (an exact repeat) may load that chunk too,
        all but its last block (`_tail`): vLLM then computes block_size tokens instead of a chunk.

        None (promote "stage"): ask again later. The hit's chunks in a lower tier are being copied
        up into the first, or are up while the request's blocks would not fit; meanwhile the
        request waits without GPU blocks (tiers.py: `_begin_stage`, `_waits_for_blocks`)."""
        r = self._request(req_id, tokens, identity)
        use = not r.counted  # the first lookup of this scheduling uses its chunks; a repeat refreshes them
        if r.staging:
            if self._stage_pending(r) or self._waits_for_blocks(r, len(tokens), num_computed_tokens):
                return None
            r.staging, r.staged = (), True
        self._backlog -= r.in_backlog  # looked up again (it waited for room): not queued ahead of itself
        r.in_backlog = 0
        r.tail = False
        usable = (len(tokens) - 1) // self.chunk_tokens
        r.hit_sources = self._locate(r.keys[:usable], use=use)
        if self.state_groups:  # the hit ends on the last chunk whose state is stored too
            r.state_source = None
            while r.hit_sources:
                where = self._locate([state_key(r.keys[len(r.hit_sources) - 1])], use=use)
                if where:
                    r.state_source = where[0]
                    break
                r.hit_sources.pop()
        hits = len(r.hit_sources)
        r.local_computed = num_computed_tokens
        r.hit_chunks = hits
        if not r.counted:  # once a scheduling, however often vLLM asks while the request waits
            self.stats.queried_tokens += len(tokens)
            r.counted = True
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
        if self._reaches_lower(r):
            take = self._tiered_take(r, take, found, len(tokens) - num_computed_tokens, max_load_tokens,
                                     num_computed_tokens, batch)
        chosen, reason = take, getattr(self.hit_policy, "last_reason", "rate")
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
                    take = chosen = later
                    reason = getattr(self.hit_policy, "last_reason", "rate")
                else:
                    take = fit
                    self._step_sync_bytes += int(take * per_token)
            else:
                self._step_sync_bytes += int(take * per_token)
        budget_cut = chosen - take  # what the step's byte budget cut below the policy's choice
        if self.state_groups and take < found:  # a shorter hit must end on a chunk whose state is stored
            take = 0
        r.declined = found - take  # counted once vLLM allocates (it may look a request up again)
        r.declined_by = self._declined_by(r, found, chosen, take, budget_cut, reason, len(tokens) - num_computed_tokens,
                                          max_load_tokens, num_computed_tokens, batch, r.load_async)
        extra = self._tail(r, len(tokens), usable, num_computed_tokens + take, max_load_tokens, use=use)
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
        if (self.stage and not r.staged and self._reaches_lower(r) and self._short_of_blocks(r)
                and self._begin_stage(r)):
            return None
        return take

    def _tail(self, r: RequestState, n_tokens: int, usable: int, end: int, max_load_tokens: int | None, *,
              use: bool = True) -> int:
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
        where = self._locate(r.keys[usable:usable + 1], use=use)
        if not where:
            return 0
        r.hit_sources.append(where[0])
        return extra

    def _declined_by(self, r: RequestState, found: int, chosen: int, take: int, budget_cut: int, reason: str,
                     prompt: int, max_load_tokens: int | None, context: int, batch: int,
                     asynchronous: bool) -> dict[str, int]:
        """Why `found - take` hit tokens were recomputed, in tokens: "unmeasured" (no read rate yet),
        "queue" (what the policy would have loaded with no loads queued ahead), "rate" (the rest of
        the policy's cut), "budget" (the step's byte budget), "state" (a hybrid hit must end where a
        state is stored). The parts add up to the declined tokens."""
        by: dict[str, int] = {}
        cut = found - chosen
        if cut > 0:
            if reason == UNMEASURED:
                by[UNMEASURED] = cut
            else:
                free = chosen
                if self._queued_load_bytes():
                    free = self._choose(found, prompt, max_load_tokens, asynchronous=asynchronous, context=context,
                                        batch=batch, queued=0)
                    if self._reaches_lower(r):  # priced per tier, as chosen
                        free = self._tiered_take(r, free, found, prompt, max_load_tokens, context, batch, queued=0)
                    free = max(chosen, free)
                if free > chosen:
                    by["queue"] = free - chosen
                if found - free > 0:
                    by["rate"] = found - free
        if budget_cut > 0:
            by["budget"] = budget_cut
        state = (found - take) - sum(by.values())
        if state > 0:
            by["state"] = state
        return by

    def _queued_load_bytes(self, lower: bool = False) -> int:
        """Bytes of loads planned and not yet done: read before a new hit's (`lower`: only those
        from tiers below the first, which the drive reads apart from the RAM tier's)."""
        if lower:  # with "stage", a hit's reads of the drive are its copies up
            staged = (len(self._stage) + self._up_in_flight) * self.slot_bytes if self.stage else 0
            return self._unsent_lower_bytes + sum(self._step_lower_bytes.values()) + staged
        return self._unsent_load_bytes + sum(self._step_load_bytes.values())

    def _queue_load(self, ld: LoadChunk) -> None:
        total, lower = self._loads_bytes((ld,))
        self._unsent_load_bytes += total
        self._unsent_lower_bytes += lower

    def _loads_bytes(self, loads: Sequence[LoadChunk]) -> tuple[int, int]:
        """(bytes, of those the lower tiers') the loads write: what they add to the queues."""
        total = lower = 0
        for ld in loads:
            n = self._load_bytes(ld)
            total += n
            if ld.tier:
                lower += n
        return total, lower

    def sync_budget_bytes(self, step_s: float = 0.0) -> float | None:
        """The bytes one step may load layer-wise now (None: no budget, or not measured yet); "auto":
        what the read rate moves while the GPU computes a full step, or `step_s` if longer."""
        if self.sync_budget is None or self.sync_budget == "off":
            return None
        if self.sync_budget != "auto":
            return float(self.sync_budget)
        from tutti.engine.config import resolve

        overhead, rate = self.meter.load_model()
        return resolve.sync_load_budget_bytes(rate=rate, overhead=overhead, prefill_rate=self.meter.prefill_rate,
                                              step_tokens=self.step_tokens, step_s=step_s)

    def received(self, req_ids: Iterable[str]) -> None:
        """vLLM learned these requests' asynchronous loads are done (finished_recving): their wait
        outside the batch is counted (async_wait_seconds / async_waits)."""
        now = time.monotonic()
        for req_id in req_ids:
            r = self._reqs.get(req_id)
            if r is not None and r.async_since is not None:
                self.stats.async_wait_seconds += now - r.async_since
                self.stats.async_waits += 1
                r.async_since = None

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
                asynchronous: bool | None = None, context: int = 0, batch: int = 0, queued: int | None = None,
                meter=None) -> int:
        """The hit policy's choice among the loadable counts of a hit of `found` tokens; `batch`:
        the other requests running; `queued`: the load bytes queued ahead (default: as planned);
        `meter`: whose read rate prices it (default: the first tier's, self.meter)."""
        q = self._query(found, prompt_tokens, max_load_tokens,
                        self.asynchronous if asynchronous is None else asynchronous, context)
        reads = self.meter if meter is None else meter
        overhead, load_rate = reads.load_model()
        rates = Rates(load_rate, self.meter.prefill_rate,
                      queued_load_bytes=self._queued_load_bytes() if queued is None else queued,
                      prefill_backlog_tokens=max(0, self._backlog), load_age_s=reads.load_age(),
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

    def _locate(self, keys: Sequence[bytes], *, use: bool = True) -> list[tuple[str | None, int, int]]:
        """Where each chunk of the longest stored prefix of `keys` is: (None, slot, tier) in our
        own tiers, the fastest that holds it (touched there: used, or with `use` False only
        refreshed, for a lookup vLLM repeats), else (writer, slot, foreign_tier) in another
        writer's store (with tiers: in the last tier's roots)."""
        out: list[tuple[str | None, int, int]] = []
        touched: list[list[bytes]] = [[] for _ in range(self.num_tiers)]
        for key in keys:
            slot = self.index.slot_of(key)
            if slot is not None:
                touched[0].append(key)
                out.append((None, slot, 0))
                continue
            below = self._in_lower(key) if self.lower else None
            if below is not None:
                touched[below[0]].append(key)
                out.append((None, below[1], below[0]))
                continue
            hit = self.foreign.get(key) if self.foreign is not None else None
            if hit is None:
                break
            out.append((hit[0], hit[1], self.foreign_tier))
        for t, own in enumerate(touched):  # tail first: the prefix's head ends the most recently used
            if own:
                self.tier_index(t).touch_prefix(own, use=use)
        return out

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int, *,
                 async_load: bool = False) -> None:
        """Blocks were allocated for the request; plan the loads of its external tokens.
        `async_load`: vLLM does not schedule the request until its loads are reported received,
        so they go out in the next step whether or not the request is scheduled."""
        r = self._reqs.get(req_id)
        if r is None:
            return
        r.async_load = async_load
        self._set_blocks(r, self._per_group(block_ids))
        self.stats.declined_hit_tokens += r.declined
        for why, n in r.declined_by.items():
            setattr(self.stats, f"declined_{why}_tokens", getattr(self.stats, f"declined_{why}_tokens") + n)
        r.declined, r.declined_by = 0, {}
        if num_external_tokens > 0 and r.hit_chunks:
            self.stats.hit_tokens += num_external_tokens
            if async_load:
                self.stats.async_hit_tokens += num_external_tokens
                r.async_since = time.monotonic()
        if num_external_tokens <= 0 or r.hit_chunks == 0:
            return
        first = r.local_computed // self.chunk_tokens
        last = (r.local_computed + num_external_tokens) // self.chunk_tokens
        for c in range(first, last):
            key = r.keys[c]
            # Where match() found it. Our own chunks are pinned from there and cannot vanish; another
            # writer's may be evicted by its owner at any time: the worker checks it against that
            # writer's journal and checksums, and a chunk gone meanwhile is recomputed.
            source, slot, tier = r.hit_sources[c] if c < len(r.hit_sources) else (None, None, 0)
            if source is None and self.tier_index(tier).slot_of(key) != slot:
                raise RuntimeError(f"chunk {c} of request {req_id} vanished between lookup and allocation")
            skip = max(0, r.local_computed - c * self.chunk_tokens) // self.block_size
            r.loads.append(LoadChunk(req_id, key, slot, self._chunk_blocks(r, c), skip, source, tier=tier))
            self._queue_load(r.loads[-1])
            self._hold(key, source, slot, tier)
            self.tier_stats.hit_tokens[tier] += self._load_tokens(r.loads[-1])
            self.tier_stats.hit_bytes[tier] += self._load_bytes(r.loads[-1])
        if self.state_groups and last > first:  # the state at the hit's end
            if r.state_source is None:
                raise RuntimeError(f"request {req_id}: a hit of {last} chunks without the state at its end")
            source, slot, tier = r.state_source
            skey = state_key(r.keys[last - 1])
            if source is None and self.tier_index(tier).slot_of(skey) != slot:
                raise RuntimeError(f"the state of chunk {last - 1} of request {req_id} vanished before allocation")
            r.loads.append(LoadChunk(req_id, skey, slot, self._chunk_blocks(r, last - 1, state=True), 0, source,
                                     tier=tier))
            self._hold(skey, source, slot, tier)
            r.stored_state_upto = max(r.stored_state_upto, last)
        if r.tail and self._plan_tail(r, last, r.local_computed + num_external_tokens):
            last += 1  # the prompt's last chunk, stored already: never stored again
        r.next_store_chunk = max(r.next_store_chunk, last)

    def _plan_tail(self, r: RequestState, c: int, end: int) -> bool:
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
        source, slot, tier = r.hit_sources[c]
        if source is None and self.tier_index(tier).slot_of(key) != slot:
            raise RuntimeError(f"chunk {c} of request {r.req_id} vanished between lookup and allocation")
        r.loads.append(LoadChunk(r.req_id, key, slot, blocks, skip, source, keep_blocks=keep, tier=tier))
        self._queue_load(r.loads[-1])
        self._hold(key, source, slot, tier)
        return True

    def _load_tokens(self, ld: LoadChunk) -> int:
        """The tokens of the blocks a load writes."""
        bpc = self.blocks_per_chunk
        keep = bpc if ld.keep_blocks is None else min(ld.keep_blocks, bpc)
        return max(0, keep - min(ld.skip_blocks, bpc)) * self.block_size

    def _load_bytes(self, ld: LoadChunk) -> int:
        """The bytes of the blocks a load writes (a chunk's share of its slot)."""
        bpc = self.blocks_per_chunk
        keep = bpc if ld.keep_blocks is None else min(ld.keep_blocks, bpc)
        return self.slot_bytes * max(0, keep - min(ld.skip_blocks, bpc)) // bpc

    def _hold(self, key: bytes, source: str | None, slot: int, tier: int = 0) -> None:
        if source is None:
            self.tier_index(tier).pin([key])
        else:
            self._foreign_loads[key] = (source, slot)
