"""Which resident chunk a full store gives up first: the eviction policy behind ChunkIndex.

Why a seam: what to keep is a research question (recency, frequency, prefix depth, cost to
recompute), and trying an answer should not mean editing the index's slot accounting. A policy
only orders keys; the index keeps slots, pins and pending stores, and never evicts a pinned
chunk whatever the order says.

    class MyPolicy:
        def inserted(self, key: bytes) -> None: ...   # a chunk became resident
        def touched(self, key: bytes) -> None: ...    # a lookup hit it
        def removed(self, key: bytes) -> None: ...    # evicted or dropped
        def order(self) -> Iterable[bytes]: ...       # every resident key, the first to evict first

chosen by `eviction_policy` in the connector's config: "lru" (the default), "fifo", "lfuda" (a
frequency-aware, scan-resistant order: `LFUDA`), a name given to `register_eviction`, or
"package.module:attr" (a class or a no-argument factory).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable, Protocol

from tutti.plugins import Registry


class EvictionPolicy(Protocol):
    """`refreshed(key)`, optional: a lookup vLLM repeated for a request still waiting for
    blocks; recency only, not one more use. A policy without it is left as it is then."""

    def inserted(self, key: bytes) -> None: ...
    def touched(self, key: bytes) -> None: ...
    def removed(self, key: bytes) -> None: ...
    def order(self) -> Iterable[bytes]: ...


class LRU:
    """Least recently used first: a hit moves a chunk to the back (tutti's behaviour so far)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touched(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def refreshed(self, key: bytes) -> None:
        """Looked up again by a request still waiting (optional in a policy: recency only)."""
        self.touched(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def order(self) -> Iterable[bytes]:
        return iter(self._order)


class FIFO(LRU):
    """Oldest stored first, whatever was hit since: a scan of one-off prompts cannot keep a
    chunk alive by touching it."""

    name = "fifo"

    def touched(self, key: bytes) -> None:
        pass


class LFUDA:
    """Least frequently used first, with dynamic aging (LFU-DA): a chunk's priority is the
    store's age plus the number of times it was used; the lowest goes first, the least recently
    used among equals, and the store's age becomes the priority of what it gave up.

    Why frequency: a chunk's worth is how many requests share it, and a prefix workload is skewed
    (a few system prompts and documents, a long tail of prompts sent once). LRU lets every
    one-off prompt push a shared prefix out. Here a new chunk enters at the store's age plus one
    and a hit one holds its lead, so a scan of one-off prompts evicts its own kind (each other,
    and chunks no longer used), not what requests share, until the scan has turned the store
    over about as many times as the shared chunk was used. The age (the last evicted priority)
    rises as the store turns over, so a chunk that was popular once and is no longer used is
    caught up with and goes, without a periodic halving.

    Why not W-TinyLFU, S3-FIFO or ARC: they keep segments (a window, a probation queue, a ghost
    of the recent queue) each in its own order, and a prefix's head and tail can sit in different
    segments; the victim of one can then be a head whose tail stays in another, resident and out
    of every hit's reach. One order keeps the rule LRU keeps: every use of a chunk is a use of
    every chunk before it in its prefix (the index touches a prefix's resident run, tail first), so
    a head's count is at least its tail's and, equal, it was used later: its priority is never
    below its tail's, and the tail goes first (tests/engine/sched/test_lfuda.py).

    Counts: exact, for resident chunks and for the last `history` x (resident chunks) evicted
    ones (8 bytes of the key each: a keyed hash already), so a prefix that comes back is judged
    by its past. Cost: O(log n) per operation (a heap with stale entries skipped, rebuilt when
    they outnumber the live ones); a pinned chunk at the top of the order costs one sort of the
    rest.
    """

    name = "lfuda"

    def __init__(self, history: float = 2.0) -> None:
        if history < 0:
            raise ValueError(f"LFUDA(history={history}): expected history >= 0")
        self.history = history
        self._count: dict[bytes, int] = {}  # resident key -> uses
        self._prio: dict[bytes, tuple[int, int]] = {}  # resident key -> (priority, sequence): its live heap entry
        self._heap: list[tuple[int, int, bytes]] = []
        self._ghost: OrderedDict[int, int] = OrderedDict()  # evicted: the key's first 8 bytes -> uses, oldest first
        self._age = 0
        self._seq = 0

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: bytes) -> bool:
        return key in self._count

    @property
    def ghosts(self) -> int:
        return len(self._ghost)

    @staticmethod
    def _short(key: bytes) -> int:
        return int.from_bytes(key[:8], "little")

    def _use(self, key: bytes, count: int) -> None:
        self._count[key] = count
        self._seq += 1
        entry = (self._age + count, self._seq)
        self._prio[key] = entry
        heapq.heappush(self._heap, (*entry, key))
        if len(self._heap) > 2 * len(self._prio) + 64:  # drop the stale entries
            self._heap = [(*e, k) for k, e in self._prio.items()]
            heapq.heapify(self._heap)

    def inserted(self, key: bytes) -> None:
        if key in self._count:
            self.touched(key)
            return
        self._use(key, self._ghost.pop(self._short(key), 0) + 1)

    def touched(self, key: bytes) -> None:
        if key in self._count:
            self._use(key, self._count[key] + 1)

    def refreshed(self, key: bytes) -> None:
        """A lookup vLLM repeated for a request still waiting: the latest among its equals, not
        one more use (a request that waits does not make its prefix more shared)."""
        if key in self._count:
            self._use(key, self._count[key])

    def removed(self, key: bytes) -> None:
        count = self._count.pop(key, None)
        if count is None:
            return
        prio = self._prio.pop(key)
        self._age = max(self._age, prio[0])
        if self.history:
            short = self._short(key)
            self._ghost.pop(short, None)
            self._ghost[short] = count
            while len(self._ghost) > self.history * max(len(self._count), 1):
                self._ghost.popitem(last=False)

    def _top(self) -> bytes | None:
        while self._heap:
            prio, seq, key = self._heap[0]
            if self._prio.get(key) == (prio, seq):
                return key
            heapq.heappop(self._heap)
        return None

    def order(self) -> Iterable[bytes]:
        top = self._top()
        if top is None:
            return
        yield top
        # the top was pinned: the rest in order (rare: a pinned chunk was used just now)
        yield from sorted((k for k in self._prio if k != top), key=self._prio.__getitem__)


_REGISTRY = Registry("eviction_policy", "register_eviction", {"lru": LRU, "fifo": FIFO, "lfuda": LFUDA},
                     ("inserted", "touched", "removed", "order"), fresh=True, doc="tutti.engine.sched.eviction")
register_eviction = _REGISTRY.register  # (name, class or no-argument factory): choosable as eviction_policy
available_evictions = _REGISTRY.names
get_eviction = _REGISTRY.get  # a new policy object each time: each index needs its own order
