"""One worker's half of the engine: the load pipeline, the store pipeline and the writer thread
behind the calls the connector makes each step.

    start_step(plan, layerwise)  loads start (layer-wise, or all of them now for a step that
                                 runs no per-layer hooks); stores are noted
    wait_layer(l) / save_layer(l) per-layer hooks of a layer-wise step
    end_step()                   loads finished (unawaited ones failed); stores gathered
    take_failed_blocks()         checksum verdicts read back, once, after the forward

On CUDA, scatters and gathers run on side streams ordered by events, and no call here makes
the host wait for the GPU except reading the verdicts of a step that loaded; on the CPU the
same code runs with synchronous kernels.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import time
from typing import Callable, Sequence

import torch

from tutti.engine.config import resolve
from tutti.engine.config.resolve import Decisions
from tutti.engine.config.settings import READS_FIRST_BYTES, EngineConfig
from tutti.engine.worker.context import Counters, JournalView, WorkerContext, log
from tutti.engine.worker.loads.pipeline import LoadPipeline
from tutti.engine.plan import LoadChunk, StepPlan, WorkerReport
from tutti.engine.worker.staging import DeviceRing, RegionArena, StagingRing
from tutti.engine.worker.stores import StorePipeline
from tutti.engine.worker.writer import Writer
from tutti.io.queue import READ, IOQueue, IORequest, ReadsFirst, submit_all


# a job launched from the step's thread (EngineConfig.async_launch) copies, verifies and scatters
# this many chunks (at most these bytes) per group, in device memory held from start-up
INLINE_GROUP_CHUNKS = 16
INLINE_GROUP_BYTES = 512 << 20




class _EncodedTwins:
    """With a codec (tutti.codec): one more registered host buffer, cut into the encoded twins of
    the load rings (sync, async) and of the store arena (tutti.engine.worker.staging); without one,
    nothing. A ring slot's twin holds the stored segments of every raw segment the slot can hold
    (ceil(slot / seg) of them: the chunk-major path cuts the whole ring in chunks, across slots)."""

    def __init__(self, ctx: WorkerContext, slot_bytes: int, sync_slots: int, async_slots: int, regions: int) -> None:
        self.buffer = None
        if ctx.codec is None:
            return
        from tutti.io.buffers import aligned_buffer

        self.slot = -(-slot_bytes // ctx.seg) * ctx.stored_seg
        self.region = ctx.stored_chunk_bytes
        self.spans = [(0, sync_slots), (sync_slots * self.slot, async_slots)]  # (offset, slots) of each ring
        self.arena_at = (sync_slots + async_slots) * self.slot
        # host only (reads land here, then decode; encode, then writes): not pinned for the device
        self.buffer = aligned_buffer(max(1, self.arena_at + regions * self.region), pin=False)

    def ring(self, which: int) -> dict:
        if self.buffer is None:
            return {}
        at, n = self.spans[which]
        return {"encoded": self.buffer[at:at + n * self.slot], "encoded_slot_bytes": self.slot}

    def arena(self) -> dict:
        if self.buffer is None:
            return {}
        return {"encoded": self.buffer[self.arena_at:], "encoded_region_bytes": self.region}


class WorkerPipeline:
    """Moves bytes between the store's slots and the paged KV cache."""

    def __init__(self, cfg: EngineConfig, *, caches: Sequence[torch.Tensor], layout, store, io_queue: IOQueue,
                 kernel, checksum: Callable[[torch.Tensor], torch.Tensor], segment_bytes: int,
                 chunk_tokens: int, kernel_blocks_per_block: int = 1, staging: torch.Tensor | None = None,
                 writes: bool = True, mac=None, foreign=None, group_of_layer: list[int] | None = None,
                 async_loads: bool | str = False, decisions: Decisions | None = None, codec=None,
                 stored_segment_bytes: int = 0, lower: Sequence = ()) -> None:
        self.cfg = cfg
        self.decisions = decisions if decisions is not None else Decisions()  # every "auto" decided (resolve)
        if group_of_layer is not None and len(group_of_layer) != len(caches):
            raise ValueError(f"group_of_layer: {len(group_of_layer)} entries for {len(caches)} layers")
        # codec: tutti.codec, None for "identity"; stored_segment_bytes: a layer's stride in a slot under it
        self.ctx = WorkerContext(cfg, list(caches), layout, store, io_queue, kernel, checksum, segment_bytes,
                                 chunk_tokens, kernel_blocks_per_block, writes, mac, group_of_layer, codec=codec,
                                 stored_seg=stored_segment_bytes)
        if self.decisions.take("reads_first", resolve.reads_first(cfg.reads_first, window=cfg.write_window_bytes)):
            self.ctx.reads = ReadsFirst(READS_FIRST_BYTES)  # the stores' writes yield to the loads' reads
        slot_bytes = cfg.staging_slot_bytes  # staging vs segment sizes: checked once, in check_geometry
        if staging is None:
            from tutti.io.buffers import aligned_buffer

            staging = aligned_buffer(slot_bytes * cfg.staging_slots)
        # The first slots serve the rolling loads; the rest is the store arena, cut in whole chunks.
        load_slots = cfg.staging_slots - cfg.max_inflight_stores
        load_bytes = slot_bytes * load_slots
        # Asynchronous loads (tutti.engine.worker.async_loads) get slots of their own, carved from the same
        # registered buffer: every load slot but one where every hit loads that way, a quarter (at
        # least one) for hybrid models otherwise.
        async_slots = 0
        if async_loads == "split":  # layer-wise loads, and the hits past the step's budget asynchronously
            if load_slots < 2:
                raise ValueError(f"sync_load_budget_bytes: hits past the budget load asynchronously, in load "
                                 f"staging slots of their own, and staging_slots={cfg.staging_slots} - "
                                 f"max_inflight_stores={cfg.max_inflight_stores} leaves {load_slots}; raise "
                                 "staging_slots, lower max_inflight_stores, or set sync_load_budget_bytes to \"off\"")
            async_slots = max(1, load_slots // 4)
        elif async_loads:
            if load_slots < 2:
                raise ValueError(f"async_loads: needs at least 2 load staging slots, and staging_slots="
                                 f"{cfg.staging_slots} - max_inflight_stores={cfg.max_inflight_stores} leaves "
                                 f"{load_slots}; raise staging_slots or lower max_inflight_stores")
            async_slots = load_slots - 1
        elif group_of_layer is not None and load_slots > 1:
            async_slots = max(1, load_slots // 4)
        sync_bytes = load_bytes - async_slots * slot_bytes
        twins = _EncodedTwins(self.ctx, slot_bytes, sync_bytes // slot_bytes, async_slots,
                              slot_bytes * cfg.max_inflight_stores // self.ctx.chunk_bytes)
        ring = StagingRing(staging[:sync_bytes], slot_bytes, self.ctx.device, **twins.ring(0))
        arena = RegionArena(staging, load_bytes, slot_bytes * cfg.max_inflight_stores, self.ctx.chunk_bytes,
                            self.ctx.device, sums_per_region=self.ctx.num_layers, **twins.arena())
        io_queue.register_buffers([staging] if twins.buffer is None else [staging, twins.buffer])
        self.counters = Counters()
        self.journal = JournalView(store, follows_writer=not writes)
        self.writer = Writer()
        # the tiers below `store`, slowest last (tutti.engine.sched.tiers plans the copies between them)
        self.ctx.lower = [(st, JournalView(st, follows_writer=not writes)) for st in lower]
        self.copier = None
        if self.ctx.lower and writes:
            from tutti.engine.worker.tiers import TierCopier

            if self.ctx.reads is None:  # copies down to a drive yield to the hits' reads from it
                self.ctx.reads = ReadsFirst(READS_FIRST_BYTES)
            self.copier = TierCopier([store, *lower], [self.journal, *(j for _, j in self.ctx.lower)], self.counters,
                                     slot_bytes=store.slot_bytes, reads=self.ctx.reads, foreign=foreign,
                                     measure_reads=self.ctx.cfg.promote == "stage")
        self.foreign = foreign  # tutti.engine.sharing.ForeignStores (other writers of the namespace)
        self.loads = LoadPipeline(self.ctx, ring, self.journal, self.counters, self._forget, foreign)
        self.async_loads = None
        on_step = bool(async_slots) and self._launches_async_on_step(cfg, store)
        self.idle_wait_s = self.decisions.take("idle_load_wait_s",
                                               resolve.idle_load_wait_s(cfg.idle_load_wait_s, on_step=on_step))
        self.decisions.take("lookahead", resolve.lookahead(cfg.lookahead, num_layers=self.ctx.num_layers))
        if async_slots:
            from tutti.engine.worker.async_loads import AsyncLoads

            aring = StagingRing(staging[sync_bytes:load_bytes], slot_bytes, self.ctx.device, **twins.ring(1))
            inline = None
            if on_step:
                # device-only room for one job of up to INLINE_GROUP_BYTES (a 4k-token hit of an
                # 8B model): one copy, one verify and one scatter launch each, where the thread's
                # ring (a few chunks) took six of each
                cb = self.ctx.chunk_bytes
                group = max(1, min(INLINE_GROUP_CHUNKS, INLINE_GROUP_BYTES // cb)) * cb
                inline = LoadPipeline(self.ctx, DeviceRing(-(-group // slot_bytes) * slot_bytes, slot_bytes,
                                                           self.ctx.device),
                                      self.journal, self.counters, self._forget, foreign)
            self.async_loads = AsyncLoads(LoadPipeline(self.ctx, aring, self.journal, self.counters, self._forget,
                                                       foreign), inline)
        self.stores = StorePipeline(self.ctx, arena, self.journal, self.counters, self.writer)
        self._plan: StepPlan | None = None
        self._idle = False  # the bound step runs no forward pass (EngineConfig.idle_load_wait_s)
        self.idle_waits = 0  # steps without a forward that waited for asynchronous loads
        self._layerwise = True
        # steps that ran without per-layer hooks (FULL CUDA graphs) and still loaded or stored
        self.whole_steps = {"loads": 0, "stores": 0}
        # (step, layerwise, loads, stores) of the last steps that moved anything: for debugging
        self.recent_steps: collections.deque = collections.deque(maxlen=64)
        self._closed = False
        self.warmup_seconds = 0.0
        self.mapped_bytes = 0
        self.map_seconds = 0.0
        self.probe = (0, 0.0)  # (bytes, seconds) of the start-up read probe
        self.lower_probes: list[tuple[int, float]] = []  # the same of each lower tier
        # TUTTI_TRACE=1: (event, layer, perf_counter) of reads submitted and layers made ready,
        # to see the rolling load next to compute; bounded, off by default.
        self.trace: list[tuple[str, int, float]] | None = [] if os.environ.get("TUTTI_TRACE") else None
        self.loads.trace = self.trace
        # and on CUDA the device's side of the last layer-wise load (LoadPipeline.gpu_timeline)
        self.loads.gpu_marks = [] if self.trace is not None and self.ctx.cuda else None

    def _launches_async_on_step(self, cfg: EngineConfig, store) -> bool:
        """EngineConfig.async_launch: the step's thread launches asynchronous loads where nothing
        is read (every chunk copied from a mapped RAM slab), one block list serves every layer,
        no keyed tag must be computed on the host, and (for "auto") launching does not mean doing
        the work (CUDA)."""
        can = bool(getattr(store, "maps_ram", False)) and self.ctx.num_groups == 1 and self.ctx.mac is None
        if cfg.async_launch == "step" and not can:
            log.warning("tutti: async_launch=\"step\" needs a mapped RAM root, one KV cache group and no secret; "
                        "asynchronous loads run on tutti's loading thread instead (it waits for reads)")
        return self.decisions.take("async_launch", resolve.async_launch(cfg.async_launch, can=can,
                                                                        cuda=self.ctx.cuda)) == "step"

    # ================================================================ facts
    @property
    def queue(self) -> IOQueue:
        return self.ctx.queue

    @queue.setter
    def queue(self, q: IOQueue) -> None:
        self.ctx.queue = q

    @property
    def store(self):
        return self.ctx.store

    @property
    def caches(self) -> list[torch.Tensor]:
        return self.ctx.caches

    @property
    def kernel(self):
        return self.ctx.kernel

    @property
    def num_layers(self) -> int:
        return self.ctx.num_layers

    @property
    def per_slot(self) -> int:
        """Segments one load slot holds (chunks read together per layer)."""
        return self.loads.per_slot

    @property
    def store_regions(self) -> int:
        """Chunks the store arena holds at once: more stores in flight are skipped."""
        return self.stores.arena.num_regions

    @property
    def resident_chunks(self) -> int:
        return len(self.journal)

    # ================================================================ step lifecycle
    def start_step(self, plan: StepPlan, *, layerwise: bool = True) -> None:
        """Bind a step's plan. `layerwise=False` for a step whose forward runs no per-layer hooks
        (a FULL CUDA graph): every load is then done here, before the forward."""
        self._plan, self._layerwise = plan, layerwise
        self._idle = plan.idle
        if plan.loads and not layerwise:
            self.whole_steps["loads"] += 1
        if plan.loads or plan.stores:
            self.recent_steps.append((plan.step, layerwise, len(plan.loads), len(plan.stores)))
        self._guarded(self.loads.start, list(plan.loads), layerwise=layerwise)
        if plan.async_loads:
            if self.async_loads is None:  # a planner that loads asynchronously without hybrid groups: fail them
                raise RuntimeError("asynchronous loads planned for a worker built without them")
            self.async_loads.submit(plan.async_step, plan.async_loads)
        self.stores.planned(plan.stores)
        if plan.copies and self.copier is not None:
            self.copier.submit(plan.copies)

    def wait_layer(self, layer: int) -> None:
        """Before layer `layer` computes: its KV is in the cache (or its blocks marked failed)."""
        self._guarded(self.loads.wait_layer, layer)

    def save_layer(self, layer: int) -> None:
        """After layer `layer` computed: move the read window on."""
        self._guarded(self.loads.after_layer, layer)

    def _guarded(self, fn, *args, **kw) -> None:
        """The step's load calls: an error that escapes the per-chunk checks (a bug, an unexpected
        one) fails the step's loads (vLLM recomputes their blocks), never the forward pass."""
        try:
            fn(*args, **kw)
        except Exception as exc:  # noqa: BLE001
            plan = self._plan
            log.exception("tutti: the loads of step %s failed", plan.step if plan else "?")
            self.loads.abandon(list(plan.loads) if plan else [], f"its load raised {type(exc).__name__}: {exc}")

    def end_step(self) -> None:
        """After the forward was launched: loads finished, the step's stores gathered."""
        self._guarded(self.loads.finish)
        plan, self._plan = self._plan, None
        if plan is None:
            return
        self.counters.record(steps_done=[plan.step])
        if plan.stores and not self._layerwise:
            self.whole_steps["stores"] += 1
        self.stores.run(plan.stores)

    def take_failed_blocks(self) -> set[int]:
        return self.loads.take_failed_blocks()

    def _forget(self, ld: LoadChunk) -> None:
        """A corrupt chunk is journaled as free (off the hot path), so no restart serves it again.
        Another writer's chunk is never touched: its owner finds it corrupt when it loads it."""
        if ld.source is not None:
            return
        store, journal = (self.store, self.journal) if not ld.tier else self.ctx.lower[ld.tier - 1]
        journal.drop(ld.slot, ld.key)
        if not self.ctx.writes:
            return  # the writer reads the same bytes, finds them corrupt too and journals the slot free

        def free() -> None:
            store.free([ld.slot])

        self.writer.submit(free)

    # ================================================================ start-up
    def warm_up(self) -> float:
        """Launch every kernel the steps launch, once, so no request pays a compilation.

        Uses block 0 of the real caches: it is gathered, checksummed and scattered back with
        the same bytes, through the same launch paths (one layer, every layer, a partial chunk)
        as loads and stores. Returns the seconds it took.
        """
        ctx = self.ctx
        t0 = time.perf_counter()
        bpc = max(1, ctx.chunk_tokens // (ctx.layout.block_size * ctx.kbpb))
        blocks = [[0] * bpc]
        seg = torch.zeros(ctx.seg, dtype=torch.uint8, device=ctx.device)
        ctx.gather([ctx.caches[0]], blocks, seg.view(1, 1, -1))
        _ = ctx.checksum(seg.view(1, -1)) != ctx.index([0])
        ctx.scatter([ctx.caches[0]], blocks, seg.view(1, 1, -1))
        if self.stores.arena.num_regions and ctx.writes:
            whole = torch.zeros(ctx.chunk_bytes, dtype=torch.uint8, device=ctx.device)
            ctx.gather(ctx.caches, blocks, whole.view(1, ctx.num_layers, ctx.seg).transpose(0, 1))
            ctx.checksum(whole.view(ctx.num_layers, ctx.seg))
        if bpc > 1:  # a partial chunk: every block is block 0, so its bytes come back unchanged
            self.loads.scatter_partial(0, seg, tuple(blocks[0]), 1)
        # the load path's other kernels, and its verdict buffer for a step loading every block; the
        # asynchronous loads' pipeline too, on their thread's stream (the allocator's pools are per stream)
        max_loads = -(-ctx.layout.num_blocks // (ctx.kbpb * bpc)) + 1
        self.loads.warm_up(max_loads, bpc)
        if self.async_loads is not None:
            stream = self.async_loads.stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.async_loads.pipeline.warm_up(max_loads, bpc)
            inline = self.async_loads.inline
            if inline is not None:  # on its own stream (LoadCore.on_stream), from this thread
                inline.warm_up(max_loads, bpc, detached=True)
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
        t1 = time.perf_counter()
        map_all = getattr(self.store, "map_all", None)
        self.mapped_bytes = map_all() if map_all is not None else 0  # RAM roots: pin the stored pages now
        self.map_seconds = time.perf_counter() - t1
        self.probe = self.probe_read_rate()
        if self.probe[0]:
            self.counters.add(probe_bytes=self.probe[0], probe_seconds=self.probe[1])
        # each lower tier's read rate, what its hits are priced by until its loads measure it
        self.lower_probes = [self.probe_read_rate(256 << 20, 0.5, store=st) for st, _ in self.ctx.lower]
        for nbytes, seconds in self.lower_probes[-1:]:
            if nbytes:
                self.counters.add(lower_rate_bytes=nbytes, lower_rate_seconds=seconds)
        self.warmup_seconds = time.perf_counter() - t0
        return self.warmup_seconds

    def _probe_mapped(self, max_bytes: int, max_seconds: float) -> tuple[int, float]:
        """A mapped RAM root's probe: stored slots copied from the mapping to where a load puts
        them (the device; on the CPU host memory), a whole slot a copy, as its loads copy chunks.
        Without it a restart into a burst of hits had no rate and loaded one hit to measure it,
        recomputing the rest. An empty root copies a scratch buffer of host memory of the kind
        its mapping is (pinned on CUDA, as map_all pins the slabs) instead: RAM's rate does not
        depend on what is stored, and a fresh server's first burst of hits then loads at once
        rather than one hit at a time (6-15k hit tokens of each `scripts/gpu_tiers.sh` serving run in
        results/tiers.md were recomputed that way, `vllm:tutti_declined_hit_tokens_by_reason{reason=
        "unmeasured"}`). The copies are timed, not the buffers' allocation."""
        ctx, store = self.ctx, self.store
        try:
            slots = sorted(store.entries())
        except Exception:  # noqa: BLE001 - a store that cannot list its chunks: nothing to measure
            return 0, 0.0
        nbytes = store.slot_bytes
        done, t0 = 0, time.perf_counter()
        try:
            dst = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
            if slots:
                sources = (store.mapped(s, 0, nbytes) for s in slots)
            else:  # a few dozen copies at most: start-up stays short
                max_bytes = min(max_bytes, 64 * nbytes, 256 << 20)
                sources = itertools.repeat(torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda))
            t0 = time.perf_counter()
            for src in sources:
                if src is None:
                    continue
                dst.copy_(src, non_blocking=True)
                done += nbytes
                if done >= max_bytes or time.perf_counter() - t0 >= max_seconds:
                    break
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)  # start-up: waiting here costs no step
        except Exception:  # noqa: BLE001 - never fails the start
            pass
        return done, time.perf_counter() - t0

    def probe_read_rate(self, max_bytes: int = 1 << 30, max_seconds: float = 1.0, store=None) -> tuple[int, float]:
        """(bytes, seconds): stored segments read the way a file-path load reads them (this
        queue, this staging, a layer of several chunks at a time), at start-up.

        Why: the hit policy chooses from the storage's read rate; a fresh server that had to
        guess would load its first hits whole, and on a slow disk those are slower than
        recomputing. Nothing else uses the load staging yet. A mapped RAM root loads by copying
        from its mapping, not by reading: its probe copies (`_probe_mapped`). Any error
        ends the probe with what it measured: it never fails the start. Up to 1 GiB or 1 s: on the
        H200's virtual disk 256 MiB (0.11-0.16 s) read 1.64 GB/s in one start and 2.35 in the
        next, the layer-wise loads after both 1.56, and the first layer-wise hit chose from the
        2.35 (1.40x recompute): a longer read varies less (not yet measured there). `store`: a
        lower tier's (tutti.engine.worker.tiers), read through the file path as its loads are.
        """
        ctx, ring = self.ctx, self.loads.ring
        if max_bytes <= 0:
            return 0, 0.0
        if store is None:
            store = self.store
            if self.loads.maps:
                return self._probe_mapped(max_bytes, max_seconds)
        try:
            slots = sorted(store.entries())
        except Exception:  # noqa: BLE001 - a store that cannot list its chunks: nothing to measure
            return 0, 0.0
        per = self.loads.per_slot  # segments a load item reads into one staging slot
        if not slots or (slot := ring.try_acquire()) is None:
            return 0, 0.0
        done, t0 = 0, time.perf_counter()
        try:
            for lo in range(0, len(slots), per):
                group = slots[lo:lo + per]
                for layer in range(ctx.num_layers):
                    reqs, held = [], []
                    for i, s in enumerate(group):
                        fd, off = store.acquire(s, layer)
                        held.append(s)
                        if ctx.codec is None:
                            reqs.append(IORequest(fd, off, ring.buffer, slot.offset + i * ctx.seg, ctx.seg, READ))
                        else:  # the stored segment, as a load reads it (into the slot's encoded twin)
                            reqs.append(IORequest(fd, off, ring.encoded, slot.encoded_offset + i * ctx.stored_seg,
                                                  ctx.stored_seg, READ))
                    try:
                        for fut in submit_all(ctx.queue, reqs):
                            fut.result(timeout=ctx.cfg.io_timeout_s)
                            done += ctx.stored_seg  # as read (seg without a codec)
                    finally:
                        for s in held:
                            store.release(s)
                    if done >= max_bytes or time.perf_counter() - t0 >= max_seconds:
                        return done, time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - see the docstring
            pass
        finally:
            ring.release(slot)
        return done, time.perf_counter() - t0

    # ================================================================ reporting
    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, keyed like WorkerReport (bytes_loaded, load_seconds,
        bytes_stored, store_seconds, stores_skipped)."""
        return self.counters.take_stats()

    def take_report(self) -> WorkerReport:
        self.loads.resolve()
        return self.counters.take_report()

    def received_requests(self) -> tuple[set[str], set[str], set[int]]:
        """Asynchronous loads since the last call: (requests received, requests that failed, the
        blocks their failed chunks would have written). In a step that runs no forward pass it
        first waits up to `idle_load_wait_s` for one to land (see EngineConfig)."""
        if self.async_loads is None:
            return set(), set(), set()
        if self._idle and self.idle_wait_s > 0:
            self._idle = False  # once a step
            if self.async_loads.pending:
                self.idle_waits += 1
            self.async_loads.wait(self.idle_wait_s)
        return self.async_loads.take()

    def finished_requests(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose stores are all done, among those vLLM says have finished."""
        return self.stores.finished_requests(finished_req_ids)

    def preempt(self, req_ids: Sequence[str]) -> None:
        """The blocks of these requests are about to be reused: gathers from them go first."""
        self.stores.preempt()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until the writer has finished every queued store (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while (self.writer.pending or self.stores.busy or (self.async_loads is not None and self.async_loads.pending)
               or (self.copier is not None and self.copier.pending)) and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        # each part released even when another's close fails (a store on a network client that died)
        parts = [self.async_loads.close if self.async_loads is not None else None, self.writer.close,
                 self.copier.close if self.copier is not None else None, self.queue.close, self.store.close,
                 *(st.close for st, _ in self.ctx.lower), self.foreign.close if self.foreign is not None else None]
        for close in parts:
            if close is None:
                continue
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down: the rest still closes
                log.exception("tutti: closing the worker: %r failed", close)
