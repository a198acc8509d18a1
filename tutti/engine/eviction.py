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
from typing import Callable, Iterable, Protocol

from tutti.plugins import resolve_name


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


_REGISTRY: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "fifo": FIFO}


def register_eviction(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make `name` choosable as `eviction_policy` (a class or a no-argument factory)."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"register_eviction: name={name!r}: expected a non-empty name without ':'")
    _REGISTRY[name] = factory


def available_evictions() -> list[str]:
    return sorted(_REGISTRY)


def get_eviction(spec) -> EvictionPolicy:
    """A new policy object from `eviction_policy` (each index needs its own order)."""
    factory, _ = resolve_name(spec, "eviction_policy", _REGISTRY)
    if not callable(factory):
        raise ValueError(f"eviction_policy={spec!r}: not a class or factory of a policy")
    pol = factory()
    missing = [m for m in ("inserted", "touched", "removed", "order") if not callable(getattr(pol, m, None))]
    if missing:
        raise ValueError(f"eviction_policy={spec!r}: its policy has no {', '.join(missing)} method(s) "
                         "(tutti.engine.eviction says what a policy implements)")
    return pol
