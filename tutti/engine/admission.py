"""Which computed chunks a store takes at all: the admission policy beside the eviction policy.

Why a seam: a store that takes every chunk spends its writes (and evicts what it held) on
prompts seen once; whether a chunk is worth a slot is a research question (seen before, deep in a
shared prefix, a user's system prompt), and trying an answer should not mean editing the
planner. A policy sees one candidate at a time and says yes or no; what it declines is counted
in `PlannerStats.stores_declined` and computed again next time, as a miss.

    class MyAdmission:
        def admit(self, c: StoreCandidate) -> bool: ...

chosen by `store_admission` in the connector's config: "all" (the default: every chunk, tutti's
behaviour so far), "seen_twice" (a doorkeeper: a chunk is stored the second time it is computed),
a name given to `register_admission`, or "package.module:attr" (a class or a no-argument
factory).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from tutti.plugins import PolicyRegistry


@dataclass(frozen=True)
class StoreCandidate:
    """One chunk vLLM just computed that the store does not hold."""

    key: bytes  # the chunk's identity (its whole prefix, tutti.engine.keys)
    req_id: str
    chunk: int  # its index among the request's chunks
    prompt_chunks: int  # whole chunks of the request's prompt: a chunk past them holds generated tokens
    state: bool  # a state entry of a hybrid model (Mamba/linear attention), not attention KV
    resident: int  # chunks the store holds now
    capacity: int  # chunks it can hold


class AdmissionPolicy(Protocol):
    def admit(self, c: StoreCandidate) -> bool: ...


class AdmitAll:
    """Every chunk (tutti's behaviour before the seam)."""

    name = "all"

    def admit(self, c: StoreCandidate) -> bool:
        return True


class SeenTwice:
    """A doorkeeper: a chunk is stored the second time it is computed within the last `memory`
    distinct chunks, so a scan of one-off prompts writes nothing and evicts nothing."""

    name = "seen_twice"

    def __init__(self, memory: int = 1 << 16) -> None:
        self.memory = memory
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def admit(self, c: StoreCandidate) -> bool:
        if c.key in self._seen:
            del self._seen[c.key]
            return True
        self._seen[c.key] = None
        while len(self._seen) > self.memory:
            self._seen.popitem(last=False)
        return False


_REGISTRY = PolicyRegistry("store_admission", "register_admission", {"all": AdmitAll, "seen_twice": SeenTwice},
                           ("admit",), doc="tutti.engine.admission")
register_admission = _REGISTRY.register  # (name, class or no-argument factory): choosable as store_admission
available_admissions = _REGISTRY.names
get_admission = _REGISTRY.get  # a new policy from a name or module:attr; an object with admit passes through
