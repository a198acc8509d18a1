"""The planner's steps: each request's new blocks and tokens, the loads and stores a step
sends to the workers (admission and slots in the index), and the workers' reports turned
into commits, failures, evictions and events."""

from __future__ import annotations

import logging
from typing import Mapping, Sequence

from tutti.engine.sched.admission import AdmitAll, StoreCandidate
from tutti.engine.sched.hit_policy import token_work
from tutti.engine.keys import UnkeyableError, chunk_keys, state_key
from tutti.engine.plan import NULL_BLOCK, LoadChunk, StepPlan, StoreChunk, WorkerReport
from tutti.engine.sched.requests import PROBE_UNDER_STEP, RequestState, StoreTicket

log = logging.getLogger("tutti.engine")


class StepPlanning:
    """Planner's step half (a mixin over the state Planner.__init__ sets)."""

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

    def _set_blocks(self, r: RequestState, groups: list[list[int]], *, extend: bool = False) -> None:
        """The request's blocks are now `groups` (with `extend`: its blocks and then `groups`'s,
        group by group); counted per distinct block, with the blocks its prompt still needs, where
        promote "stage" weighs how short vLLM's blocks are (tiers.py: `_short_of_blocks`,
        `_waits_for_blocks`)."""
        counting = self._block_refs is not None
        if counting:
            if not extend:
                self._count_blocks(r.block_ids, -1)
            self._count_blocks(groups, 1)
            self._reserved_blocks -= self._blocks_to_come(r)
        if extend:
            for mine, more in zip(r.block_ids, groups):
                mine.extend(more)
        else:
            r.block_ids = groups
        if counting:
            self._reserved_blocks += self._blocks_to_come(r)

    def _blocks_to_come(self, r: RequestState) -> int:
        """Blocks the request's prompt needs beyond those it holds: vLLM reserves them for a request
        it admitted (none for one that holds no block yet)."""
        held = r.block_ids[0] if r.block_ids else None
        return max(0, -(-r.prompt_len // self.block_size) - len(held)) if held else 0

    def _count_blocks(self, groups, d: int) -> None:
        refs = self._block_refs
        for g in groups:
            for b in g:
                n = refs.get(b, 0) + d
                if n > 0:
                    refs[b] = n
                else:
                    refs.pop(b, None)

    def _chunk_blocks(self, r: RequestState, c: int, state: bool = False) -> tuple[int, ...]:
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

    def _kept_blocks(self, r: RequestState, c: int, state: bool) -> list[int]:
        """The blocks an entry must find held (not vLLM's null block) to be stored."""
        bpc = self.blocks_per_chunk
        if state:
            return [g[(c + 1) * bpc - 1] for gi, g in enumerate(r.block_ids) if gi in self.state_groups]
        return [b for gi, g in enumerate(r.block_ids) if gi not in self.state_groups for b in g[c * bpc:(c + 1) * bpc]]

    def _drop_unsent(self, loads: Sequence[LoadChunk]) -> None:
        total, lower = self._loads_bytes(loads)
        self._unsent_load_bytes = max(0, self._unsent_load_bytes - total)
        self._unsent_lower_bytes = max(0, self._unsent_lower_bytes - lower)

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
            self._set_blocks(r, self._per_group(all_block_ids))
        elif new_block_ids:
            self._set_blocks(r, self._per_group(new_block_ids), extend=True)

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
        if self.lower:  # before this step's stores evict: tier 0's chunks on their way down stay
            self._plan_copies(plan)
        pins: list[tuple[int, bytes]] = []
        foreign_keys: list[bytes] = []
        want: list[tuple[RequestState, int]] = []
        for req_id, n_sched in scheduled.items():
            r = self._reqs.get(req_id)
            if r is None:
                continue
            if r.loads:
                plan.loads.extend(r.loads)
                self.meter.loads_in(plan.step, sum(self._load_bytes(ld) for ld in r.loads))
                pins.extend((ld.tier, ld.key) for ld in r.loads if ld.source is None)
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
                self._removed(0, list(res.evicted))
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
                self._tickets[ticket] = StoreTicket(key, r.req_id, state=st)
                plan.stores.append(StoreChunk(r.req_id, key, slot, blocks, ticket))
                r.had_stores = True
                self.stats.stores_planned += 1
        if self.lower:  # the stores a step makes, recently at most (write_policy "back" keeps that many clean)
            self._burst = max(len(plan.stores), int(self._burst * 0.95))
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
            self._step_pins[plan.async_step] = [(ld.tier, ld.key) for ld in plan.async_loads if ld.source is None]
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
        total, lower = self._loads_bytes(loads)
        self._step_load_bytes[step] = self._step_load_bytes.get(step, 0) + total
        if lower:
            self._step_lower_bytes[step] = self._step_lower_bytes.get(step, 0) + lower

    # -- lifecycle ------------------------------------------------------------------------
    def preempted(self, req_id: str) -> None:
        """vLLM preempted the request: its blocks are freed and it will be scheduled again.

        The request stays known (so `finished` still reports stores the workers track); it
        gets new blocks and, on resumption, a fresh lookup and allocation.
        """
        r = self._reqs.get(req_id)
        if r is None:
            return
        self._unpin_loads(r.loads)
        self._drop_unsent(r.loads)
        r.loads = []
        r.computed = 0
        self._set_blocks(r, [[] for _ in range(self.num_groups)])
        r.hit_chunks = 0
        r.counted = False  # its next lookup is a new one, whose hits count again
        r.next_store_chunk = 0  # chunks stored meanwhile are skipped as resident or pending
        r.stored_state_upto = 0
        self._preempted.append(req_id)

    def finished(self, req_id: str) -> bool:
        """The request is done. True: keep its blocks until the workers report its stores done."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return False
        self._backlog -= r.in_backlog  # an aborted prompt no longer waits ahead of anyone
        self._set_blocks(r, [])
        self._unpin_loads(r.loads)  # planned but never sent (aborted before its step)
        self._drop_unsent(r.loads)
        return r.had_stores

    def _unpin_loads(self, loads: Sequence[LoadChunk]) -> None:
        for ld in loads:
            if ld.source is None:
                self.tier_index(ld.tier).unpin([ld.key])

    # -- reports --------------------------------------------------------------------------
    def on_report(self, report: WorkerReport) -> None:
        s = self.stats
        s.bytes_loaded += report.bytes_loaded
        s.bytes_stored += report.bytes_stored
        s.load_seconds += report.load_seconds
        s.store_seconds += report.store_seconds
        s.stores_skipped += report.stores_skipped
        if report.lower_rate_bytes or report.lower_rate_seconds:
            self.lower_meter.on_loads(report.lower_rate_bytes, report.lower_rate_seconds)
        if report.rate_bytes or report.rate_seconds:
            self.meter.on_loads(report.rate_bytes, report.rate_seconds)
        elif report.bytes_loaded:
            self.meter.on_loads(0, 0.0)  # loads that hid under compute: the rate is not stale
        for step in report.steps_done:  # the step's output is here: it is done (the meter's step times)
            self.meter.on_done(step)
        if report.probe_bytes and report.workers and not self.probe_seeded:  # the start-up probe: per worker
            self.meter.on_loads(report.probe_bytes // report.workers, report.probe_seconds / PROBE_UNDER_STEP)
        for t in report.store_failed:
            tk = self._tickets.pop(t, None)
            if tk is not None and tk.copy is not None:
                self._copy_done(tk, False)
                continue
            if tk is not None and self.index.abort(tk.key):
                s.stores_failed += 1
            r = self._reqs.get(tk.req_id) if tk is not None and not tk.state else None
            if r is not None:
                r.holed = True  # its later chunks are not planned (the worker skips those in flight)
        ready: list[StoreTicket] = []
        for t in report.stored:
            tk = self._tickets.get(t)
            if tk is None:
                continue
            tk.ok += 1  # vLLM's KVOutputAggregator concatenates every worker's report: one entry per rank
            if tk.ok >= self.num_writers:
                del self._tickets[t]
                if tk.copy is not None:
                    self._copy_done(tk, True)
                else:
                    ready.append(tk)
        # Committed tail first (a request's stores come in chunk order), then each request's whole
        # resident prefix touched tail first: its first chunks become the most recently used, so a
        # policy by recency evicts a prefix from its end, never the chunk every hit needs first.
        committed = {id(tk) for tk in reversed(ready) if self.index.commit(tk.key)}
        for tk in ready:  # events in chunk order (a child's parent announced first)
            if id(tk) in committed:
                s.stores_committed += 1
                if not tk.state and not (self.lower and self.held_anywhere(tk.key, but=0)):
                    self._events.append(("stored", [tk.key]))
                if self.lower:
                    self._queue_down(tk.key, 0)
        for req_id in dict.fromkeys(tk.req_id for tk in ready if id(tk) in committed):
            r = self._reqs.get(req_id)
            if r is not None:
                self.index.lookup_prefix(r.keys)
        failed = set(report.load_failed)
        for key in failed:
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
                self._step_lower_bytes.pop(step, None)
                pins = self._step_pins.pop(step, [])
                for tier, key in pins:
                    self.tier_index(tier).unpin([key])
                    if tier and key not in failed:
                        self._queue_up(key, tier)  # a hit from below: brought up into tier 0 (if admitted)
                for key in self._step_foreign.pop(step, []):
                    where = self._foreign_loads.pop(key, None)
                    if where is not None and self.foreign_tier and key not in failed:
                        self._queue_up(key, self.foreign_tier, *where)  # borrowed into tier 0 (if admitted)
            else:
                self._step_done_count[step] = n
        for key in list(self._bad):  # not trusted in any tier
            if not any(self.tier_index(t).is_pinned(key) for t in range(self.num_tiers)):
                self._bad.discard(key)
                dropped = [self.tier_index(t).drop(key) for t in range(self.num_tiers)]
                self._unwritable.discard(key)
                if any(dropped):
                    self._events.append(("removed", [key]))

    def take_events(self) -> list[tuple[str, list[bytes]]]:
        ev, self._events = self._events, []
        return ev

    def rebuild(self, entries: Mapping[int, bytes]) -> None:
        self.index.rebuild(entries)

    def capacity_used_bytes(self) -> int:
        return self.index.used_slots * self.slot_bytes
