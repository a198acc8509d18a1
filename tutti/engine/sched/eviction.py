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

chosen by `eviction_policy` in the connector's config: "lru" (the default), "fifo", a name given
to `register_eviction`, or "package.module:attr" (a class or a no-argument factory).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Protocol

from tutti.plugins import PolicyRegistry


class EvictionPolicy(Protocol):
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


_REGISTRY = PolicyRegistry("eviction_policy", "register_eviction", {"lru": LRU, "fifo": FIFO},
                           ("inserted", "touched", "removed", "order"), fresh=True, doc="tutti.engine.sched.eviction")
register_eviction = _REGISTRY.register  # (name, class or no-argument factory): choosable as eviction_policy
available_evictions = _REGISTRY.names
get_eviction = _REGISTRY.get  # a new policy object each time: each index needs its own order
