"""The tiers below the first (the `tiers` key): each with its own index (capacity, eviction
policy), the write-downs that fill them and the promotions that bring a hit back up.

Tier 0 is the planner's own `index`: the fastest (RAM), where every new chunk lands. With
write_policy "through", a chunk committed in tier t is copied down to tier t + 1 by the worker's
copier, off the forward thread (tutti.engine.worker.tiers). With "back", a chunk is copied down
only when it nears the evicting end of its full tier (the next BACK_AHEAD share of its slots in
eviction order, or twice the most chunks a recent step stored, whichever is more) and admission
agrees it is worth a drive write: a working set that fits the tier never writes the drive.

Either way a full tier gives up clean chunks (held below) before dirty ones. Under "through" a
dirty chunk is one whose write-down has not come yet (a drive slower than the stores, or a
restart's backlog: reconcile_tiers), and it is kept: a new store that finds nothing clean near
the evicting end is declined (counted), never a stored chunk lost; one whose write-down failed
may go. Under "back" a dirty chunk it must give up anyway is counted as dropped. A chunk a hit
loaded from a lower tier is copied up into tier 0 when tier 0's admission agrees (a promotion),
only ever in place of a chunk a tier below holds, and only while no write-down is queued or in
flight (promotions yield to write-downs: in bench/drive_sim.py's model of the 70B-class tiers,
promoting regardless served up to 7% less). A hit on another writer's chunk (followed in the last
tier's roots: replicas with private RAM tiers over one shared drive) is promoted the same way,
into this writer's tier 0 ("borrowed": its owner holds it below, so it is never written down and
never counted dropped).

The source of a copy is pinned until the copy is reported, so a chunk is never evicted while its
write-down is in flight; write-downs in flight are bounded (DOWN_IN_FLIGHT), so a drive slower
than the stores never fills a tier with pins (the rest wait their turn, and one given up before
it is counted as dropped). A chunk is announced ("stored") when the first tier takes it and
withdrawn ("removed") when the last tier gives it up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tutti.engine.plan import CopyChunk, StepPlan
from tutti.engine.sched.admission import AdmitAll, StoreCandidate
from tutti.engine.sched.index import ChunkIndex
from tutti.engine.sched.requests import StoreTicket

log = logging.getLogger("tutti.engine")

WRITE_POLICIES = ("through", "back")
#: write_policy "back": the share of a full tier's slots, at its evicting end, kept written down
BACK_AHEAD = 1 / 16
#: the share of a tier's slots its write-downs in flight may hold pinned (at least DOWN_IN_FLIGHT_MIN
#: chunks): where the drive writes slower than the tier stores, the rest wait their turn unpinned
#: (the oldest first), so new stores still find room, and a chunk given up before its turn is
#: counted as dropped
DOWN_IN_FLIGHT = 1 / 8
DOWN_IN_FLIGHT_MIN = 16
#: promote "stage": the longest a request waits for its hit's chunks to reach the first tier before
#: it loads them from where they are (a copier far behind must not hold a request back for long)
STAGE_WAIT_S = 5.0
#: ... and the longest one whose chunks are up waits for its whole sequence to fit vLLM's free
#: blocks (`_waits_for_blocks`): past it, vLLM decides. Long, because on vLLM 0.26 a request that
#: is answered and does not fit can stall the scheduler (results/sched_stall.md), where waiting
#: only delays this one request while the others run and free their blocks
STAGE_FIT_WAIT_S = 60.0


@dataclass
class LowerTier:
    """One tier below the first: its slots and the order it evicts them in."""

    index: ChunkIndex
    name: str = ""


@dataclass
class TierStats:
    """Counters per tier (index: the tier), kept apart from PlannerStats' totals."""

    hit_tokens: list[int]  # tokens hits loaded from this tier (another writer's chunks: from the tier it is followed in)
    evictions: list[int]
    writedowns: list[int]  # copies committed into this tier from the one above
    promotions: int = 0  # copies committed into tier 0 from a lower tier
    dropped: int = 0  # write-downs that failed or found no room below (the chunk left its tier unwritten)
    hit_bytes: list[int] = field(default_factory=list)  # bytes hits loaded from this tier
    borrowed: int = 0  # of the promotions, other writers' chunks (read from their files in the shared tier)
    staged_hits: int = 0  # hits whose lower-tier chunks were copied up before they loaded (promote "stage")

    @classmethod
    def new(cls, n: int) -> "TierStats":
        return cls([0] * n, [0] * n, [0] * n, hit_bytes=[0] * n)

    def copy(self) -> "TierStats":
        return TierStats(list(self.hit_tokens), list(self.evictions), list(self.writedowns), self.promotions,
                         self.dropped, list(self.hit_bytes), self.borrowed, self.staged_hits)


