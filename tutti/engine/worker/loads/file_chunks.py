"""Whole loads through the file path, chunk-major: one read per chunk, one copy, verify and
scatter per group of chunks.

A load awaited whole (every asynchronous load on tutti's loading thread, the loads of a FULL
CUDA-graph step) needs no layer before another, yet the per-layer path moved it segment by
segment: a 4k-token hit of an 8B model was 512 reads of 1 MiB and, per item, a host-to-device
copy, a verify, a scatter and an event, about a thousand torch calls from a thread that takes
turns at the GIL with vLLM's step. Here each chunk's slot (its layers' segments lie back to back
on disk) is read whole with one request into the load ring's host buffer. The ring is cut in two
halves, each a group of whole chunks: while one half's chunks are copied to the device (one copy),
verified and scattered for every layer at once (the pipeline's one `verify`/`scatter` pair, as
for mapped slabs), the next group's reads land in the other half. A half is written again only
once the copy that consumed it has finished (its event: the one host wait, as the staging ring's
own `wait_host`), and not at all while a read that missed its deadline may still land in it.

Every per-chunk rule of the per-layer path holds: a read error fails its chunk (and journals it
free unless the read only timed out), a slab that cannot be opened fails its chunk, checksums go
to the step's device verdicts, keyed tags are checked on the host per chunk before anything is
copied, and slab descriptors pinned by `acquire` are released once their reads land.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tutti.engine.worker.context import nvtx_range
from tutti.engine.hostcost import gil_free_wait
from tutti.engine.worker.loads.items import LoadItem
from tutti.engine.worker.staging import StagingSlot
from tutti.io.queue import READ, IOFuture, IORequest, submit_all

if TYPE_CHECKING:
    from tutti.engine.worker.loads.core import LoadCore


@dataclass
class _Half:
    """One half of the load ring: a group of whole chunks' rows."""

    offset: int  # byte offset in the ring's buffer
    rows: int  # chunks it holds
    busy: list = field(default_factory=list)  # CUDA events: the consumers of its last contents
    # reads that missed their deadline and may still land in it: (their futures, store, slot pinned)
    late: list[tuple[list[IOFuture], object, int]] = field(default_factory=list)

    def wait_host(self) -> None:
        """Before the host writes it: the copies that read its last contents have finished (the
        only host wait of the path: reusing a half, exactly as the staging ring's wait_host)."""
        for ev in self.busy:
            with gil_free_wait():
                ev.synchronize()
        self.busy = []

    def reap(self) -> bool:
        """Drop late reads that have landed (their descriptors go back); True when none is left."""
        still = []
        for futures, store, slot in self.late:
            if all(f.done() for f in futures):
                store.release(slot)
            else:
                still.append((futures, store, slot))
        self.late = still
        return not still


@dataclass
class _Group:
    """One group's reads in flight: `idx[r]` is the step's load in row r of `half`."""

    half: _Half
    idx: list[int]
    pinned: list[tuple[object, int, int]] = field(default_factory=list)  # (store, slot, row)
    futures: list[IOFuture] = field(default_factory=list)


def chunks_per_ring(lp: "LoadCore") -> int:
    """Whole chunks the load ring holds (0: the per-layer path loads)."""
    return lp.ring.slot_bytes * len(lp.ring) // lp.ctx.chunk_bytes


def load_file_chunks(lp: "LoadCore", todo: list[int]) -> bool:
    """Load the step's loads `todo` (indices in `lp.loads`) chunk-major; False, touching
    nothing, when the ring holds no whole chunk or reads of an earlier load still hold part of
    it (the per-layer path then takes them). The last group's event is left for wait_layer."""
    if not todo or chunks_per_ring(lp) == 0:
        return False
    if lp.stragglers:
        lp.reap_stragglers()
    slots = lp.ring.acquire_all()
    if slots is None:
        return False
    reader = _ChunkReader(lp, slots)
    try:
        for k in range(0, len(todo), reader.rows):
            reader.submit(todo[k:k + reader.rows])
        while reader.inflight:
            reader.process_oldest()
    except BaseException:
        reader.hand_back(abandoned=True)  # reads in flight keep the ring until they land
        raise
    reader.hand_back()
    return True


