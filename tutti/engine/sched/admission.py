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
"drive_share" (whole prefixes, fewer of them while the drive is the bottleneck), a name given to
`register_admission`, or "package.module:attr" (a class or a no-argument factory).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from tutti.plugins import Registry


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
    first_key: bytes = b""  # the key of the request's first chunk: its prefix's root (whole-prefix decisions)
    counters: Any = None  # the planner's cumulative PlannerStats (read only): a policy adapting to pressure reads deltas


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


class DriveShare:
    """Whole prefixes, and fewer of them while the drive is the bottleneck.

    Why: on a drive slower than prefill, every prefix written once can already fill it (a loaded
    H200 over a 1.6 GB/s disk: 26 GB of writes and 16 GB of reads in 23 s: results/serve.md, serve/2026-12-03_reads_first.json); the
    hits' reads then get what is left, and the hit policy recomputes the rest by choice, so those
    chunks' writes bought nothing. Writing a share of the prefixes leaves their reads the drive.

    A prefix is admitted when a hash of its first chunk's key falls below the share, so every
    request of one prefix decides alike (a stored prefix stays whole and hittable), and a request
    once declined stays declined (no chunk stored after a hole). The share falls by `cut` (to
    `floor` at least) after an interval in which stores were skipped (the drive does not keep up
    with the writes), and rises by `rise` (to 1) after one without: on a RAM root, or a drive that
    keeps up, it stays 1 and admits everything. Hits recomputed by choice while stores were
    written do not cut it: in `bench/drive_sim.py`'s model that trigger fired on
    drives that keep up and cost 1-2% against admitting everything at 2.5-3.5 GB/s, and without it
    the policy does as well at 0.8 GB/s and better at 1.7-3.5 (results/drive_sim.md, `drive_sim_skip_trigger.json`).
    """

    name = "drive_share"

    def __init__(self, floor: float = 0.25, cut: float = 0.8, rise: float = 0.05, interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, memory: int = 1 << 14) -> None:
        if not 0 < floor <= 1 or not 0 < cut < 1 or not 0 < rise <= 1 or interval_s <= 0:
            raise ValueError(f"DriveShare(floor={floor}, cut={cut}, rise={rise}, interval_s={interval_s}): expected "
                             "0 < floor <= 1, 0 < cut < 1, 0 < rise <= 1 and interval_s > 0")
        self.floor, self.cut, self.rise, self.interval_s = floor, cut, rise, interval_s
        self.share = 1.0
        self._clock = clock
        self._mark: tuple[float, int, int, int] | None = None  # (time, skipped, declined hit tokens, committed)
        self._decided: OrderedDict[str, bool] = OrderedDict()  # per request, the last `memory`
        self.memory = memory

    def _update(self, counters: Any) -> None:
        if counters is None:
            return
        now = self._clock()
        cur = (counters.stores_skipped, counters.declined_hit_tokens, counters.stores_committed)
        if self._mark is None:
            self._mark = (now, *cur)
            return
        if now - self._mark[0] < self.interval_s:
            return
        skipped = cur[0] - self._mark[1]
        if skipped > 0:
            self.share = max(self.floor, self.share * self.cut)
        else:
            self.share = min(1.0, self.share + self.rise)
        self._mark = (now, *cur)

    @staticmethod
    def position(key: bytes) -> float:
        """Where a prefix falls in [0, 1): its first chunk's key is already a keyed hash."""
        return int.from_bytes(key[:8].ljust(8, b"\0"), "little") / 2.0 ** 64

    def admit(self, c: StoreCandidate) -> bool:
        self._update(c.counters)
        known = self._decided.get(c.req_id)
        if known is False:
            return False
        ok = self.position(c.first_key or c.key) < self.share
        if known is None or not ok:
            self._decided[c.req_id] = ok
            self._decided.move_to_end(c.req_id)
            while len(self._decided) > self.memory:
                self._decided.popitem(last=False)
        return ok


_REGISTRY = Registry("store_admission", "register_admission",
                     {"all": AdmitAll, "seen_twice": SeenTwice, "drive_share": DriveShare},
                     ("admit",), doc="tutti.engine.sched.admission")
register_admission = _REGISTRY.register  # (name, class or no-argument factory): choosable as store_admission
available_admissions = _REGISTRY.names
get_admission = _REGISTRY.get  # a new policy from a name or module:attr; an object with admit passes through
