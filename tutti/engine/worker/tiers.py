"""The worker's copies between its tiers (tutti.engine.sched.tiers plans them): a write-down of
a committed chunk from RAM to the drive below, or a promotion of a hit back up.

They run on a thread of their own, never the forward's: each copy reads the source slot whole
into one page-aligned buffer made at start-up and writes it to the destination slot (pread and
pwrite release the GIL, and O_DIRECT slabs take an aligned buffer), then commits it through the
destination store's one durability order (old contents freed before the write, data synced
before its journal record). The bytes are not checked on the way: the source's journaled
checksums (or keyed tags) go with them, and the load that serves the copy verifies them there.
A promotion of another writer's chunk (`CopyChunk.source`) reads that writer's store opened
read-only (tutti.engine.sharing.ForeignStores) and takes its checksums from that writer's
journal, before the read and again after it: a chunk its owner gave up or rewrote meanwhile is
not copied. Its bytes are as hostile as any other writer's: a copy whose checksums are wrong
fails its load from tier 0 like any corrupt chunk (recomputed, then dropped), never the step.
While a hit's reads are in flight on the drive, a copy's writes, and a promotion's reads of the
drive, wait for them (ReadsFirst), a slice at a time: a read done sooner saves prefill now, a copy
done later only delays a hit.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections import deque
from typing import Sequence

from tutti.engine.plan import CopyChunk
from tutti.engine.worker.writer import Writer

log = logging.getLogger("tutti.engine")

#: the longest a slice of a copy waits for hits' reads before it writes anyway (s)
MAX_YIELD_S = 0.05


class TierCopier:
    """Copies between this worker's tiers. `stores[t]` / `journals[t]`: tier t's store and its
    in-process journal view (tutti.engine.worker.context.JournalView); `reads`: the loads'
    tutti.io.queue.ReadsFirst (None: no drive shared with hits)."""

    def __init__(self, stores: Sequence, journals: Sequence, counters, *, slot_bytes: int, reads=None,
                 slice_bytes: int = 4 << 20, foreign=None, measure_reads: bool = False) -> None:
        self.stores, self.journals, self.counters = list(stores), list(journals), counters
        # promote "stage": a copy up is how a hit reads the drive, so its read measures the lower
        # tiers' rate the planner prices those hits by (there are few loads from below to do it)
        self.measure_reads = measure_reads
        self.foreign = foreign  # tutti.engine.sharing.ForeignStores: the other writers, for borrowed promotions
        self.slot_bytes, self.reads = slot_bytes, reads
        self.slice_bytes = max(4096, slice_bytes // 4096 * 4096)
        self._buf = mmap.mmap(-1, max(4096, -(-slot_bytes // 4096) * 4096))  # page-aligned, made once
        self._view = memoryview(self._buf)[:slot_bytes]
        self._thread = Writer("tutti-tiers")
        self._lock = threading.Lock()
        # copies not started yet: promotions (a request may be waiting for them) go before write-downs
        self._up: deque[CopyChunk] = deque()
        self._down: deque[CopyChunk] = deque()
        self.copied = [0] * len(self.stores)  # chunks copied into each tier
        self.failed = 0

    @property
    def pending(self) -> int:
        return self._thread.pending

    def submit(self, copies: Sequence[CopyChunk]) -> None:
        """Queue the step's copies (the planner holds both slots until they are reported). A
        promotion goes ahead of every write-down not started yet: a staged hit's request waits for
        it (promote "stage"), while a write-down done later only delays a later eviction."""
        for c in copies:
            self.journals[c.dst].drop(c.dst_slot)  # its old contents are gone from now on
        with self._lock:
            for c in copies:
                (self._up if c.dst < c.src else self._down).append(c)
        for _ in copies:
            self._thread.submit(self._next)

    def _next(self) -> None:
        """Run the first copy waiting, a promotion if any, else the oldest write-down, and report it."""
        with self._lock:
            queue = self._up or self._down
            if not queue:
                return
            c = queue.popleft()
        t0 = time.perf_counter()
        try:
            read_s = self._copy(c)
        except Exception as exc:  # noqa: BLE001 - a copy fails alone: the chunk stays where it was
            self.failed += 1
            log.warning("tutti: copy of chunk %s from tier %d to tier %d failed: %s", c.key.hex()[:16], c.src,
                        c.dst, exc)
            self.counters.record(store_failed=[c.ticket])
            return
        self.copied[c.dst] += 1
        rate = {}
        if self.measure_reads and c.dst < c.src and read_s > 0:
            rate = {"lower_rate_bytes": self.slot_bytes, "lower_rate_seconds": read_s}
        self.counters.record(stored=[c.ticket], bytes_stored=self.slot_bytes,
                             store_seconds=time.perf_counter() - t0, **rate)

    def _copy(self, c: CopyChunk) -> float:
        """One copy, committed; returns the seconds its reads of the source took (yields aside)."""
        if c.source is None:
            src, journal = self.stores[c.src], self.journals[c.src]
        elif self.foreign is None:
            raise LookupError(f"writer {c.source!r}: this worker reads no other writers")
        else:
            src, journal = self.foreign.get(c.source)
        sums = journal.checksums(c.src_slot, c.key)
        if sums is None:
            raise LookupError(f"slot {c.src_slot} of tier {c.src} no longer holds it")
        dst = self.stores[c.dst]
        with src.held(c.src_slot) as (fd, off):  # a promotion reads the drive the hits read: after them
            read_s = self._sliced(os.preadv, fd, off, yielding=c.src > 0, what="read of the source slot")
        if c.source is not None:
            bad = self.foreign.new_step({c.source}).get(c.source)  # what its owner journaled during the read
            if bad is not None:
                raise bad
            if journal.checksums(c.src_slot, c.key) != sums:
                raise LookupError(f"writer {c.source!r} gave slot {c.src_slot} up or rewrote it during the copy")
        dst.free([c.dst_slot])  # durably, before its bytes change
        with dst.held(c.dst_slot) as (fd, off):
            self._sliced(os.pwritev, fd, off, yielding=True, what="write of the destination slot")
        dst.commit([(c.key, c.dst_slot, sums)])
        self.journals[c.dst].put(c.dst_slot, c.key, sums)
        return read_s

    def _sliced(self, io, fd: int, off: int, *, yielding: bool, what: str) -> float:
        """The whole slot between the buffer and `fd` at `off` through `io` (os.preadv or
        os.pwritev), a slice at a time, each after the hits' reads in flight when `yielding`.
        Returns the seconds spent in `io` (the yields left out)."""
        done, spent = 0, 0.0
        while done < self.slot_bytes:
            if yielding:
                self._yield_to_reads()
            t0 = time.perf_counter()
            k = io(fd, [self._view[done:done + self.slice_bytes]], off + done)
            spent += time.perf_counter() - t0
            if k <= 0:
                raise OSError(f"{what} stopped at {done} of {self.slot_bytes} bytes")
            done += k
        return spent

    def _yield_to_reads(self) -> None:
        if self.reads is not None:
            self.reads.wait_idle(MAX_YIELD_S)  # asleep on the reads, not polling them beside the step

    def flush(self, timeout: float = 60.0) -> bool:
        return self._thread.flush(timeout)

    def close(self) -> None:
        self._thread.close()
        self._view.release()
        self._buf.close()