class TierPlanning:
    """Planner's tier half (a mixin over the state Planner.__init__ sets: `lower`, `write_policy`,
    `tier_stats`, `_down`, `_up`, `_copy_pins`)."""

    # -- where a chunk is -----------------------------------------------------------------
    def tier_index(self, tier: int) -> ChunkIndex:
        return self.index if tier == 0 else self.lower[tier - 1].index

    @property
    def num_tiers(self) -> int:
        return 1 + len(self.lower)

    def _in_lower(self, key: bytes, below: int = 0) -> tuple[int, int] | None:
        """(tier, slot) of the first tier below `below` holding `key`, or None."""
        for t, tier in enumerate(self.lower[below:], below + 1):
            slot = tier.index.slot_of(key)
            if slot is not None:
                return t, slot
        return None

    def held_anywhere(self, key: bytes, but: int = -1) -> bool:
        """Some tier other than `but` holds `key` (resident)."""
        return any(key in self.tier_index(t) for t in range(self.num_tiers) if t != but)

    def _removed(self, tier: int, keys: list[bytes]) -> None:
        """`tier` evicted `keys`: counted, and withdrawn from routers where no other tier holds them."""
        if not keys:
            return
        self.tier_stats.evictions[tier] += len(keys)
        gone = [k for k in keys if not self.held_anywhere(k, but=tier)]
        if gone:
            self._events.append(("removed", gone))
            if self.write_policy == "back" and tier < len(self.lower):
                # dirty: it left the hierarchy unwritten (a borrowed chunk's owner holds it below)
                self.tier_stats.dropped += sum(1 for k in gone if k not in self._borrowed)
        if tier == 0 and self._borrowed:
            self._borrowed.difference_update(keys)
        if self._unwritable:
            self._unwritable.difference_update(keys)

    # -- pricing a hit across tiers -------------------------------------------------------
    def _reaches_lower(self, r) -> bool:
        """The request's hit, as found, takes a chunk from a tier below the first."""
        return bool(self.lower) and any(t for _, _, t in r.hit_sources)

    def _tiered_take(self, r, take: int, found: int, prompt: int, max_load: int | None, computed: int,
                     batch: int, queued: int | None = None) -> int:
        """The tokens to load of a hit that reaches into a lower tier: its leading run in the first
        tier as the policy chose at that tier's rate (`take`, cut to the run), plus as much of the
        rest as the policy chooses at the lower tiers' measured rate (`lower_meter`) behind the
        loads queued for the lower tiers alone. So a hit loads its RAM part, then what the drive
        delivers in time. The RAM part is not priced at the drive's rate, nor does a queue of RAM
        loads count as a wait for the drive: the two read apart (each tier its own queue), and
        pricing both at the drive's rate recomputed hits the drive had time for. `queued`: the lower
        tiers' load bytes queued ahead (default: as planned)."""
        fast = 0
        for source, _, tier in r.hit_sources:
            if tier or source is not None:
                break
            fast += 1
        run = max(0, fast * self.chunk_tokens - computed)
        ram = min(take, run)
        if ram < run or run >= found:  # the policy cut the RAM run itself: nothing below is worth more
            return ram
        rest = self._choose(found - run, prompt - run, None if max_load is None else max(0, max_load - run),
                            context=computed + run, batch=batch,
                            queued=self._queued_load_bytes(lower=True) if queued is None else queued,
                            meter=self.lower_meter)
        return run + rest

    # -- staging a hit (promote "stage") --------------------------------------------------
    def _begin_stage(self, r) -> bool:
        """Copy the hit's chunks held only below up into the first tier before it loads: vLLM
        holds no GPU blocks for a request whose lookup says "later", where a hit that loaded from
        the drive would hold them idle for the whole read (vLLM's own tiering does the same). The
        copy is also the hit's promotion, so the drive is read once. True: wait for it."""
        keys = []
        for key, (source, _, tier) in zip(r.keys, r.hit_sources[:r.hit_chunks]):
            if not tier or source is not None:  # (another writer's chunk loads from its files)
                continue
            if key not in self.index and not self.index.is_pending(key):
                self._stage.append((key, tier))
            keys.append(key)
        r.staging, r.staging_since = tuple(keys), time.monotonic()
        if keys:
            self.tier_stats.staged_hits += 1
        return bool(keys)

    def _short_of_blocks(self, r) -> bool:
        """vLLM's GPU blocks are short: the requests in flight (their distinct blocks) and the hit
        would hold more than `stage_pressure` of them (the key's doc says why). Unknown total: short."""
        if self._block_refs is None or self.stage_pressure <= 0:
            return True
        hit = max(0, r.hit_chunks * self.chunk_tokens - r.local_computed) // self.block_size
        return len(self._block_refs) + hit > self.stage_pressure * self.gpu_blocks

    def _waits_for_blocks(self, r, n_tokens: int, computed: int) -> bool:
        """A staged request whose chunks are up waits on (within STAGE_FIT_WAIT_S) while its whole
        sequence would not fit in the blocks the requests in flight leave: those they hold, and
        those their prompts still need (vLLM reserves them). Answered now, vLLM would
        fail its allocation and stop taking waiting requests at it, where a "later" makes vLLM pass
        over it. vLLM 0.26 keeps deferred requests in one queue with loaded ones: stopped at a
        deferred request, it strands the loaded ones behind it, holding their blocks, and with
        nothing running nothing frees any (vllm-project/vllm#57841; 0.31 and later take the
        requests holding blocks first; scripts/sched_stall.py shows it on 0.26's scheduler)."""
        if self._block_refs is None or time.monotonic() - r.staging_since > STAGE_FIT_WAIT_S:
            return False
        need = -(-n_tokens // self.block_size) - computed // self.block_size
        # what the requests in flight hold and still need: kept as vLLM reports blocks (steps.py)
        return need + self._reserved_blocks > self.gpu_blocks - 1 - len(self._block_refs)  # (vLLM's null block is never free)

    def _stage_pending(self, r) -> bool:
        """Some of the request's staged chunks are still on their way up (queued or copying), and
        it has waited less than STAGE_WAIT_S: a copy that found no room, failed or is late leaves
        the chunk where it was, and the hit loads it from there."""
        if time.monotonic() - r.staging_since > STAGE_WAIT_S:
            return False
        queued = {key for key, _ in self._stage}
        return any(key in queued or self.index.is_pending(key) for key in r.staging)

    # -- planning copies ------------------------------------------------------------------
    def reconcile_tiers(self) -> int:
        """After a restart (the indexes rebuilt from the journals): with write_policy "through",
        queue the write-down of every chunk a tier holds and the next one down does not (a
        server killed before its copies were done), so no tier gives one up unwritten. Returns
        how many were queued ("back" finds them dirty by itself)."""
        if self.write_policy != "through":
            return 0
        n = 0
        for t in range(len(self.lower)):
            below = self.tier_index(t + 1)
            for key in self.tier_index(t).keys():
                if key not in below:
                    self._down.append((key, t))
                    n += 1
        return n

    def _queue_down(self, key: bytes, tier: int) -> None:
        """`key` was committed in `tier`: copy it to the next tier down (write-through)."""
        if tier < len(self.lower) and self.write_policy == "through":
            self._down.append((key, tier))

    def _queue_up(self, key: bytes, tier: int, source: str | None = None, slot: int = -1) -> None:
        """A hit loaded `key` from lower tier `tier` (another writer's store there, at `slot`, where
        `source` names that writer): promote it into tier 0 (if admitted; never with promote off)."""
        if tier > 0 and self.promote:
            self._up.append((key, tier, source, slot))

    def _plan_copies(self, plan: StepPlan) -> None:
        """The step's write-downs and promotions, planned before its stores evict anything."""
        if self.write_policy == "back":
            for t in range(len(self.lower)):
                self._clean_ahead(t)
        # staged hits first: a request waits for them (only in place of a chunk a tier below holds;
        # _plan_copy skips one already up or on its way)
        stage, self._stage = list(dict.fromkeys(self._stage)), []
        for key, src in stage:
            self._plan_copy(plan, key, src, 0)
        down, self._down = list(dict.fromkeys(self._down)), []
        up, self._up = self._up, []
        for n, (key, src) in enumerate(down):
            cap = max(DOWN_IN_FLIGHT_MIN, int(self.tier_index(src).num_slots * DOWN_IN_FLIGHT))
            if self._down_in_flight[src] >= cap:
                self._down = down[n:]  # their turn comes as copies are reported
                break
            self._plan_copy(plan, key, src, src + 1)
        if self._down or any(self._down_in_flight):
            # promotions yield to write-downs: a promotion reads the drive and takes a slot only a
            # clean chunk leaves, both short while chunks wait for their write-down (new stores
            # were declined for it); the hit's chunk is in vLLM's GPU cache anyway, so it is let go
            up = []
        for key, src, source, slot in dict.fromkeys(up):
            if key in self.index or self.index.is_pending(key):
                continue
            if source is not None:  # another writer's: only while its owner still holds it where it was read
                held = self.foreign.get(key) if self.foreign is not None else None
                if held is None or tuple(held[:2]) != (source, slot):
                    continue  # its owner gave it up (or moved it) since the hit: nothing to borrow
            if not isinstance(self.admission, AdmitAll) and not self._promote_admitted(key):
                continue
            self._plan_copy(plan, key, src, 0, source=source, src_slot=slot)

    def _clean_ahead(self, tier: int) -> None:
        """write_policy "back": once `tier` is nearly full, queue the write-down of the dirty
        chunks at its evicting end (the next BACK_AHEAD of its slots, or two recent steps' stores)
        that admission finds worth a drive write, so that when it evicts them they are held below."""
        index = self.tier_index(tier)
        ahead = min(index.num_slots, max(1, int(index.num_slots * BACK_AHEAD), 2 * self._burst))
        if index.used_slots + ahead < index.num_slots:
            return  # room left: nothing is evicted soon, nothing is written
        seen = 0
        for key in index.eviction.order():
            if seen >= ahead:
                break
            if key not in index or index.is_pinned(key):
                continue
            seen += 1
            if not self._held_below(key, tier) and self._worth_writing(key):
                self._down.append((key, tier))

    def _dirty(self, tier: int):
        """`tier`'s chunks held nowhere below, nor being written there (ChunkIndex.dirty): a full
        tier gives them up last."""
        return lambda key: not self._held_below(key, tier) and key not in self._unwritable and not any(
            self.tier_index(t).is_pending(key) for t in range(tier + 1, self.num_tiers))

    def _held_below(self, key: bytes, tier: int) -> bool:
        """A tier below `tier` holds `key`, or (tier 0) its owner does: a promotion may take its place."""
        return self._in_lower(key, below=tier) is not None or (tier == 0 and key in self._borrowed)

    def _worth_writing(self, key: bytes) -> bool:
        return isinstance(self.admission, AdmitAll) or self._promote_admitted(key)

    def _promote_admitted(self, key: bytes) -> bool:
        cand = StoreCandidate(key=key, req_id="", chunk=0, prompt_chunks=1, state=False, resident=len(self.index),
                              capacity=self.index.num_slots, first_key=key, counters=self.stats)
        try:
            return bool(self.admission.admit(cand))
        except Exception:  # noqa: BLE001 - a research policy's bug costs its promotions, never the step
            log.exception("tutti: store admission %r failed on a promotion; promoting", self.admission)
            return True

    def _plan_copy(self, plan: StepPlan, key: bytes, src: int, dst: int, *, source: str | None = None,
                   src_slot: int | None = None) -> None:
        s_index, d_index = self.tier_index(src), self.tier_index(dst)
        if source is None:
            src_slot = s_index.slot_of(key)
        if key in d_index or d_index.is_pending(key):
            return  # already there
        if src_slot is None:  # given up (evicted before its turn, or dropped as corrupt)
            if dst > src and self.write_policy == "through" and not self.held_anywhere(key, but=src):
                self.tier_stats.dropped += 1
            return
        # a promotion only ever takes the place of a chunk a tier below holds: never the only copy
        res = d_index.plan_store([key], evictable=(lambda k: self._held_below(k, dst)) if dst < src else None)
        if dst == 0:
            self.stats.evictions += len(res.evicted)
        self._removed(dst, list(res.evicted))
        slot = res.slots.get(key)
        if slot is None:  # every slot below is pinned or pending: the chunk is not written down
            if dst > src and self.write_policy == "through":  # ("back": counted if it is evicted unwritten)
                self.tier_stats.dropped += 1
                self._unwritable.add(key)
            return
        if source is None:  # (another writer's chunk is its owner's: a copy of it checks it is still there)
            s_index.pin([key])
        if dst > src:
            self._down_in_flight[src] += 1
        else:
            self._up_in_flight += 1
        ticket = next(self._ticket_ids)
        self._tickets[ticket] = StoreTicket(key, "", copy=(src, dst), borrowed=source is not None)
        plan.copies.append(CopyChunk(key, src, src_slot, dst, slot, ticket, source=source))

    # -- reports --------------------------------------------------------------------------
    def _copy_done(self, tk: StoreTicket, ok: bool) -> None:
        """A copy reported by every writer (ok) or failed by one: commit or abort it below, and
        let its source go."""
        src, dst = tk.copy
        if not tk.borrowed:
            self.tier_index(src).unpin([tk.key])
        if dst > src:
            self._down_in_flight[src] -= 1
        else:
            self._up_in_flight -= 1
        d_index = self.tier_index(dst)
        if not ok:
            d_index.abort(tk.key)
            if dst > src and self.write_policy == "through":  # ("back": counted if it is evicted unwritten)
                self.tier_stats.dropped += 1
                self._unwritable.add(tk.key)  # not kept for a write-down that will not come
            return
        if not d_index.commit(tk.key):
            return
        if dst > src:
            self.tier_stats.writedowns[dst] += 1
            self._queue_down(tk.key, dst)
        else:
            self.tier_stats.promotions += 1
            self.tier_stats.borrowed += tk.borrowed
            if tk.borrowed and not self.held_anywhere(tk.key, but=0):
                self._borrowed.add(tk.key)
                self._events.append(("stored", [tk.key]))  # this writer serves it now too
