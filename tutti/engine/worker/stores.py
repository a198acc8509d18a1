"""The store pipeline: a step's new chunks, gathered once after the forward and written whole.

Why after the forward, in one launch: a store never adds latency (the chunk is only needed by
a later request), so nothing is gained by gathering layer by layer, while every per-layer
hook costs host time inside the forward pass, and a full CUDA-graph step runs no hooks at all.
At the end of a step (`wait_for_save`) each run of consecutive staging regions gets one gather
of every layer (on a side stream after the compute stream's work), one checksum launch and
one device-to-host copy; the writer thread then writes each chunk with one request (a chunk's
layers lie contiguous in its slab slot, in the same order as in its staging region), makes it
durable and journals it. A store that finds no free region is skipped and counted: the forward
pass never waits for the disk.

On a RAM root whose writer mapped every slab at start-up (`ChunkStore.map_all`), a chunk skips
the host staging and the write call: once the slot's free record is durable, the writer thread
copies it from the device staging straight into the slot's mapping (one DMA into pages pinned at
start-up; on the CPU a memcpy from the host staging), then journals it as the file path does.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from tutti.engine.config import resolve
from tutti.engine.worker.context import U64, Counters, JournalView, Throttled, WorkerContext, log, nvtx_range
from tutti.engine.hostcost import gil_free_wait
from tutti.engine.plan import StoreChunk
from tutti.engine.worker.staging import RegionArena
from tutti.engine.worker.writer import Writer
from tutti.io.queue import WRITE, IORequest, submit_windowed


@dataclass
class _Run:
    """Consecutive staging regions holding whole chunks, on their way to disk."""

    first: int
    chunks: list[StoreChunk]
    sums: torch.Tensor  # int64 [chunks * layers], chunk-major (host, or pinned host on CUDA)
    ready: object = None  # CUDA event: gather, checksums and device-to-host copy finished
    free_slots: list[int] = field(default_factory=list)  # journal these free before writing
    t0: float = 0.0
    released: int = 0  # leading regions already given back (copied into the maps, chunk by chunk)


class StorePipeline:
    def __init__(self, ctx: WorkerContext, arena: RegionArena, journal: JournalView, counters: Counters,
                 writer: Writer) -> None:
        self.ctx = ctx
        self.arena = arena
        self.journal = journal
        self.counters = counters
        self.writer = writer
        if ctx.cuda:
            self.stream = torch.cuda.Stream(ctx.device)
        self._lock = threading.RLock()  # tickets and per-request counts: main and writer threads
        self._live: set[int] = set()  # tickets admitted and not yet done or failed
        self._inflight: dict[str, int] = defaultdict(int)
        self._had_stores: set[str] = set()
        self._finished: set[str] = set()
        # Requests with a chunk not stored (skipped or failed): their later chunks are not stored
        # either until they finish. A hit needs every chunk from a prompt's first, so those could
        # not be reached until another request stores the missing one, and that request computes
        # (and stores) the ones after it too; skipping them leaves staging and the drive to
        # stores that can be hit.
        self._holed: set[str] = set()
        # Writes past io_timeout_s (a stalled file system): their chunks failed, but the kernel
        # may still land them, so their staging regions and slab descriptors stay held until then.
        self._stragglers: list[tuple[list, list[int], int, int]] = []  # (futures, pinned slots, first, count)
        self._warned_skip = False
        self._said = Throttled()  # a store failure that repeats (a full disk): once a minute per kind
        self._copy_stream = torch.cuda.Stream(ctx.device) if ctx.cuda else None  # the writer thread's DMAs
        # how a chunk reaches a mapped slot (EngineConfig.mapped_store_copy); the CPU has no DMA
        self.map_copy = resolve.mapped_store_copy(ctx.cfg.mapped_store_copy, cuda=ctx.cuda).value

    @property
    def into_maps(self) -> bool:
        """Stores copy into the writer's mapped slabs (see the module docstring)."""
        return bool(getattr(self.ctx.store, "maps_every_slab", False)) and self.ctx.mac is None

    # ---------------------------------------------------------------- step
    def planned(self, stores: Sequence[StoreChunk]) -> None:
        """The scheduler holds these requests' blocks until every worker reports them finished
        (vLLM counts finished_sending per worker), whether this worker stores, skips or only reads."""
        if stores:
            with self._lock:
                self._had_stores.update(st.req_id for st in stores)

    def run(self, stores: Sequence[StoreChunk]) -> None:
        """After the step's forward: gather every admitted chunk and hand it to the writer."""
        if not stores or not self.ctx.writes:
            return
        if self._holed and self.ctx.num_groups == 1:  # (hybrid models: a state entry is no hole)
            with self._lock:  # one look: the writer thread adds to _holed as its writes fail
                holed = set(self._holed)
            after = [st for st in stores if st.req_id in holed]
            if after:
                self._skip(after, "an earlier chunk of its request was not stored (no hit reaches these)")
                stores = [st for st in stores if st.req_id not in holed]
                if not stores:
                    return
        runs = self.arena.take(len(stores))
        admitted = sum(count for _, count in runs)
        if admitted < len(stores):
            self._skip(stores[admitted:], "no free staging region")
        stores = list(stores[:admitted])
        if not stores:
            return
        for st in stores:
            self.journal.drop(st.slot)  # its old contents are gone from now on
        with self._lock:
            for st in stores:
                self._live.add(st.ticket)
                self._inflight[st.req_id] += 1
        free_slots = [st.slot for st in stores]
        t0 = time.perf_counter()
        compute_done = None
        if self.ctx.cuda:
            compute_done = torch.cuda.Event()
            compute_done.record(torch.cuda.current_stream(self.ctx.device))
        i = 0
        for first, count in runs:
            group = stores[i:i + count]
            i += count
            with nvtx_range("gather"):
                run = self._gather(first, group, compute_done)
            run.free_slots, free_slots, run.t0 = free_slots, [], t0
            self.writer.submit(lambda run=run: self._write(run))

    def _gather_into(self, group: list[StoreChunk], out: torch.Tensor) -> None:
        """Every layer of these chunks into `out` ([n, L, seg], chunk-major): one launch, or with
        several KV cache groups (hybrid models) one launch per group's layers."""
        ctx, n, L = self.ctx, len(group), self.ctx.num_layers
        view = out.view(n, L, ctx.seg)
        if ctx.num_groups == 1:
            ctx.gather(ctx.caches, [st.block_ids for st in group], view.transpose(0, 1))
            return
        for layer in range(L):
            ctx.gather([ctx.caches[layer]], [ctx.blocks_for(st.block_ids, layer) for st in group],
                       view[:, layer:layer + 1].transpose(0, 1))

    def _gather(self, first: int, group: list[StoreChunk], compute_done) -> _Run:
        ctx, n, L = self.ctx, len(group), self.ctx.num_layers
        host = self.arena.host_view(first, n)
        if not ctx.cuda:
            self._gather_into(group, host)
            return _Run(first, group, ctx.checksum(host.view(n * L, ctx.seg)))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(compute_done)
            dev = self.arena.device_view(first, n)
            self._gather_into(group, dev)
            if ctx.num_groups > 1:
                # Hybrid models: vLLM frees a sliding-window or Mamba block while its request runs on
                # (a later step's schedule) and may hand it to another request at once, so the next
                # forward must not overwrite it before this gather has read it.
                gathered = torch.cuda.Event()
                gathered.record(self.stream)
                torch.cuda.current_stream(ctx.device).wait_event(gathered)
            sums = ctx.checksum(dev.view(n * L, ctx.seg))
            if not self.into_maps or self.map_copy == "host":  # else the writer thread DMAs into the slots
                host.copy_(dev, non_blocking=True)
            sums_host = self.arena.sums_view(first, n)  # pinned at start-up, held with the regions
            sums_host.copy_(sums.view(-1), non_blocking=True)
            ready = torch.cuda.Event(blocking=True)  # the writer thread sleeps on it instead of spinning
            ready.record(self.stream)
        return _Run(first, group, sums_host, ready)

    def preempt(self) -> None:
        """Blocks of preempted requests are about to be reused: later work on the compute stream
        runs after the gathers already queued (no host wait)."""
        if self.ctx.cuda:
            torch.cuda.current_stream(self.ctx.device).wait_stream(self.stream)

    # ---------------------------------------------------------------- writer thread
    def _write(self, run: _Run) -> None:
        store = self.ctx.store
        held = False
        self.reap_stragglers()
        try:
            if run.ready is not None:
                with nvtx_range("d2h_wait"):
                    with gil_free_wait():
                        run.ready.synchronize()  # releases the GIL while the copy finishes
            sums = self._tags(run) if self.ctx.mac is not None else run.sums.tolist()
            store.free(run.free_slots)
            held = self._write_chunks(run, sums)
        except Exception as exc:  # noqa: BLE001 - the chunks fail, the writer goes on
            log.exception("tutti: store of %d chunks failed", len(run.chunks))
            self._fail(run.chunks, f"writer error: {exc}", skipped=False)
        finally:
            if not held:
                self._give_back(run, len(run.chunks))

    def reap_stragglers(self) -> int:
        """Give back what late writes held once they landed; returns how many are still out."""
        with self._lock:
            still = []
            for futures, pinned, first, count in self._stragglers:
                if all(f.done() for f in futures):
                    for slot in pinned:
                        self.ctx.store.release(slot)
                    self.arena.release(first, count)
                else:
                    still.append((futures, pinned, first, count))
            self._stragglers = still
            return len(still)

    def _tags(self, run: _Run) -> list[int]:
        """Keyed tags of every segment of the run, from the host bytes about to be written."""
        ctx, L = self.ctx, self.ctx.num_layers
        host = self.arena.host_view(run.first, len(run.chunks)).numpy()
        return [ctx.mac.tag(st.key, layer, host[(i * L + layer) * ctx.seg:(i * L + layer + 1) * ctx.seg])
                for i, st in enumerate(run.chunks) for layer in range(L)]

    def _write_chunks(self, run: _Run, sums: list[int]) -> bool:
        """Write, sync and journal the run's live chunks. True when writes missed their deadline
        and still hold the run's staging regions (released by reap_stragglers once they land)."""
        ctx, store, L = self.ctx, self.ctx.store, self.ctx.num_layers
        max_io = ctx.queue.caps().max_io_bytes
        window = ctx.cfg.write_window_bytes
        if ctx.reads is not None and window is not None:
            # writes small enough that a read waits for one of them at most, and a window that
            # shrinks to one of them while the loads' reads are in flight
            max_io = min(max_io, ctx.reads.yield_bytes)
            window = functools.partial(ctx.reads.window, ctx.cfg.write_window_bytes)
        reqs = []
        with self._lock:
            live = [(i, st) for i, st in enumerate(run.chunks) if st.ticket in self._live]
        # the layers each chunk carries (hybrid models with state groups: not every layer)
        written = {i: [layer for layer in range(L) if ctx.moves_layer(st.block_ids, layer)] for i, st in live}
        errors: dict[int, BaseException] = {}
        pinned: list[int] = []
        futures: list = []
        stalled = False
        to_file = live
        if self.into_maps:
            self._copy_into_maps(run, live, written, errors)
            to_file = []
        try:
            for i, st in to_file:
                buf = self.arena.buffer
                if ctx.codec is not None:  # encoded here, on the writer thread, into the region's twin
                    try:
                        self._encode(run.first + i, written[i])
                    except Exception as exc:  # noqa: BLE001 - a codec's error fails that chunk, never the writer
                        errors[i] = exc
                        continue
                    buf = self.arena.encoded
                try:
                    fd, off = store.acquire(st.slot, 0)  # held until its writes are done
                except OSError as exc:  # the slab cannot be opened (no descriptor left, refused)
                    errors[i] = exc
                    continue
                pinned.append(st.slot)
                if ctx.codec is None:
                    base, ranges = self.arena.buffer_offset(run.first + i), self._written_ranges(written[i])
                else:
                    base = self.arena.encoded_offset(run.first + i)
                    ranges = self._written_ranges(written[i], ctx.stored_seg)
                for lo, hi in ranges:  # one request a chunk, split only past the queue's limit
                    for o in range(lo, hi, max_io):
                        reqs.append(IORequest(fd, off + o, buf, base + o, min(max_io, hi - o), WRITE, tag=i))
            with nvtx_range("write"):
                # at most write_window_bytes in flight: the hits' reads share the drive's queue
                futures, stalled = submit_windowed(ctx.queue, reqs, window, ctx.cfg.io_timeout_s, errors)
        finally:
            if stalled:
                with self._lock:
                    self._stragglers.append((futures, pinned, run.first + run.released,
                                             len(run.chunks) - run.released))
            else:
                for s in pinned:
                    store.release(s)
        done = []
        for i, st in live:
            if i in errors:
                err = errors[i]
                self._said.warning(f"write:{type(err).__name__}:{getattr(err, 'errno', None)}",
                                   "tutti: store of chunk %s failed: %s", st.key.hex()[:16], err)
                self._fail([st], f"write failed: {errors[i]}", skipped=False)
            else:
                kept = set(written[i])
                # a segment not written (a layer this entry holds nothing for) is journaled as 0:
                # it is never loaded (its blocks are vLLM's null block) and `tutti verify` skips it
                done.append((st, [int(s) & U64 if layer in kept else 0
                                  for layer, s in enumerate(sums[i * L:(i + 1) * L])], len(kept)))
        if not done:
            return stalled
        try:
            with nvtx_range("commit"):
                store.commit([(st.key, st.slot, cks) for st, cks, _ in done])
        except OSError as exc:
            self._said.warning(f"sync:{exc.errno}", "tutti: making %d chunks durable failed: %s", len(done), exc)
            self._fail([st for st, _, _ in done], f"sync failed: {exc}", skipped=False)
            return stalled
        for st, cks, _ in done:
            self.journal.put(st.slot, st.key, cks)
        self.counters.record(stored=[st.ticket for st, _, _ in done],
                             bytes_stored=sum(n for _, _, n in done) * ctx.stored_seg,  # as written
                             store_seconds=time.perf_counter() - run.t0)
        self._done([st for st, _, _ in done])
        return stalled

    def _copy_into_maps(self, run: _Run, live: list, written: dict[int, list[int]],
                        errors: dict[int, BaseException]) -> None:
        """The run's chunks into their slots' mappings (the free records are already durable):
        from the device staging on the writer's copy stream ("dma", "dma_chunk"), or from the
        host staging the step copied them into ("host"; the CPU's only way)."""
        ctx, store, rb = self.ctx, self.ctx.store, self.arena.region_bytes
        n = len(run.chunks)
        dma = self.map_copy != "host"
        src_all = self.arena.device_view(run.first, n) if dma else self.arena.host_view(run.first, n)
        on_stream = contextlib.ExitStack()
        if dma:
            on_stream.enter_context(torch.cuda.device(ctx.device))
            on_stream.enter_context(torch.cuda.stream(self._copy_stream))
        ahead = ctx.cfg.store_copies_in_flight if self.map_copy == "dma_chunk" else 0
        queued: deque[tuple[int, torch.cuda.Event]] = deque()  # dma_chunk: (chunk, its copy's event)
        with nvtx_range("copy_into_maps"), on_stream:
            for i, st in live:
                dst = store.mapped_slot(st.slot)
                if dst is None:  # the slab shrank under its mapping, or was never mapped
                    errors[i] = OSError(f"slot {st.slot}: its slab is not mapped whole")
                    continue
                src = src_all[i * rb:(i + 1) * rb]
                for lo, hi in self._written_ranges(written[i]):
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=dma)  # host: a memcpy, torch releases the GIL
                if ahead:  # at most `ahead` chunks' copies ahead of a decode step's own: wait for the oldest
                    landed = torch.cuda.Event(blocking=True)  # this (writer) thread sleeps on it
                    landed.record(self._copy_stream)
                    queued.append((i, landed))
                    if len(queued) < ahead:
                        continue
                    oldest, landed = queued.popleft()
                    with gil_free_wait():
                        landed.synchronize()
                    self._give_back(run, oldest + 1)  # it and any chunk before it are in their slots
                    continue
                if self.map_copy != "dma":  # this chunk's bytes are in its slot: its region (and any
                    self._give_back(run, i + 1)  # skipped one before it) serves the next step's stores
            if dma:
                self._wait_copies()
                if ahead:  # the last copies landed: their regions too, before the commit
                    self._give_back(run, n)

    def _give_back(self, run: _Run, upto: int) -> None:
        """Regions [released, upto) of `run` back to the arena while the rest of the run is still
        being copied: a burst of prefill then finds staging a chunk at a time instead of waiting
        for the whole run (and its commit), so fewer stores are skipped."""
        if upto > run.released:
            self.arena.release(run.first + run.released, upto - run.released)
            run.released = upto

    def _wait_copies(self) -> None:
        """Sleep (GIL released) until the copy stream's work so far has landed."""
        done = torch.cuda.Event(blocking=True)  # waited on by this (writer) thread: sleep, not spin
        done.record(self._copy_stream)
        with gil_free_wait():
            done.synchronize()

    def _encode(self, region: int, layers: list[int]) -> None:
        """With a codec (tutti.codec): each of `layers` of the raw chunk in `region` encoded into the
        region's twin at its stride in the slot, the rest of the stride zeroed (the checksums and
        tags stay those of the raw segments). ValueError when the codec says it used more room than
        it may."""
        ctx, codec = self.ctx, self.ctx.codec
        seg, sseg, most = ctx.seg, ctx.stored_seg, ctx.encoded_max
        raw = self.arena.host_view(region, 1)
        enc = self.arena.encoded[self.arena.encoded_offset(region):][:ctx.stored_chunk_bytes]
        with nvtx_range("encode"):
            for layer in layers:
                dst = enc[layer * sseg:(layer + 1) * sseg]
                used = codec.encode(memoryview(raw[layer * seg:(layer + 1) * seg].numpy()),
                                    memoryview(dst[:most].numpy()))
                if isinstance(used, bool) or not isinstance(used, int) or not 0 <= used <= most:
                    raise ValueError(f"codec {codec.name!r}: encode returned {used!r} for layer {layer}; expected "
                                     f"the bytes used, at most max_encoded_bytes({seg}) = {most}")
                dst[used:].zero_()

    def _written_ranges(self, layers: list[int], seg: int | None = None) -> list[tuple[int, int]]:
        """Byte ranges of a chunk's slot to write: runs of consecutive written layers (of `seg`
        bytes each: the segment, or with a codec its stride)."""
        seg, out = seg or self.ctx.seg, []
        for layer in layers:
            if out and out[-1][1] == layer * seg:
                out[-1] = (out[-1][0], (layer + 1) * seg)
            else:
                out.append((layer * seg, (layer + 1) * seg))
        return out

    # ---------------------------------------------------------------- bookkeeping
    def _skip(self, stores: Sequence[StoreChunk], why: str, *, skipped: bool = True) -> None:
        """Report these stores as not done. `skipped`: by choice (no staging room), as opposed to
        failed (a write or sync error, a full disk): both free their slots, only the first is
        counted in stores_skipped, so stores_failed - stores_skipped counts IO failures."""
        log.debug("tutti: dropping %d stores: %s", len(stores), why)
        with self._lock:
            self._holed.update(st.req_id for st in stores)
        if skipped and not self._warned_skip:
            self._warned_skip = True
            log.warning("tutti: %d stores skipped (%s): the storage writes slower than prefill fills the staging; "
                        "they are counted in stores_skipped (this is said once); a larger staging (staging_bytes, "
                        "staging_slots, max_inflight_stores) only helps bursts", len(stores), why)
        self.counters.record(store_failed=[st.ticket for st in stores], stores_skipped=len(stores) if skipped else 0)

    def _fail(self, stores: Sequence[StoreChunk], why: str, *, skipped: bool = True) -> None:
        with self._lock:
            failed = [st for st in stores if st.ticket in self._live]
        if failed:
            self._skip(failed, why, skipped=skipped)
            self._done(failed)

    def _done(self, stores: Sequence[StoreChunk]) -> None:
        with self._lock:
            for st in stores:
                if st.ticket in self._live:
                    self._live.discard(st.ticket)
                    self._inflight[st.req_id] -= 1

    def finished_requests(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose stores are all done, among those vLLM says have finished."""
        with self._lock:
            self._holed -= finished_req_ids
            self._finished |= {r for r in finished_req_ids if r in self._had_stores}
            out = {r for r in self._finished if self._inflight.get(r, 0) <= 0}
            for r in out:
                self._finished.discard(r)
                self._had_stores.discard(r)
                self._inflight.pop(r, None)
        return out

    @property
    def busy(self) -> bool:
        with self._lock:
            return bool(self._live)

    def leftovers(self) -> dict[str, int]:
        """Bookkeeping still held (a soak test checks that it drains)."""
        with self._lock:
            return {"tickets": len(self._live), "inflight": sum(self._inflight.values()), "holed": len(self._holed)}
