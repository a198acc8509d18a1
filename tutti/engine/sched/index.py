"""The chunk index: which chunks are resident in which slots, with pins; the order in which a
full store evicts them is its eviction policy's (tutti.engine.sched.eviction, LRU by default).

It runs in the scheduler's process and owns slot allocation; workers only move bytes into the
slots it names. A store is pending (invisible to lookups) until `commit`, and a pinned chunk
(being loaded) is never evicted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from tutti.engine.sched.eviction import LRU, EvictionPolicy


#: dirty chunks a full store looks past for a clean one to evict
DIRTY_SCAN = 64


@dataclass(frozen=True)
class StoreReservation:
    """Slots reserved for a batch of new chunks, and the resident chunks evicted to make room."""

    slots: dict[bytes, int]
    evicted: list[bytes] = field(default_factory=list)
    declined: list[bytes] = field(default_factory=list)  # no slot could be freed (all pinned)


class ChunkIndex:
    def __init__(self, num_slots: int, eviction: EvictionPolicy | None = None) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots={num_slots}: the capacity holds no chunk; raise capacity_bytes")
        self.num_slots = num_slots
        self.eviction = eviction if eviction is not None else LRU()
        self._resident: dict[bytes, int] = {}
        self._pending: dict[bytes, int] = {}
        self._pins: Counter[bytes] = Counter()
        # Free slots: those released below the high-water mark, plus every slot from `_next` on,
        # never handed out: memory follows the chunks stored, not the capacity (a 2000 TiB store
        # costs nothing until it fills).
        self._free: list[int] = []
        self._next = 0
        self.evictions = 0
        # Chunks no tier below holds yet (tutti.engine.sched.tiers, write_policy "back"): a full
        # store gives up a clean chunk before a dirty one (None: every chunk is clean)
        self.dirty: Callable[[bytes], bool] | None = None
        # never a dirty one: a store that finds only dirty chunks near the evicting end is declined
        # (write-through keeps what waits for its write-down rather than lose it to a new chunk)
        self.keep_dirty = False

    # -- queries -------------------------------------------------------------------------
    def __contains__(self, key: bytes) -> bool:
        return key in self._resident

    def __len__(self) -> int:
        return len(self._resident)

    def keys(self) -> list[bytes]:
        """The resident chunks, in the order they became resident."""
        return list(self._resident)

    def slot_of(self, key: bytes) -> int | None:
        return self._resident.get(key)

    def is_pending(self, key: bytes) -> bool:
        return key in self._pending

    @property
    def used_slots(self) -> int:
        return len(self._resident) + len(self._pending)

    def lookup_prefix(self, keys: Sequence[bytes], touch: bool = True) -> int:
        """Length of the longest run of resident chunks at the start of `keys`. Touched tail
        first, so a prefix's first chunk ends up the most recently used of them: a hit needs
        every chunk before the ones it loads, and a policy by recency then gives up a prefix
        from its end (touched head first, LRU evicted its first chunk first, and the rest of
        the prefix stayed resident with no hit able to reach it)."""
        n = 0
        for key in keys:
            if key not in self._resident:
                break
            n += 1
        if touch:
            self.touch_prefix(keys[:n])
        return n

    def touch_prefix(self, keys: Sequence[bytes], *, use: bool = True) -> None:
        """A hit used these chunks of one prefix (in prefix order): touched tail first. With `use`
        False, a lookup vLLM repeated for a request still waiting: refreshed (recency, not one
        more use) where the policy tells the two apart (`refreshed`), else left as they are."""
        touch = self.eviction.touched if use else getattr(self.eviction, "refreshed", None)
        if touch is None:
            return
        for key in reversed(keys):
            if key in self._resident:
                touch(key)

    # -- pins ----------------------------------------------------------------------------
    def pin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if key not in self._resident:
                raise KeyError(f"cannot pin chunk {key.hex()[:16]}: not resident")
            self._pins[key] += 1

    def unpin(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            if self._pins[key] <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] -= 1

    def is_pinned(self, key: bytes) -> bool:
        return self._pins.get(key, 0) > 0

    # -- stores --------------------------------------------------------------------------
    def plan_store(self, keys: Sequence[bytes], evictable: Callable[[bytes], bool] | None = None) -> StoreReservation:
        """Reserve one slot per new key, evicting unpinned LRU chunks as needed.

        Keys already resident or pending are not reserved again. Keys for which nothing can
        be evicted (everything pinned or pending) are declined, never forced.
        """
        slots: dict[bytes, int] = {}
        evicted: list[bytes] = []
        declined: list[bytes] = []
        for key in keys:
            if key in self._resident or key in self._pending or key in slots:
                continue
            if not self._free and self._next < self.num_slots:
                self._free.append(self._next)
                self._next += 1
            if not self._free:
                victim = self._victim(evictable)
                if victim is None:
                    declined.append(key)
                    continue
                self._free.append(self._resident.pop(victim))
                self.eviction.removed(victim)
                evicted.append(victim)
                self.evictions += 1
            slot = self._free.pop()
            self._pending[key] = slot
            slots[key] = slot
        return StoreReservation(slots, evicted, declined)

    def _victim(self, evictable: Callable[[bytes], bool] | None = None) -> bytes | None:
        """The first unpinned resident chunk in eviction order; with `dirty`, the first clean one
        among the next DIRTY_SCAN, else the first dirty one (its eviction loses it; None with
        `keep_dirty`). `evictable`:
        only chunks it accepts, among the next DIRTY_SCAN (None: none found)."""
        fallback = None
        scanned = 0
        for k in self.eviction.order():
            if k not in self._resident or self.is_pinned(k):
                continue
            if evictable is not None:
                if evictable(k):
                    return k
                scanned += 1
                if scanned >= DIRTY_SCAN:
                    return None
                continue
            if self.dirty is None or not self.dirty(k):
                return k
            if fallback is None:
                fallback = k
            scanned += 1
            if scanned >= DIRTY_SCAN:
                break
        return None if self.keep_dirty else fallback

    def commit(self, key: bytes) -> bool:
        """Make a pending store resident (most recently used). False if it was not pending."""
        slot = self._pending.pop(key, None)
        if slot is None:
            return False
        self._resident[key] = slot
        self.eviction.inserted(key)
        return True

    def abort(self, key: bytes) -> bool:
        """Drop a pending store and free its slot. False if it was not pending."""
        slot = self._pending.pop(key, None)
        if slot is None:
            return False
        self._free.append(slot)
        return True

    def drop(self, key: bytes) -> bool:
        """Remove a resident chunk (found corrupt, say) and free its slot."""
        if key in self._resident and not self.is_pinned(key):
            self._free.append(self._resident.pop(key))
            self.eviction.removed(key)
            return True
        return False

    # -- start-up ------------------------------------------------------------------------
    def rebuild(self, entries: Mapping[int, bytes]) -> None:
        """Load resident chunks from the store's journal (slot -> key), in the order they were
        stored (the journal's): the oldest first to evict, and a prefix's chunks, stored tail
        first, still given up from their end after a restart."""
        if self._resident or self._pending:
            raise RuntimeError("rebuild() needs an empty index")
        taken = set()
        for slot, key in entries.items():
            if 0 <= slot < self.num_slots and key not in self._resident:
                self._resident[key] = slot
                self.eviction.inserted(key)
                taken.add(slot)
        self._next = max(taken) + 1 if taken else 0
        self._free = [s for s in range(self._next - 1, -1, -1) if s not in taken]  # holes: pop() gives the lowest

    def check_invariants(self) -> None:
        """Every slot is in exactly one of free, resident or pending (used by tests)."""
        seen = list(self._free) + list(self._resident.values()) + list(self._pending.values())
        assert self._next <= self.num_slots and sorted(seen) == list(range(self._next)), "slot accounting broken"
