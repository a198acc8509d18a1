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

import threading
import time

import torch

from tutti.engine.worker.context import log, nvtx_range
from tutti.engine.worker.loads.core import LoadCore
from tutti.engine.worker.loads.detached import DetachedLoads
from tutti.engine.worker.loads.file_chunks import load_file_chunks
from tutti.engine.worker.loads.items import LoadItem
from tutti.engine.worker.loads.mapped import load_mapped
from tutti.engine.plan import LoadChunk
from tutti.engine.worker.staging import StagingSlot
from tutti.io.queue import READ, IORequest


class LoadPipeline(DetachedLoads, LoadCore):
    """The layer-wise pipeline, and whole loads where no hook runs (see the module's docstring)."""

    # ---------------------------------------------------------------- step
    def start(self, loads: list[LoadChunk], *, layerwise: bool, file_path: bool = True) -> None:
        """`file_path=False`: only chunks in mapped slabs load; the rest fail (vLLM recomputes
        them), since reading them would make the caller wait (launch_detached)."""
        ctx = self.ctx
        self.resolve()  # the last step's verdicts, if nobody asked for them
        self._items, self.loads, self.sums = [], [], []
        self._next_submit = self._next_process = 0
        self._unsent.clear()
        self._layer_events = {}
        self.whole_ready, self.whole_pending = None, False
        bad_writers: dict[str, Exception] = {}
        if loads:
            self.journal.new_step()
            if self.foreign is not None:
                bad_writers = self.foreign.new_step({ld.source for ld in loads if ld.source is not None})
        for ld in loads:
            try:
                if ld.source in bad_writers:
                    raise bad_writers[ld.source]
                sums = self.source(ld)[1].checksums(ld.slot, ld.key)
            except Exception as exc:  # noqa: BLE001 - another writer's files, refused, gone or damaged
                self.fail(ld, f"writer {ld.source!r} cannot be read: {exc}")
                continue
            if sums is None or len(sums) != ctx.num_layers:
                self.fail(ld, "not in this worker's store" if ld.source is None else
                           f"no longer held by writer {ld.source!r} (evicted or rewritten)")
            else:
                self.loads.append(ld)
                self.sums.append(sums)
        if not self.loads:
            return
        self._t0 = time.perf_counter()
        if self.trace is not None and len(self.trace) < 100_000:
            self.trace.append(("start", -1, self._t0))
        if self.gpu_marks is not None:
            self.gpu_marks.clear()
            self._gpu_mark("start", -1, torch.cuda.current_stream(ctx.device))
        self.step_bytes = 0
        self._waited, self._layerwise = 0.0, layerwise
        self._stall_bytes, self._stall_end = 0, None
        self.mapped_bytes = 0
        if ctx.cuda:
            # blocks just handed to these requests may still be in use by work already queued
            # on the compute stream (a freed request's last step): scatter only after it
            self.stream.wait_stream(torch.cuda.current_stream(ctx.device))
        # verify_checksums: false trusts this writer's own chunks only: another writer's are
        # checked whatever the flag says (it may evict and rewrite a slot while we read it)
        foreign = any(ld.source is not None for ld in self.loads)
        if (ctx.cfg.verify_checksums or foreign) and ctx.mac is None:  # keyed tags are checked on the host instead
            with self.on_stream():
                self._bad = torch.zeros((len(self.loads), ctx.num_layers), dtype=torch.bool, device=ctx.device)
        # RAM roots: the chunks whose slabs are mapped, whole (tutti.engine.worker.loads.mapped; one block
        # list for all layers, so not for hybrid models); the rest go through the file path
        done = load_mapped(self) if self.maps and ctx.num_groups == 1 else set()
        if not file_path:
            for i, ld in enumerate(self.loads):
                if i not in done:
                    self.fail(ld, "its slab is not mapped (shrunk, or not yet mapped): loads launched from the "
                               "step's thread never read")
            done = set(range(len(self.loads)))
        elif not layerwise and ctx.num_groups == 1 and ctx.cfg.whole_loads == "chunk":
            # a whole load: one read per chunk's slot, one copy/verify/scatter per group of chunks
            # (tutti.engine.worker.loads.file_chunks); the per-layer items below only where the ring holds no chunk
            rest = [i for i in range(len(self.loads)) if i not in done]
            if load_file_chunks(self, rest):
                done.update(rest)
        for layer in range(ctx.num_layers):
            # a sliding-window layer reads only the chunks with blocks inside the window at the hit's
            # end: the rest of its segments are neither read nor scattered (hybrid models)
            todo = [i for i in range(len(self.loads)) if i not in done
                    and ctx.moves_layer(self.loads[i].block_ids, layer, self.loads[i].skip_blocks)]
            for k in range(0, len(todo), self.per_slot):
                idx = todo[k:k + self.per_slot]
                self._items.append(LoadItem(layer, idx, [self.loads[i] for i in idx]))
        if layerwise:
            self._pump(self.ahead - 1)
        else:
            self.wait_layer(ctx.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        """Before layer `layer` computes: its KV is in the cache (or its blocks marked failed)."""
        if self.whole_pending:
            self.whole_pending = False
            if self.whole_ready is not None:
                torch.cuda.current_stream(self.ctx.device).wait_event(self.whole_ready)
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

    def after_layer(self, layer: int) -> None:
        if self._items:
            self._pump(layer + self.ahead)

    def finish(self, *, detached: bool = False) -> None:
        """End of the step. Loads the forward pass did not wait for are failed, never served: a
        step whose per-layer hooks did not run (a CUDA graph replayed without them) computed
        without their KV. `detached` (launch_detached): the verdicts go to a buffer of the job's
        own and nothing is counted yet (the job has not landed)."""
        if not self.loads:
            return
        unawaited = self._next_process < len(self._items) or self.whole_pending
        if unawaited:
            n_layers = len({it.layer for it in self._items[self._next_process:]}) or self.ctx.num_layers
            self.wait_layer(self.ctx.num_layers - 1)  # finish the IO so the slots come back
            log.warning("tutti: %d layers of %d loads were not awaited by the forward pass (no per-layer "
                        "hook ran for them); vLLM recomputes them", n_layers, len(self.loads))
            for ld in self.loads:
                self.fail(ld, "the forward pass did not wait for this load")
        span = time.perf_counter() - self._t0
        # bytes and seconds in one report: the hit policy's read rate is their ratio, and a report
        # taken between the two (an asynchronous job's thread) read as an infinitely fast store
        if not self._layerwise:
            rate_bytes, rate_s = self.step_bytes, span
        elif self._stall_end is not None:  # reads were the bottleneck up to that read: its rate
            rate_bytes, rate_s = self._stall_bytes, self._stall_end - self._t0
        elif self.mapped_bytes:  # copies from RAM the host never waits for: the forward's waits (a high rate)
            rate_bytes, rate_s = self.mapped_bytes, self._waited
        else:  # every read was done before the forward needed it: no rate (faster than needed)
            rate_bytes, rate_s = 0, 0.0
        if not detached:
            if any(ld.tier for ld in self.loads):  # a lower tier's reads set this step's pace: its own sample
                self.counters.add(bytes_loaded=self.step_bytes, load_seconds=span, lower_rate_bytes=rate_bytes,
                                  lower_rate_seconds=rate_s)
            else:
                self.counters.add(bytes_loaded=self.step_bytes, load_seconds=span, rate_bytes=rate_bytes,
                                  rate_seconds=rate_s)
            self.step_bytes = 0
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

    # ---------------------------------------------------------------- per item
    def _pump(self, max_layer: int) -> None:
        """Submit reads for queued items up to `max_layer` while load slots are free."""
        ctx = self.ctx
        if self.stragglers:
            self.reap_stragglers()
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
                if ld.key in self.failed_keys:
                    continue
                if self.maps:
                    src = self._mapped(ld, item.layer)
                    if src is not None:  # a RAM root: one copy (a DMA on CUDA) from the page cache
                        item.mapped[i] = src
                        self._copy_mapped(slot, i, src)
                        continue
                    self.ring.wait_host(slot)  # this one goes through the host buffer
                try:
                    store = self.source(ld)[0]
                    fd, off = store.acquire(ld.slot, item.layer)
                except Exception as exc:  # noqa: BLE001 - a slab missing, refused, damaged, no fd left...
                    self.fail(ld, f"cannot open its slab: {exc}")  # that chunk's blocks, never the step
                    continue
                item.pinned.append((store, ld.slot))
                if ctx.codec is None:
                    reqs.append(IORequest(fd, off, self.ring.buffer, slot.offset + i * ctx.seg, ctx.seg, READ, tag=i))
                else:  # the stored (encoded) segment, into the slot's twin: _process decodes it into the slot
                    reqs.append(IORequest(fd, off, self.ring.encoded, slot.encoded_offset + i * ctx.stored_seg,
                                          ctx.stored_seg, READ, tag=i))
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
            return self.source(ld)[0].mapped(ld.slot, layer)
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
                self.fail(ld, "no staging slot free: earlier reads are stalled")
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
            if ld.key in self.failed_keys:
                continue
            if i in errors:
                self.fail(ld, f"read of layer {item.layer} failed: {errors[i]}")
                if not isinstance(errors[i], TimeoutError):
                    # A truncated or deleted slab reads short: the chunk is gone, so journal it free
                    # as for a checksum mismatch; otherwise every restart would plan and fail it again.
                    self.forget(ld)
            else:
                good.append((i, ld))
        if ctx.codec is not None and good:  # decoded into the slot here, then as without a codec
            sseg, enc = ctx.stored_seg, self.ring.encoded[slot.encoded_offset:]
            good = [(i, ld) for i, ld in good
                    if self.decoded(ld, item.layer, enc[i * sseg:(i + 1) * sseg], slot.host[i * seg:(i + 1) * seg])]
        if ctx.mac is not None and good:
            good = self._check_tags(item, good)
        n = len(item.chunks)
        ev = None
        if good:
            with self.on_stream():
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
            self.step_bytes += len(good) * ctx.stored_seg  # as read (seg without a codec)
        if blocked:
            self._stall_bytes, self._stall_end = self.step_bytes, time.perf_counter()
        if stalled:  # a late read may still land in this slot: it comes back once every read is done
            self.stragglers.append((item, ev))
        else:
            self._done_with(item, ev)