class _ChunkReader:
    """The ring's halves and the groups read into them, oldest first."""

    def __init__(self, lp: "LoadCore", slots: list[StagingSlot]) -> None:
        self.lp, self.ctx, self.slots = lp, lp.ctx, slots
        cb = self.ctx.chunk_bytes
        per_ring = chunks_per_ring(lp)
        # two halves where two fit: one's reads land while the other is copied (4 or 8 parts
        # measured no better on a disk root: bench/whole_load_calls.py)
        n_halves = max(1, min(2, per_ring))
        self.rows = per_ring // n_halves
        self.halves = [_Half(h * self.rows * cb, self.rows) for h in range(n_halves)]
        for half in self.halves:  # the last step's copies out of the ring's slots under this half
            lo, hi = half.offset, half.offset + half.rows * cb
            half.busy = [s.busy_until for s in slots
                         if s.busy_until is not None and s.offset < hi and s.offset + lp.ring.slot_bytes > lo]
        self.inflight: deque[_Group] = deque()
        self._turn = 0
        self.last_event = None
        self.max_io = self.ctx.queue.caps().max_io_bytes

    # ------------------------------------------------------------ reads
    def submit(self, idx: list[int]) -> None:
        """One read per chunk of `idx` (pieces of max_io_bytes where a chunk is larger) into a half."""
        lp, ctx, cb = self.lp, self.ctx, self.ctx.chunk_bytes
        half = self._take_half()
        if half is None:
            for i in idx:
                lp.fail(lp.loads[i], "no staging room free: earlier reads are stalled")
            return
        half.wait_host()
        group = _Group(half, idx)
        self.inflight.append(group)  # before anything is pinned: an exception hands it back
        reqs = []
        for r, i in enumerate(idx):
            ld = lp.loads[i]
            if ld.key in lp.failed_keys:
                continue
            try:
                store = lp.source(ld)[0]
                fd, off = store.acquire(ld.slot, 0)  # layer 0: the slot's first byte
            except Exception as exc:  # noqa: BLE001 - a slab missing, refused, damaged, no fd left...
                lp.fail(ld, f"cannot open its slab: {exc}")
                continue
            group.pinned.append((store, ld.slot, r))
            buf, at, nbytes = lp.ring.buffer, half.offset + r * cb, cb
            if ctx.codec is not None:  # the stored slot, into the ring's twin: process() decodes it into the half
                buf, at, nbytes = lp.ring.encoded, self._encoded_row(half, r), ctx.stored_chunk_bytes
            for piece in range(0, nbytes, self.max_io):
                reqs.append(IORequest(fd, off + piece, buf, at + piece, min(self.max_io, nbytes - piece),
                                      READ, tag=r))
        with nvtx_range("read", 0):
            group.futures = submit_all(ctx.queue, reqs)
        if ctx.reads is not None and group.futures:
            ctx.reads.track(group.futures)  # the stores' writes yield until these land
        if lp.trace is not None and len(lp.trace) < 100_000:
            lp.trace.append(("read", -1, time.perf_counter()))  # -1: every layer of a group

    def _encoded_row(self, half: _Half, r: int) -> int:
        """With a codec: where row `r` of `half` lies in the ring's encoded twin (the ring's chunk
        rows in order, a stored slot each)."""
        return (half.offset // self.ctx.chunk_bytes + r) * self.ctx.stored_chunk_bytes

    def _take_half(self) -> _Half | None:
        """The next half in turn whose last group is processed and whose late reads have landed;
        None when every half still waits for reads past their deadline."""
        for _ in range(len(self.halves)):
            half = self.halves[self._turn % len(self.halves)]
            self._turn += 1
            while any(g.half is half for g in self.inflight):
                self.process_oldest()
            if half.reap():
                return half
        return None

    # ------------------------------------------------------------ copy, verify, scatter
    def process_oldest(self) -> None:
        """The oldest group, dropped from `inflight` only once processed (what raises on the way
        is handed back with the reads still in flight)."""
        self.process(self.inflight[0])
        self.inflight.popleft()

    def process(self, group: _Group) -> None:
        """Wait (bounded) for the group's reads, fail the chunks that did not read, then one
        copy, one verify and one scatter of every layer of the rest."""
        lp, ctx = self.lp, self.ctx
        errors = self._wait(group)
        good = []
        for r, i in enumerate(group.idx):
            ld = lp.loads[i]
            if ld.key in lp.failed_keys:
                continue
            if r in errors:
                lp.fail(ld, f"read of its slot failed: {errors[r]}")
                if not isinstance(errors[r], TimeoutError):
                    lp.forget(ld)  # a truncated or deleted slab reads short: the chunk is gone
                continue
            good.append(r)
        cb, n = ctx.chunk_bytes, len(group.idx)
        host = lp.ring.buffer[group.half.offset:group.half.offset + n * cb]
        if ctx.codec is not None:  # decoded into the half here (this thread), then as without a codec
            scb = ctx.stored_chunk_bytes
            good = [r for r in good if lp.decoded_chunk(lp.loads[group.idx[r]],
                                                         lp.ring.encoded[self._encoded_row(group.half, r):][:scb],
                                                         host[r * cb:(r + 1) * cb])]
        if ctx.mac is not None:  # keyed tags on the host, before anything reaches the device
            good = [r for r in good if lp.tags_match(lp.loads[group.idx[r]], lp.sums[group.idx[r]],
                                                      host[r * cb:(r + 1) * cb])]
        if not good:
            return
        with lp.on_stream():
            data = host
            if ctx.cuda:
                data = lp.ring.device_buffer[group.half.offset:group.half.offset + n * cb]
                data.copy_(host, non_blocking=True)  # rows not good carry stale bytes, never scattered
            chunks = data.view(n, ctx.num_layers, ctx.seg)
            layers = list(range(ctx.num_layers))
            lp.verify(chunks, group.idx, layers, 0)
            lp.scatter(chunks, group.idx, layers, good, 0)
            if ctx.cuda:
                ev = torch.cuda.Event()
                ev.record(lp.stream)
                group.half.busy = [ev]
                self.last_event = ev
        lp.step_bytes += len(good) * ctx.stored_chunk_bytes  # as read (cb without a codec)

    def _wait(self, group: _Group) -> dict[int, BaseException]:
        """Every read of the group, until io_timeout_s: {row: its error}. Rows whose reads missed
        the deadline keep their descriptors and their half until the reads land."""
        deadline = time.monotonic() + self.ctx.cfg.io_timeout_s
        errors: dict[int, BaseException] = {}
        late: set[int] = set()
        with nvtx_range("io_wait", 0):
            for fut in group.futures:
                r = fut.request.tag
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError as exc:  # a stalled file system: fail the chunk, never hang the step
                    errors[r] = exc
                    late.add(r)
                except OSError as exc:
                    errors.setdefault(r, exc)
        for store, slot, r in group.pinned:
            if r in late:
                group.half.late.append(([f for f in group.futures if f.request.tag == r], store, slot))
            else:
                store.release(slot)
        group.pinned = []
        return errors

    # ------------------------------------------------------------ the ring goes back
    def hand_back(self, *, abandoned: bool = False) -> None:
        """The ring's slots back, after the last copy (its event); those under a half that reads
        past their deadline (or of an abandoned load) may still land in stay held, as one
        straggler of the pipeline, until they land (the per-layer path loads in the rest)."""

        lp, cb = self.lp, self.ctx.chunk_bytes
        if abandoned:
            for group in self.inflight:
                group.half.late += [(group.futures, store, slot) for store, slot, _ in group.pinned]
            self.inflight.clear()
        stuck = [half for half in self.halves if not half.reap()]
        after = self.last_event  # the load stream is in order: its last copy covers every earlier one
        if after is None and self.ctx.cuda:  # nothing copied: the last step's copies may still run
            after = torch.cuda.Event()
            after.record(lp.stream)
        under = {s.index for s in self.slots for h in stuck
                 if s.offset < h.offset + h.rows * cb and s.offset + lp.ring.slot_bytes > h.offset}
        held = [s for s in self.slots if s.index in under]
        for s in self.slots:
            if s.index not in under:
                lp.ring.release(s, after)
        if held:
            late = [entry for half in stuck for entry in half.late]
            futures = [f for futures, _, _ in late for f in futures]
            pinned = [(store, slot) for _, store, slot in late]
            lp.stragglers.append((LoadItem(-1, [], [], slot=held[0], futures=futures, pinned=pinned,
                                         more_slots=held[1:]), after))
        if self.last_event is not None:
            lp.whole_ready = self.last_event  # later on the load stream than any mapped copy
        lp.whole_pending = True
