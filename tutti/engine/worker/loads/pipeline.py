"""The load pipeline: a step's hits, read from the store and scattered into the paged cache.

Layer-wise (eager and PIECEWISE CUDA-graph steps): reads for the first `lookahead` layers go
out when the step starts, each layer's hook moves the window one layer on, and the compute
stream waits on one event per layer, so storage traffic hides behind compute. A full IO queue
takes the window's later reads when it has room (`_send_unsent`, topped up from the hooks and
while a layer's own reads land): the forward thread waits for room only for the layer it awaits.
Whole (a FULL CUDA-graph step, where vLLM replays the forward without per-layer hooks, and every
asynchronous load on tutti's loading thread): every layer is read and scattered before start()
returns, and the compute stream waits once. Such a load goes chunk-major: from mapped slabs one
copy per run of chunks (tutti.engine.worker.loads.mapped), through the file path one read per chunk's
slot into half the load ring and one copy, verify and scatter per group of chunks
(tutti.engine.worker.loads.file_chunks). Hybrid models, and a load ring that holds no whole chunk, keep the
per-layer items below (a read, copy, verify and scatter per layer and group of chunks).

Nothing here makes the host wait for the GPU. Checksums are computed on the device and
compared there with the journaled values; mismatches collect in a device tensor that is
copied back once per step and read when vLLM asks for the failed blocks, after the forward.
A mismatched chunk's blocks are then reported failed, so vLLM discards that step's output for
the request and recomputes them: its KV never reaches an output. Read errors are known on the
host and fail their chunk at once (nothing is scattered from it).

A load may write fewer blocks than its chunk holds (LoadChunk.skip_blocks, keep_blocks: blocks
vLLM computed or computes itself): the whole chunk is still read and verified, and a failed one
reports only the blocks it would have written.
"""

from __future__ import annotations

import collections
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from tutti.engine.worker.context import Counters, JournalView, WorkerContext, as_signed64, log, nvtx_range
from tutti.engine.hostcost import gil_free_wait
from tutti.engine.worker.loads.file_chunks import load_file_chunks
from tutti.engine.worker.loads.items import LoadItem
from tutti.engine.worker.loads.mapped import load_mapped
from tutti.engine.plan import LoadChunk
from tutti.engine.worker.staging import StagingRing, StagingSlot
from tutti.format import segment_bytes, token_span
from tutti.io.queue import READ, IORequest


DETACHED_JOBS = 32  # detached jobs in flight at once (each keeps a pinned verdict buffer); more wait on the thread


@dataclass
class Detached:
    """One job launched by `launch_detached`, in flight until its last event fires."""

    loads: list[LoadChunk]
    sums: list[tuple[int, ...]]
    bad_host: torch.Tensor | None  # its verdicts, copied back by the job's last copy
    landed: object  # CUDA event after that copy (None on the CPU: done at launch)
    started: object  # CUDA event before its first copy (timing)
    pool_buffer: torch.Tensor | None  # the pinned buffer bad_host views, back to the pool once resolved
    nbytes: int
    host_seconds: float
    keys: set[bytes]  # failed at launch (unmapped slabs)
    blocks: set[int]

    def ready(self) -> bool:
        return self.landed is None or self.landed.query()


class LoadPipeline:
    def __init__(self, ctx: WorkerContext, ring: StagingRing, journal: JournalView, counters: Counters,
                 forget: Callable[[LoadChunk], None], foreign=None) -> None:
        self.ctx = ctx
        self.ring = ring
        self.journal = journal
        self.foreign = foreign  # tutti.engine.sharing.ForeignStores: chunks of the other writers
        self.counters = counters
        self.forget = forget  # a corrupt or unreadable chunk: journal its slot free
        self.per_slot = ring.slot_bytes // ctx.seg
        self.maps = bool(getattr(ctx.store, "maps_ram", False))  # loads copy from mapped slabs (RAM roots)
        # layers read ahead of the one computing; "auto": bounded by the free load slots alone
        self.ahead = ctx.num_layers if ctx.cfg.lookahead == "auto" else ctx.cfg.lookahead
        if ctx.cuda:
            self.stream = torch.cuda.Stream(ctx.device)
        self._loads: list[LoadChunk] = []
        self._sums: list[tuple[int, ...]] = []  # journaled checksums of each load
        self._items: list[LoadItem] = []
        self._next_submit = 0
        self._next_process = 0
        # items whose reads a full IO queue has not all taken, in submission order: topped up as
        # the queue frees room, never waited for on the forward's behalf except by the item it awaits
        self._unsent: collections.deque[LoadItem] = collections.deque()
        self._room_waited = False  # the item awaited waited for room in the queue (a stall on reads)
        self._layer_events: dict[int, object] = {}
        self._bad: torch.Tensor | None = None  # bool [loads, layers] on the device: checksum mismatches
        self._bad_host: torch.Tensor | None = None
        self._verdict_buf: torch.Tensor | None = None  # pinned, reused (see _verdicts)
        self._verified: object = None  # CUDA event: _bad_host holds the step's mismatches
        self._failed_keys: set[bytes] = set()
        self._failed_blocks: set[int] = set()
        self._failed_log: set[bytes] = set()  # every key failed since take_failed_keys()
        self._stragglers: list[tuple[LoadItem, object]] = []  # (item, event) of reads that missed their deadline
        self._whole_ready: object = None  # CUDA event: the chunk-major loads (mapped slabs, whole-slot reads) are scattered
        self._whole_pending = False  # chunk-major loads issued that no wait_layer has waited for yet
        self._t0 = 0.0
        self._bytes = 0  # loaded this step, reported with the step's seconds at finish()
        self._waited, self._layerwise = 0.0, False  # the forward's waits of a layer-wise load
        # a layer-wise load's read-rate sample: bytes done when the forward last stalled on a read
        self._stall_bytes, self._stall_end = 0, None
        self._mapped_bytes = 0  # copied chunk-major from mapped slabs (one DMA, no host wait)
        self._pool_free: list[torch.Tensor] = []  # detached jobs' pinned verdict buffers not in use
        self._pool_sized, self._pool_size = False, 0
        self._pool_taken: torch.Tensor | None = None
        self.trace: list[tuple[str, int, float]] | None = None
        # (what, layer, CUDA event) of the last step that loaded: "start" (the compute stream at
        # start), "loaded" (the load stream past a layer's scatter), "compute" (the compute stream
        # past a layer's wait); None = off (TUTTI_TRACE on CUDA sets it; gpu_timeline reads it)
        self.gpu_marks: list[tuple[str, int, object]] | None = None

    # ---------------------------------------------------------------- step
    def start(self, loads: list[LoadChunk], *, layerwise: bool, file_path: bool = True) -> None:
        """`file_path=False`: only chunks in mapped slabs load; the rest fail (vLLM recomputes
        them), since reading them would make the caller wait (launch_detached)."""
        ctx = self.ctx
        self.resolve()  # the last step's verdicts, if nobody asked for them
        self._items, self._loads, self._sums = [], [], []
        self._next_submit = self._next_process = 0
        self._unsent.clear()
        self._layer_events = {}
        self._whole_ready, self._whole_pending = None, False
        bad_writers: dict[str, Exception] = {}
        if loads:
            self.journal.new_step()
            if self.foreign is not None:
                bad_writers = self.foreign.new_step({ld.source for ld in loads if ld.source is not None})
        for ld in loads:
            try:
                if ld.source in bad_writers:
                    raise bad_writers[ld.source]
                sums = self._source(ld)[1].checksums(ld.slot, ld.key)
            except Exception as exc:  # noqa: BLE001 - another writer's files, refused, gone or damaged
                self._fail(ld, f"writer {ld.source!r} cannot be read: {exc}")
                continue
            if sums is None or len(sums) != ctx.num_layers:
                self._fail(ld, "not in this worker's store" if ld.source is None else
                           f"no longer held by writer {ld.source!r} (evicted or rewritten)")
            else:
                self._loads.append(ld)
                self._sums.append(sums)
        if not self._loads:
            return
        self._t0 = time.perf_counter()
        if self.trace is not None and len(self.trace) < 100_000:
            self.trace.append(("start", -1, self._t0))
        if self.gpu_marks is not None:
            self.gpu_marks.clear()
            self._gpu_mark("start", -1, torch.cuda.current_stream(ctx.device))
        self._bytes = 0
        self._waited, self._layerwise = 0.0, layerwise
        self._stall_bytes, self._stall_end = 0, None
        self._mapped_bytes = 0
        if ctx.cuda:
            # blocks just handed to these requests may still be in use by work already queued
            # on the compute stream (a freed request's last step): scatter only after it
            self.stream.wait_stream(torch.cuda.current_stream(ctx.device))
        # verify_checksums: false trusts this writer's own chunks only: another writer's are
        # checked whatever the flag says (it may evict and rewrite a slot while we read it)
        foreign = any(ld.source is not None for ld in self._loads)
        if (ctx.cfg.verify_checksums or foreign) and ctx.mac is None:  # keyed tags are checked on the host instead
            with self._on_stream():
                self._bad = torch.zeros((len(self._loads), ctx.num_layers), dtype=torch.bool, device=ctx.device)
        # RAM roots: the chunks whose slabs are mapped, whole (tutti.engine.worker.loads.mapped; one block
        # list for all layers, so not for hybrid models); the rest go through the file path
        done = load_mapped(self) if self.maps and ctx.num_groups == 1 else set()
        if not file_path:
            for i, ld in enumerate(self._loads):
                if i not in done:
                    self._fail(ld, "its slab is not mapped (shrunk, or not yet mapped): loads launched from the "
                               "step's thread never read")
            done = set(range(len(self._loads)))
        elif not layerwise and ctx.num_groups == 1 and ctx.cfg.whole_loads == "chunk":
            # a whole load: one read per chunk's slot, one copy/verify/scatter per group of chunks
            # (tutti.engine.worker.loads.file_chunks); the per-layer items below only where the ring holds no chunk
            rest = [i for i in range(len(self._loads)) if i not in done]
            if load_file_chunks(self, rest):
                done.update(rest)
        for layer in range(ctx.num_layers):
            # a sliding-window layer reads only the chunks with blocks inside the window at the hit's
            # end: the rest of its segments are neither read nor scattered (hybrid models)
            todo = [i for i in range(len(self._loads)) if i not in done
                    and ctx.moves_layer(self._loads[i].block_ids, layer, self._loads[i].skip_blocks)]
            for k in range(0, len(todo), self.per_slot):
                idx = todo[k:k + self.per_slot]
                self._items.append(LoadItem(layer, idx, [self._loads[i] for i in idx]))
        if layerwise:
            self._pump(self.ahead - 1)
        else:
            self.wait_layer(ctx.num_layers - 1)

    # ---------------------------------------------------------------- verify and scatter
    def verify(self, data: torch.Tensor, idx: list[int], layers: list[int], where: int) -> None:
        """Checksums of `data` ([len(idx), len(layers), seg]: loads idx, those layers) against the
        journaled ones, OR-ed into the step's device verdicts (read after the forward). One launch;
        both load paths come through here."""
        ctx = self.ctx
        if self._bad is None:
            return
        n, k = len(idx), len(layers)
        with nvtx_range("verify", where):
            want = ctx.index([as_signed64(self._sums[j][layer]) for j in idx for layer in layers]).view(n, k)
            mismatch = ctx.checksum(data.reshape(n * k, ctx.seg)).view(n, k) != want
            lo = idx[0]
            if idx == list(range(lo, lo + n)) and layers == list(range(layers[0], layers[0] + k)):
                bad = self._bad[lo:lo + n, layers[0]:layers[0] + k]  # consecutive: in place
                torch.logical_or(bad, mismatch, out=bad)
            else:
                rows, cols = ctx.index(idx).unsqueeze(1), ctx.index(layers).unsqueeze(0)
                self._bad[rows, cols] = self._bad[rows, cols] | mismatch

    def scatter(self, data: torch.Tensor, idx: list[int], layers: list[int], good: list[int], where: int) -> None:
        """Rows `good` of `data` (as in verify) into their blocks: one launch for the rows with
        nothing to skip (for all layers at once where every layer has the one block list), the
        partial ones (vLLM's own prefix cache, a sliding window's start, a chunk whose last block
        vLLM computes: LoadChunk.keep_blocks) block by block."""
        ctx = self.ctx
        with nvtx_range("scatter", where):
            if ctx.num_groups == 1:
                full = [r for r in good if not self._partial(self._loads[idx[r]])]
                if full:
                    rows = data if len(full) == len(idx) else data.index_select(0, ctx.index(full))
                    # [layers, rows, seg]: one layer (the file path) as a contiguous [1, rows, seg]
                    src = rows[:, 0].unsqueeze(0) if len(layers) == 1 else rows.transpose(0, 1)
                    ctx.scatter([ctx.caches[layer] for layer in layers], [self._loads[idx[r]].block_ids for r in full],
                                src)
            # one group: only rows with blocks to skip are left; hybrid models: every row, layer by
            # layer (a layer's group decides its blocks and what its window skips)
            rest = good if ctx.num_groups > 1 else [r for r in good if self._partial(self._loads[idx[r]])]
            for li, layer in enumerate(layers if rest else ()):
                skips = {r: ctx.skip_for(self._loads[idx[r]].block_ids, self._loads[idx[r]].skip_blocks, layer)
                         for r in rest}
                if ctx.num_groups > 1:
                    full = [r for r in rest if skips[r] == 0 and self._loads[idx[r]].keep_blocks is None]
                    if full:
                        rows = data[:, li] if len(full) == len(idx) else data[:, li].index_select(0, ctx.index(full))
                        ctx.scatter([ctx.caches[layer]], [ctx.blocks_for(self._loads[idx[r]].block_ids, layer)
                                                          for r in full], rows.unsqueeze(0))
                for r in rest:
                    blocks = ctx.blocks_for(self._loads[idx[r]].block_ids, layer)
                    keep = self._loads[idx[r]].keep_blocks
                    end = len(blocks) if keep is None else min(keep, len(blocks))
                    if skips[r] < end and (skips[r] > 0 or end < len(blocks)):
                        self._scatter_partial(layer, data[r, li], blocks, skips[r], end)

    @staticmethod
    def _partial(ld: LoadChunk) -> bool:
        """Whether a load writes fewer than all of its chunk's blocks (it then goes block by block)."""
        return ld.skip_blocks > 0 or (ld.keep_blocks is not None and ld.keep_blocks < len(ld.block_ids))

    def _tags_match(self, ld: LoadChunk, sums: tuple[int, ...], view: torch.Tensor) -> bool:
        """With a secret: every layer's keyed tag, on the host, before anything is copied."""
        seg, data = self.ctx.seg, view.numpy()
        with nvtx_range("verify", 0):
            return all(self._tag_ok(ld, layer, data[layer * seg:(layer + 1) * seg], sums[layer])
                       for layer in range(self.ctx.num_layers))

    def _tag_ok(self, ld: LoadChunk, layer: int, data, want: int) -> bool:
        """One segment's keyed tag; a mismatch fails the chunk and journals it free."""
        if self.ctx.mac.tag(ld.key, layer, data) == want:
            return True
        self._fail(ld, f"keyed tag mismatch in layer {layer}: not written by a holder of the secret")
        self.forget(ld)
        return False

    def _source(self, ld: LoadChunk) -> tuple[object, JournalView]:
        """(store, journal view) holding `ld`: ours, or another writer's (opened read-only)."""
        if ld.source is None:
            return self.ctx.store, self.journal
        if self.foreign is None:
            raise RuntimeError("this worker reads no other writers")
        return self.foreign.get(ld.source)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.ctx.cuda else nullcontext()

    def wait_layer(self, layer: int) -> None:
        """Before layer `layer` computes: its KV is in the cache (or its blocks marked failed)."""
        if self._whole_pending:
            self._whole_pending = False
            if self._whole_ready is not None:
                torch.cuda.current_stream(self.ctx.device).wait_event(self._whole_ready)
        if not self._items:
            return
        t_wait = time.perf_counter()
        # reads may run `ahead` layers past the one awaited (layer-wise), or to the last layer when
        # the whole load is awaited at once: pumping only the layer being processed drained the
        # read queue at every layer boundary (a small hit had one layer's reads in flight at a time)
        horizon = layer + self.ahead if self._layerwise else self.ctx.num_layers
        with nvtx_range("load_wait", layer):
            while self._next_process < len(self._items) and self._items[self._next_process].layer <= layer:
                item = self._items[self._next_process]
                self._pump(max(horizon, item.layer))
                self._process(item, self._await_sent(item))
                self._next_process += 1
            self._pump(layer + self.ahead)
            ev = None
            for l in [k for k in self._layer_events if k <= layer]:
                ev = self._layer_events.pop(l)  # the load stream is in order: the last one covers the rest
            if ev is not None:
                torch.cuda.current_stream(self.ctx.device).wait_event(ev)
            if self.gpu_marks is not None:
                self._gpu_mark("compute", layer, torch.cuda.current_stream(self.ctx.device))
        self._waited += time.perf_counter() - t_wait
        if self.trace is not None and len(self.trace) < 100_000:
            self.trace.append(("ready", layer, time.perf_counter()))

    def _gpu_mark(self, what: str, layer: int, stream) -> None:
        if len(self.gpu_marks) < 10_000:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            self.gpu_marks.append((what, layer, ev))

    def gpu_timeline(self) -> list[tuple[str, int, float]]:
        """(what, layer, ms after "start") of the last step that loaded, from its CUDA events.
        Waits for them: for benchmarks, after the step, never on the serving path."""
        marks = list(self.gpu_marks or ())
        if not marks or marks[0][0] != "start":
            return []
        start = marks[0][2]
        out = []
        for what, layer, ev in marks[1:]:
            ev.synchronize()
            out.append((what, layer, round(start.elapsed_time(ev), 3)))
        return out

    def after_layer(self, layer: int) -> None:
        if self._items:
            self._pump(layer + self.ahead)

    def finish(self, *, detached: bool = False) -> None:
        """End of the step. Loads the forward pass did not wait for are failed, never served: a
        step whose per-layer hooks did not run (a CUDA graph replayed without them) computed
        without their KV. `detached` (launch_detached): the verdicts go to a buffer of the job's
        own and nothing is counted yet (the job has not landed)."""
        if not self._loads:
            return
        unawaited = self._next_process < len(self._items) or self._whole_pending
        if unawaited:
            n_layers = len({it.layer for it in self._items[self._next_process:]}) or self.ctx.num_layers
            self.wait_layer(self.ctx.num_layers - 1)  # finish the IO so the slots come back
            log.warning("tutti: %d layers of %d loads were not awaited by the forward pass (no per-layer "
                        "hook ran for them); vLLM recomputes them", n_layers, len(self._loads))
            for ld in self._loads:
                self._fail(ld, "the forward pass did not wait for this load")
        span = time.perf_counter() - self._t0
        # bytes and seconds in one report: the hit policy's read rate is their ratio, and a report
        # taken between the two (an asynchronous job's thread) read as an infinitely fast store
        if not self._layerwise:
            rate_bytes, rate_s = self._bytes, span
        elif self._stall_end is not None:  # reads were the bottleneck up to that read: its rate
            rate_bytes, rate_s = self._stall_bytes, self._stall_end - self._t0
        elif self._mapped_bytes:  # copies from RAM the host never waits for: the forward's waits (a high rate)
            rate_bytes, rate_s = self._mapped_bytes, self._waited
        else:  # every read was done before the forward needed it: no rate (faster than needed)
            rate_bytes, rate_s = 0, 0.0
        if not detached:
            self.counters.add(bytes_loaded=self._bytes, load_seconds=span, rate_bytes=rate_bytes, rate_seconds=rate_s)
            self._bytes = 0
        if self._bad is not None:
            if self.ctx.cuda:
                with torch.cuda.stream(self.stream):
                    buf = self._detached_buffer(self._bad.numel()) if detached else self._verdicts(self._bad.numel())
                    self._bad_host = buf.view(self._bad.shape)
                    self._bad_host.copy_(self._bad, non_blocking=True)
                    if not detached:  # a detached job's own event follows (launch_detached)
                        # read by resolve(): a tutti thread (asynchronous loads) sleeps on it, the
                        # step's own thread spins (its wait is on the way to the next step)
                        self._verified = torch.cuda.Event(blocking=threading.current_thread().name.startswith("tutti-"))
                        self._verified.record(self.stream)
            else:
                self._bad_host = self._bad
        self._items = []

    def warm_up(self, max_loads: int, blocks_per_chunk: int, *, detached: bool = False) -> None:
        """At start-up, every kernel a load launches beside the copy kernels: verdicts OR-ed in
        place and by index, rows picked by index, a partial chunk, one layer and every layer.
        CUDA loads a kernel's module on its first launch while holding the context's lock, and
        every thread's launch waits behind it: a serving trace (serve.md, run 14) caught the
        engine's thread stalled 25 ms behind this pipeline's first index_select. Block 0 of the
        caches is read and written back with its own bytes; the verdict buffer is sized for
        `max_loads` chunks a step (pinned memory is not allocated while serving); `detached`: a
        pipeline whose jobs are launched by `launch_detached`, whose verdict buffers are the pool's
        (sized here instead). Hybrid models (several block lists a chunk) load layer by layer: their
        warm-up is the worker's."""
        ctx = self.ctx
        L, bpc = ctx.num_layers, blocks_per_chunk
        blocks = tuple([0] * bpc)
        if detached:
            self.size_detached_pool(max(1, max_loads) * L)
        elif ctx.cuda:
            self._verdicts(max(1, max_loads) * L)
        if ctx.num_groups != 1:
            return
        saved = (self._loads, self._sums, self._bad)
        try:
            with self._on_stream():
                data = torch.empty((3, L, ctx.seg), dtype=torch.uint8, device=ctx.device)
                ctx.gather(ctx.caches, [blocks] * 3, data.transpose(0, 1))
                self._loads = [LoadChunk("warm-up", b"", -1, blocks),
                               LoadChunk("warm-up", b"", -1, blocks, skip_blocks=1 if bpc > 1 else 0),
                               LoadChunk("warm-up", b"", -1, blocks)]
                self._sums = [tuple([0] * L)] * 3
                self._bad = torch.zeros((3, L), dtype=torch.bool, device=ctx.device)
                every = list(range(L))
                self.verify(data, [0, 1, 2], every, 0)  # consecutive: in place
                self.verify(data[0::2], [0, 2], every, 0)  # by index
                self.verify(data[1:2, :1], [1], [0], 0)  # one layer (the file path)
                self.scatter(data, [0, 1, 2], every, [0, 1, 2], 0)  # rows by index, a partial chunk
                self.scatter(data[:, :1], [0, 1, 2], [0], [0, 2], 0)  # one layer
                host = self._bad
                if ctx.cuda:  # the pool's buffers are as large, and none is in use at start-up
                    room = self._pool_free[-1][:self._bad.numel()] if detached else self._verdicts(self._bad.numel())
                    host = room.view(self._bad.shape)
                    host.copy_(self._bad, non_blocking=True)
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)
            _ = bool(host.any())  # as resolve() reads the verdicts
        finally:
            self._loads, self._sums, self._bad = saved

    def _verdicts(self, n: int) -> torch.Tensor:
        """Pinned host room for a step's checksum verdicts, reused step after step (read by
        resolve() before the next step's finish); it grows only past every earlier step's size."""
        if self._verdict_buf is None or self._verdict_buf.numel() < n:
            self._verdict_buf = torch.empty(max(n, 4096), dtype=torch.bool, pin_memory=True)
        return self._verdict_buf[:n]

    def resolve(self) -> None:
        """Read the step's checksum verdicts (once, after the forward) and fail the mismatches."""
        if self._bad_host is None:
            return
        if self._verified is not None:
            with gil_free_wait():
                self._verified.synchronize()  # the load stream's last copy: done before the last layer ran
        bad, loads, sums = self._bad_host, self._loads, self._sums
        self._bad_host = self._bad = self._verified = None
        self._judge(bad, loads, sums)

    def _judge(self, bad: torch.Tensor, loads: list[LoadChunk], sums: list[tuple[int, ...]]) -> None:
        """Fail (and journal free) every load with a mismatched layer in the host verdicts `bad`."""
        if not bool(bad.any()):
            return
        for i, layers in enumerate(bad.tolist()):
            if any(layers) and loads[i].key not in self._failed_keys:
                ld, first = loads[i], layers.index(True)
                self._fail(ld, f"checksum mismatch in layer {first} (stored {sums[i][first]:#018x})")
                self.forget(ld)

    # ---------------------------------------------------------------- detached jobs
    def launch_detached(self, loads: list[LoadChunk]) -> "Detached":
        """Every chunk of `loads` queued on this pipeline's stream from the caller's thread, with
        nothing waited for: copies from mapped slabs (a RAM root), verified and scattered, chunk
        by chunk failing where its slab is not mapped. Returns the job's handle: `ready()` once it
        landed, then `resolve_detached` reads its verdicts. For asynchronous loads launched from
        the step's thread (EngineConfig.async_launch): no second thread takes turns at the GIL
        with the forward pass. Several jobs may be in flight: one stream runs them in order."""
        ctx = self.ctx
        t0 = time.perf_counter()
        started = None
        if ctx.cuda:
            # blocks just handed to these requests may still be in use by work already queued
            # on the compute stream (a freed request's last step): scatter only after it
            self.stream.wait_stream(torch.cuda.current_stream(ctx.device))
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.stream)
        self._pool_taken = None
        try:
            with self._on_stream():
                self.start(loads, layerwise=False, file_path=False)
                self.finish(detached=True)
                landed = None
                if ctx.cuda:
                    landed = torch.cuda.Event(enable_timing=True)  # queried, never waited on
                    landed.record(self.stream)
        except BaseException:
            if self._pool_taken is not None:  # the caller abandons the job: its buffer goes back
                self._pool_free.append(self._pool_taken)  # (a later job's copy into it is ordered after, on this stream)
                self._pool_taken = None
            raise
        job = Detached(loads=self._loads, sums=self._sums, bad_host=self._bad_host, landed=landed,
                       started=started, pool_buffer=self._pool_taken, nbytes=self._bytes,
                       host_seconds=time.perf_counter() - t0, keys=self._failed_keys, blocks=self._failed_blocks)
        self._bad_host = self._bad = self._verified = self._pool_taken = None
        self._loads, self._sums, self._items, self._bytes = [], [], [], 0
        self._failed_keys, self._failed_blocks, self._failed_log = set(), set(), set()
        return job

    def resolve_detached(self, job: "Detached") -> tuple[set[bytes], set[int]]:
        """(keys failed, the blocks they would have written) of a job that is `ready()`; counts
        its bytes with the device's time for them (the read rate of a mapped root)."""
        saved = self._failed_keys, self._failed_blocks, self._failed_log
        self._failed_keys, self._failed_blocks, self._failed_log = job.keys, job.blocks, set(job.keys)
        try:
            if job.bad_host is not None:
                self._judge(job.bad_host, job.loads, job.sums)
        finally:
            keys, blocks = self._failed_log, self._failed_blocks
            self._failed_keys, self._failed_blocks, self._failed_log = saved
            if job.pool_buffer is not None and job.pool_buffer.numel() >= self._pool_size:
                self._pool_free.append(job.pool_buffer)
                job.pool_buffer = None
        if job.nbytes:
            seconds = job.host_seconds
            if job.started is not None and job.landed is not None:
                seconds = max(seconds, job.started.elapsed_time(job.landed) / 1e3)
            self.counters.add(bytes_loaded=job.nbytes, load_seconds=seconds, rate_bytes=job.nbytes,
                              rate_seconds=seconds)
        return keys, blocks

    def can_detach(self) -> bool:
        """A detached job can be launched now (a verdict buffer of its own is free)."""
        return not self.ctx.cuda or bool(self._pool_free) or not self._pool_sized

    def _detached_buffer(self, n: int) -> torch.Tensor:
        """Pinned room for one detached job's verdicts, from a pool sized at start-up (warm_up):
        a job in flight keeps its own until resolved."""
        if not self._pool_sized or (self._pool_free and self._pool_free[-1].numel() < n):
            self.size_detached_pool(n)  # at start-up (warm_up); later only past every earlier size
        if not self._pool_free:
            raise RuntimeError("tutti: no detached verdict buffer is free (can_detach() was not asked)")
        self._pool_taken = self._pool_free.pop()
        return self._pool_taken[:n]

    def size_detached_pool(self, n: int, jobs: int = DETACHED_JOBS) -> None:
        """`jobs` pinned verdict buffers of `n` entries (a job loading every block), at start-up;
        buffers of jobs still in flight are dropped when they come back (a smaller size)."""
        size = max(n, 4096)
        self._pool_free = [torch.empty(size, dtype=torch.bool, pin_memory=self.ctx.cuda) for _ in range(jobs)]
        self._pool_sized, self._pool_size = True, size

    def take_failed_keys(self) -> set[bytes]:
        out, self._failed_log = self._failed_log, set()
        return out

    def abandon(self, loads: list[LoadChunk], why: str) -> None:
        """A load that raised outside the per-chunk checks (a bug, an unexpected error), in start()
        or while awaited: every chunk of it fails and is counted (load_failed), so the planner
        stops offering it; otherwise vLLM recomputes, asks again, gets the same hit and the request
        never runs. Reads already in flight give their slots back once they land (as stragglers);
        the compute stream waits for whatever the load stream queued, so nothing of it lands on
        blocks after vLLM recomputes them; the next start() finds a clean pipeline."""
        for item in self._items[self._next_process:]:
            item.unsent = []  # never sent now
            if item.slot is not None:
                self._stragglers.append((item, None))
        self._unsent.clear()
        if self.ctx.cuda:
            torch.cuda.current_stream(self.ctx.device).wait_stream(self.stream)
        self._items, self._loads, self._sums = [], [], []
        self._next_submit = self._next_process = 0
        self._layer_events, self._whole_ready, self._whole_pending = {}, None, False
        self._bad = self._bad_host = self._verified = None
        for ld in loads:
            self._fail(ld, why)

    def take_failed_blocks(self) -> set[int]:
        self.resolve()
        out, self._failed_blocks = self._failed_blocks, set()
        self._failed_keys = set()
        return out

    # ---------------------------------------------------------------- per item
    def _pump(self, max_layer: int) -> None:
        """Submit reads for queued items up to `max_layer` while load slots are free."""
        ctx = self.ctx
        if self._stragglers:
            self._reap_stragglers()
        if not self._send_unsent():
            return  # the queue is full: later items wait their turn
        # an item failed before it was pumped (no slot came in time) is never read afterwards
        self._next_submit = max(self._next_submit, self._next_process)
        while self._next_submit < len(self._items):
            item = self._items[self._next_submit]
            if item.layer > max_layer:
                return
            slot = self.ring.try_acquire(wait_host=not self.maps)
            if slot is None:
                return
            item.slot = slot
            reqs = []
            for i, ld in enumerate(item.chunks):
                if ld.key in self._failed_keys:
                    continue
                if self.maps:
                    src = self._mapped(ld, item.layer)
                    if src is not None:  # a RAM root: one copy (a DMA on CUDA) from the page cache
                        item.mapped[i] = src
                        self._copy_mapped(slot, i, src)
                        continue
                    self.ring.wait_host(slot)  # this one goes through the host buffer
                try:
                    store = self._source(ld)[0]
                    fd, off = store.acquire(ld.slot, item.layer)
                except Exception as exc:  # noqa: BLE001 - a slab missing, refused, damaged, no fd left...
                    self._fail(ld, f"cannot open its slab: {exc}")  # that chunk's blocks, never the step
                    continue
                item.pinned.append((store, ld.slot))
                reqs.append(IORequest(fd, off, self.ring.buffer, slot.offset + i * ctx.seg, ctx.seg, READ, tag=i))
            item.unsent = reqs
            self._unsent.append(item)
            self._next_submit += 1
            with nvtx_range("read", item.layer):
                sent = self._send_unsent()
            if self.trace is not None and len(self.trace) < 100_000:
                self.trace.append(("read", item.layer, time.perf_counter()))
            if not sent:
                return

    def _send_unsent(self) -> bool:
        """Hand the queue what it takes now of the items' reads not yet sent, oldest first; never
        waits for room (the forward thread calls this: a full queue must not hold up a layer whose
        reads have landed). True when nothing is left unsent."""
        ctx = self.ctx
        while self._unsent:
            item = self._unsent[0]
            if item.unsent:
                taken = ctx.queue.submit(item.unsent)
                if taken:
                    item.futures.extend(taken)
                    if ctx.reads is not None:
                        ctx.reads.track(taken)  # the stores' writes yield until these land
                    item.unsent = item.unsent[len(taken):]
                if item.unsent:
                    return False
            self._unsent.popleft()
        return True

    def _mapped(self, ld: LoadChunk, layer: int) -> torch.Tensor | None:
        try:
            return self._source(ld)[0].mapped(ld.slot, layer)
        except Exception:  # noqa: BLE001 - the file path reports what is wrong
            return None

    def _copy_mapped(self, slot: StagingSlot, i: int, src: torch.Tensor) -> None:
        seg = self.ctx.seg
        if self.ctx.cuda:
            with torch.cuda.stream(self.stream):  # ordered before this item's verify and scatter
                slot.device[i * seg:(i + 1) * seg].copy_(src, non_blocking=True)
        else:
            slot.host[i * seg:(i + 1) * seg].copy_(src)

    def _await_sent(self, item: LoadItem) -> float:
        """Before the forward waits on `item`: it has its slot and the queue has taken all its reads.
        The one place a full queue is waited for on the forward's behalf: it needs these reads now.
        Returns the deadline its reads share (io_timeout_s from now)."""
        deadline = time.monotonic() + self.ctx.cfg.io_timeout_s
        self._room_waited = False
        while True:
            if item.slot is None:
                self._pump(item.layer)  # older unsent reads first; stops at a full queue or no free slot
            elif item.unsent:
                self._send_unsent()
            if item.slot is not None and not item.unsent:
                return deadline
            if item.slot is None and not self._unsent:
                return deadline  # no load slot free, the queue not full: _process fails it
            left = deadline - time.monotonic()
            if left <= 0:
                return deadline  # _process fails what was not sent
            self._room_waited = True  # the forward waits on the storage (the read-rate sample counts it)
            self.ctx.queue.poll(min(0.05, left))

    def _process(self, item: LoadItem, deadline: float | None = None) -> None:
        ctx, seg = self.ctx, self.ctx.seg
        slot = item.slot
        if slot is None:  # every load slot is held by reads that missed their deadline
            for ld in item.chunks:
                self._fail(ld, "no staging slot free: earlier reads are stalled")
            return
        errors = {}
        stalled = False
        if deadline is None:
            deadline = time.monotonic() + ctx.cfg.io_timeout_s
        blocked = self._layerwise and (self._room_waited or any(not f.done() for f in item.futures))
        self._room_waited = False
        if item.unsent:  # never sent (_await_sent ran out of time): those chunks fail as stalled reads do
            for r in item.unsent:
                errors[r.tag] = TimeoutError(f"read of layer {item.layer} not submitted after "
                                             f"{ctx.cfg.io_timeout_s}s: the IO queue stayed full")
            stalled = True
            item.unsent = []
            if item in self._unsent:
                self._unsent.remove(item)
        with nvtx_range("io_wait", item.layer):
            for fut in item.futures:
                if not fut.done():
                    self._send_unsent()  # later items' reads go out as this one's land
                try:
                    fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except TimeoutError as exc:  # a stalled file system: fail the chunk, never hang the step
                    errors[fut.request.tag] = exc
                    stalled = True
                except OSError as exc:
                    errors[fut.request.tag] = exc
        if self.trace is not None and len(self.trace) < 100_000:
            self.trace.append(("io_done", item.layer, time.perf_counter()))
        good: list[tuple[int, LoadChunk]] = []
        for i, ld in enumerate(item.chunks):
            if ld.key in self._failed_keys:
                continue
            if i in errors:
                self._fail(ld, f"read of layer {item.layer} failed: {errors[i]}")
                if not isinstance(errors[i], TimeoutError):
                    # A truncated or deleted slab reads short: the chunk is gone, so journal it free
                    # as for a checksum mismatch; otherwise every restart would plan and fail it again.
                    self.forget(ld)
            else:
                good.append((i, ld))
        if ctx.mac is not None and good:
            good = self._check_tags(item, good)
        n = len(item.chunks)
        ev = None
        if good:
            with self._on_stream():
                src = slot.host[: n * seg].view(n, seg)
                if ctx.cuda:
                    if not item.mapped:
                        slot.device[: n * seg].copy_(slot.host[: n * seg], non_blocking=True)
                    else:  # the mapped ones are on the device already
                        for i, _ in good:
                            if i not in item.mapped:
                                slot.device[i * seg:(i + 1) * seg].copy_(slot.host[i * seg:(i + 1) * seg],
                                                                         non_blocking=True)
                    src = slot.device[: n * seg].view(n, seg)
                data = src.view(n, 1, seg)
                self.verify(data, item.idx, [item.layer], item.layer)
                self.scatter(data, item.idx, [item.layer], [i for i, _ in good], item.layer)
                if ctx.cuda:
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                    self._layer_events[item.layer] = ev
                    if self.gpu_marks is not None:
                        self._gpu_mark("loaded", item.layer, self.stream)
            self._bytes += len(good) * seg
        if blocked:
            self._stall_bytes, self._stall_end = self._bytes, time.perf_counter()
        if stalled:  # a late read may still land in this slot: it comes back once every read is done
            self._stragglers.append((item, ev))
        else:
            self._done_with(item, ev)

    def _done_with(self, item: LoadItem, ev: object) -> None:
        """Every read of `item` has landed: its staging slot and slab descriptors go back."""
        for slot in [item.slot] + item.more_slots:
            self.ring.release(slot, ev)
        for store, s in item.pinned:
            store.release(s)
        item.pinned = []

    def _reap_stragglers(self) -> None:
        still = []
        for item, ev in self._stragglers:
            if all(f.done() for f in item.futures):
                self._done_with(item, ev)
            else:
                still.append((item, ev))
        self._stragglers = still

    def _check_tags(self, item: LoadItem, good: list[tuple[int, LoadChunk]]) -> list[tuple[int, LoadChunk]]:
        """With a secret: each segment's keyed tag, on the host, before anything reaches the GPU."""
        seg = self.ctx.seg
        host = item.slot.host.numpy()
        with nvtx_range("verify", item.layer):
            return [(i, ld) for i, ld in good
                    if self._tag_ok(ld, item.layer, item.mapped[i].numpy() if i in item.mapped else
                                    host[i * seg:(i + 1) * seg], self._sums[item.idx[i]][item.layer])]

    def _scatter_partial(self, layer: int, seg: torch.Tensor, blocks: tuple[int, ...], skip: int,
                         keep: int | None = None) -> None:
        """Scatter only blocks[skip:keep]: not the first `skip` (vLLM's own prefix cache, or blocks
        a sliding-window group no longer holds), nor those from `keep` on (the prompt's last block,
        which vLLM computes itself)."""
        ctx = self.ctx
        bpc = len(blocks)
        keep = bpc if keep is None else min(keep, bpc)
        tok_bytes = ctx.seg_token_bytes
        per_block = ctx.chunk_tokens // bpc
        t0, t1 = skip * per_block, keep * per_block
        need = segment_bytes(t1 - t0, tok_bytes)  # the span as a segment of its own (padded)
        start, end = token_span(t0, t1, tok_bytes)
        part = torch.zeros(need, dtype=torch.uint8, device=seg.device)
        part[: end - start].copy_(seg[start:end])
        ctx.scatter([ctx.caches[layer]], [blocks[skip:keep]], part.view(1, 1, need))

    def _fail(self, ld: LoadChunk, why: str) -> None:
        if ld.key not in self._failed_keys:
            log.warning("tutti: load of chunk %s for request %s failed: %s; vLLM recomputes it",
                        ld.key.hex()[:16], ld.req_id, why)
            self._failed_keys.add(ld.key)
            self._failed_log.add(ld.key)
            self.counters.record(load_failed=[ld.key])
        self._failed_blocks.update(self.ctx.written_blocks(ld.block_ids, ld.skip_blocks, ld.keep_blocks))

