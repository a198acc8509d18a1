"""The layer-wise pipeline: the worker-side half of the engine.

Loads roll through the layers: reads for the first `lookahead` layers go out when the step
starts, and each layer's hook moves the window one layer on, so storage traffic hides behind
compute and the host never queues every layer up front. Stores gather a layer right after it
is computed and hand the bytes to a writer thread: the forward pass never waits on the disk,
and when the staging ring is full a store is skipped and counted, never waited for.

On CUDA, scatters and gathers run on side streams ordered by events; on the CPU the same code
runs with synchronous kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import queue as _queue
import threading
import time
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tutti.engine.config import EngineConfig
from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk, WorkerReport
from tutti.engine.staging import StagingRing, StagingSlot
from tutti.io.queue import READ, WRITE, IOFuture, IOQueue, IORequest, submit_all

log = logging.getLogger("tutti.engine")

_U64 = (1 << 64) - 1
_STAT_FIELDS = ("bytes_loaded", "load_seconds", "bytes_stored", "store_seconds", "stores_skipped")  # checksums are journaled as unsigned 64-bit values


_NULL = nullcontext()


@functools.cache
def _nvtx_backend():
    """How ranges are emitted, decided once: None on the CPU (ranges are free no-ops), the `nvtx`
    package's domain 'tutti' where it is installed, else torch.cuda.nvtx with a 'tutti:' message
    prefix (torch has no domain argument; filter on the prefix in Nsight)."""
    if not torch.cuda.is_available():
        return None
    try:
        import nvtx  # type: ignore[import-not-found]

        return functools.partial(nvtx.annotate, domain="tutti")
    except ImportError:
        return lambda msg: torch.cuda.nvtx.range(f"tutti:{msg}")


def nvtx_range(stage: str, layer: int | None = None):
    """An NVTX range around a pipeline stage (`read.L3`, `scatter.L3`, ...) where CUDA is
    present; on the CPU a shared null context, with no string formatting."""
    emit = _nvtx_backend()
    if emit is None:
        return _NULL
    return emit(stage if layer is None else f"{stage}.L{layer}")


@dataclass
class _LoadItem:
    layer: int
    chunks: list[LoadChunk]
    slot: StagingSlot | None = None
    futures: list[IOFuture] = field(default_factory=list)


@dataclass
class _StoreJob:
    """One layer of a group of chunks, gathered into a staging slot, waiting to be written."""

    layer: int
    chunks: list[StoreChunk]
    slot: StagingSlot
    checksums: list[int] | torch.Tensor
    ready: object = None  # CUDA event: the device-to-host copy finished
    free_slots: list[int] | None = None  # journal these slots as free before writing (first layer)


@dataclass
class _Ticket:
    chunk: StoreChunk
    checksums: list[int | None]
    written: int = 0
    failed: bool = False


class WorkerPipeline:
    """Moves bytes between the store's slots and the paged KV cache, one layer at a time."""

    def __init__(self, cfg: EngineConfig, *, caches: Sequence[torch.Tensor], layout, store, io_queue: IOQueue,
                 kernel, checksum: Callable[[torch.Tensor], torch.Tensor], segment_bytes: int,
                 chunk_tokens: int, kernel_blocks_per_block: int = 1, staging: torch.Tensor | None = None,
                 writes: bool = True) -> None:
        self.cfg = cfg
        # False on a rank that only reads another rank's namespace (MLA under tensor parallelism:
        # the latent cache is the same on every TP rank, so TP rank 0 alone stores it).
        self.writes = writes
        self.caches = list(caches)
        self.num_layers = len(self.caches)
        self.layout = layout
        self.store = store
        self.queue = io_queue
        self.kernel = kernel
        self.checksum = checksum
        self.seg = segment_bytes
        self.chunk_tokens = chunk_tokens
        self.kbpb = kernel_blocks_per_block
        self.device = self.caches[0].device
        self.cuda = self.device.type == "cuda"
        slot_bytes = cfg.staging_slot_bytes
        if segment_bytes > slot_bytes:
            raise ValueError(
                f"staging_bytes={cfg.staging_bytes}: a staging slot ({slot_bytes} B = staging_bytes / "
                f"staging_slots) is smaller than one segment ({segment_bytes} B); raise staging_bytes to at "
                f"least {segment_bytes * cfg.staging_slots} or lower chunk_tokens"
            )
        self.per_slot = slot_bytes // segment_bytes
        if staging is None:
            from tutti.io.buffers import aligned_buffer

            staging = aligned_buffer(slot_bytes * cfg.staging_slots)
        self.ring = StagingRing(staging, slot_bytes, self.device)
        io_queue.register_buffers([staging])
        self.load_slots_max = cfg.staging_slots - cfg.max_inflight_stores
        self._load_slots_used = 0
        self._store_slots_used = 0
        self._slot_lock = threading.Lock()
        if self.cuda:
            self.load_stream = torch.cuda.Stream(self.device)
            self.store_stream = torch.cuda.Stream(self.device)
        # Replayed journal: slot -> (key, per-layer checksums); updated by our own puts.
        self._entries: dict[int, tuple[bytes, tuple[int, ...]]] = {
            s: (e.key, tuple(e.checksums)) for s, e in store.entries().items()
        }
        self._entries_lock = threading.Lock()
        # step state
        self._plan: StepPlan | None = None
        self._items: list[_LoadItem] = []
        self._next_submit = 0
        self._next_process = 0
        self._failed_keys: set[bytes] = set()
        self._failed_blocks: set[int] = set()
        self._refreshed = False  # a reader replayed the writer's journal during this step
        self._layer_events: dict[int, object] = {}
        self._store_active: list[StoreChunk] = []
        self._store_events: list[object] = []
        # request tracking for get_finished
        self._req_inflight: dict[str, int] = defaultdict(int)
        self._req_had_stores: set[str] = set()
        self._req_finished: set[str] = set()
        # report
        self._report = WorkerReport()
        self._report_lock = threading.Lock()
        # The same counters for vLLM's connector stats (get_kv_connector_stats), taken apart
        # from the report: vLLM asks for stats and for the report at different times.
        self._stats: dict[str, float] = dict.fromkeys(_STAT_FIELDS, 0)
        self._tickets: dict[int, _Ticket] = {}
        self._tk_lock = threading.RLock()  # tickets and per-request counts: main and writer threads
        self._gathered = 0  # layers gathered for the active stores this step
        self._free_pending: list[int] = []
        self._reserved: list[StagingSlot] = []  # store slots held for the rest of this step's layers
        # writer thread
        self._jobs: _queue.Queue[_StoreJob | Callable[[], None] | None] = _queue.Queue()
        self._writer = threading.Thread(target=self._writer_loop, name="tutti-writer", daemon=True)
        self._writer.start()
        self._closed = False
        # TUTTI_TRACE=1: (event, layer, perf_counter) of reads submitted and layers made ready,
        # to see the rolling load next to compute; bounded, off by default.
        self.trace: list[tuple[str, int, float]] | None = [] if os.environ.get("TUTTI_TRACE") else None

    # ================================================================ step lifecycle
    def start_step(self, plan: StepPlan) -> None:
        """Bind a step's plan: queue its loads (layer-major) and submit the first layers' reads."""
        self._plan = plan
        self._failed_blocks = set()
        self._layer_events = {}
        self._items = []
        self._next_submit = self._next_process = 0
        self._refreshed = False
        loads = []
        for ld in plan.loads:
            entry = self._entry(ld)
            if entry is None or entry[0] != ld.key:
                self._fail_load(ld, "not in this worker's store")
            else:
                loads.append(ld)
        if loads:
            if self.cuda:
                # blocks just handed to these requests may still be in use by work already queued
                # on the compute stream (a freed request's last step): scatter only after it
                self.load_stream.wait_stream(torch.cuda.current_stream(self.device))
            for layer in range(self.num_layers):
                for i in range(0, len(loads), self.per_slot):
                    self._items.append(_LoadItem(layer, loads[i:i + self.per_slot]))
            self._load_t0 = time.perf_counter()
            self._pump(self.cfg.lookahead - 1)
        self._store_active = self._begin_stores(plan.stores)

    def wait_layer(self, layer: int) -> None:
        """Before layer `layer` computes: its KV is in the cache (or its blocks marked failed)."""
        if not self._items:
            return
        with nvtx_range("load_wait", layer):
            while self._next_process < len(self._items) and self._items[self._next_process].layer <= layer:
                self._pump(self._items[self._next_process].layer)
                self._process(self._items[self._next_process])
                self._next_process += 1
            self._pump(layer + self.cfg.lookahead)
            ev = self._layer_events.pop(layer, None)
            if ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            if self.trace is not None and len(self.trace) < 100_000:
                self.trace.append(("ready", layer, time.perf_counter()))

    def save_layer(self, layer: int) -> None:
        """After layer `layer` computed: gather its stores, and move the read window on."""
        if self._items:
            self._pump(layer + self.cfg.lookahead)
        if self._store_active:
            with nvtx_range("gather", layer):
                self._gather_layer(layer)

    def end_step(self) -> None:
        """Every load of the step finished; gathers read the cache before it can change."""
        if self._items:
            self.wait_layer(self.num_layers - 1)
            self._count(load_seconds=time.perf_counter() - self._load_t0)
        if self._plan is not None:
            with self._report_lock:
                self._report.steps_done.append(self._plan.step)
        if self._store_active and self._gathered < self.num_layers:
            # Some layers' hooks never ran this step: those chunks cannot be complete.
            self._fail_tickets(self._store_active, f"only {self._gathered} of {self.num_layers} layers gathered")
            if self._free_pending:
                self._free_pending = []
        self._release_reserved()
        if self.cuda and self._store_events:
            with nvtx_range("gather_wait"):
                cur = torch.cuda.current_stream(self.device)
                for ev in self._store_events:
                    cur.wait_event(ev)
        self._store_events = []
        self._items = []
        self._plan = None
        self._store_active = []

    # ================================================================ loads
    def _entry(self, ld: LoadChunk, stale: bool = False) -> tuple[bytes, tuple[int, ...]] | None:
        """The journaled (key, checksums) of `ld.slot`. A reader follows another rank's writer, so
        when its copy does not match the plan (or is `stale`) it replays that journal once a step."""
        with self._entries_lock:
            entry = self._entries.get(ld.slot)
        if not self.writes and not self._refreshed and (stale or entry is None or entry[0] != ld.key):
            self._refreshed = True
            self.store.refresh()
            fresh = {s: (e.key, tuple(e.checksums)) for s, e in self.store.entries().items()}
            with self._entries_lock:
                self._entries = fresh
                entry = self._entries.get(ld.slot)
        return entry

    def _pump(self, max_layer: int) -> None:
        """Submit reads for queued items up to `max_layer` while load slots are free."""
        while self._next_submit < len(self._items):
            item = self._items[self._next_submit]
            if item.layer > max_layer:
                return
            with self._slot_lock:
                if self._load_slots_used >= self.load_slots_max:
                    return
                slot = self.ring.try_acquire()
                if slot is None:
                    return
                self._load_slots_used += 1
            item.slot = slot
            reqs = []
            for i, ld in enumerate(item.chunks):
                if ld.key in self._failed_keys:
                    continue
                fd, off = self.store.location(ld.slot, item.layer)
                reqs.append(IORequest(fd, off, self.ring.buffer, slot.offset + i * self.seg, self.seg, READ, tag=i))
            with nvtx_range("read", item.layer):
                item.futures = submit_all(self.queue, reqs)
            if self.trace is not None and len(self.trace) < 100_000:
                self.trace.append(("read", item.layer, time.perf_counter()))
            self._next_submit += 1

    def _process(self, item: _LoadItem) -> None:
        slot = item.slot
        assert slot is not None
        good: list[tuple[int, LoadChunk]] = []
        errors = {}
        with nvtx_range("io_wait", item.layer):
            for fut in item.futures:
                i = fut.request.tag
                try:
                    fut.result()
                except OSError as exc:
                    errors[i] = exc
        for i, ld in enumerate(item.chunks):
            if ld.key in self._failed_keys:
                continue
            if i in errors:
                # A truncated or deleted slab reads short: the chunk is gone, so journal it free
                # as for a checksum mismatch; otherwise every restart would plan and fail it again.
                self._fail_load(ld, f"read of layer {item.layer} failed: {errors[i]}")
                self._forget_slot(ld)
            else:
                good.append((i, ld))
        n = len(item.chunks)
        host = slot.host[: n * self.seg].view(n, self.seg)
        src = host
        ev = None
        if good and self.cuda:
            with torch.cuda.stream(self.load_stream):
                slot.device[: n * self.seg].copy_(slot.host[: n * self.seg], non_blocking=True)
                src = slot.device[: n * self.seg].view(n, self.seg)
        if good and self.cfg.verify_checksums:
            with (torch.cuda.stream(self.load_stream) if self.cuda else nullcontext()), nvtx_range("verify", item.layer):
                rows = src if len(good) == n else src.index_select(0, self._index([i for i, _ in good]))
                sums = self.checksum(rows).tolist()  # waits for the load stream only
            still = []
            for (i, ld), got in zip(good, sums):
                entry = self._entry(ld)
                want = entry[1][item.layer] if entry and entry[0] == ld.key else None
                if want is not None and (int(got) & _U64) != int(want) and not self.writes:
                    entry = self._entry(ld, stale=True)  # the writer may have stored it again since
                    want = entry[1][item.layer] if entry and entry[0] == ld.key else None
                if want is None or (int(got) & _U64) != int(want):
                    self._fail_load(ld, f"checksum mismatch in layer {item.layer} (stored {want}, read {int(got) & _U64})")
                    self._forget_slot(ld)
                else:
                    still.append((i, ld))
            good = still
        if good:
            with (torch.cuda.stream(self.load_stream) if self.cuda else nullcontext()), nvtx_range("scatter", item.layer):
                full = [(i, ld) for i, ld in good if ld.skip_blocks == 0]
                if full:
                    ids = self._index([ld.block_ids for _, ld in full])
                    seg_view = src if len(full) == n else src.index_select(0, self._index([i for i, _ in full]))
                    self.kernel.scatter([self.caches[item.layer]], self.layout, ids, seg_view.unsqueeze(0),
                                        kernel_blocks_per_block=self.kbpb)
                for i, ld in good:
                    if ld.skip_blocks:
                        self._scatter_partial(item.layer, src[i], ld)
            self._count(bytes_loaded=len(good) * self.seg)
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(self.load_stream)
                self._layer_events[item.layer] = ev
        self.ring.release(slot, ev)
        with self._slot_lock:
            self._load_slots_used -= 1

    def _scatter_partial(self, layer: int, seg: torch.Tensor, ld: LoadChunk) -> None:
        """Scatter only the blocks after `skip_blocks` (the rest is vLLM's own prefix cache)."""
        bpc = len(ld.block_ids)
        tok_bytes = self.seg_token_bytes
        t0 = ld.skip_blocks * (self.chunk_tokens // bpc)
        n_tok = self.chunk_tokens - t0
        need = -(-(n_tok * tok_bytes) // 4096) * 4096
        part = torch.zeros(need, dtype=torch.uint8, device=seg.device)
        part[: n_tok * tok_bytes].copy_(seg[t0 * tok_bytes: self.chunk_tokens * tok_bytes])
        ids = self._index([ld.block_ids[ld.skip_blocks:]])
        self.kernel.scatter([self.caches[layer]], self.layout, ids, part.view(1, 1, need),
                            kernel_blocks_per_block=self.kbpb)

    def _index(self, values) -> torch.Tensor:
        """A small int64 index on the device, copied from pinned memory on the CURRENT stream
        without blocking the host: a plain torch.tensor(..., device='cuda') is a pageable copy
        on whatever stream is current and makes the host wait for it, which on the compute
        stream serializes the pipeline with the forward pass."""
        t = torch.tensor(values, dtype=torch.int64)
        if not self.cuda:
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @property
    def seg_token_bytes(self) -> int:
        return self.layout.num_heads * self.layout.content_bytes

    def _fail_load(self, ld: LoadChunk, why: str) -> None:
        if ld.key not in self._failed_keys:
            log.warning("tutti: load of chunk %s for request %s failed: %s; vLLM recomputes it",
                        ld.key.hex()[:16], ld.req_id, why)
            self._failed_keys.add(ld.key)
            with self._report_lock:
                self._report.load_failed.append(ld.key)
        self._failed_blocks.update(ld.block_ids[ld.skip_blocks:])

    def _forget_slot(self, ld: LoadChunk) -> None:
        """A corrupt chunk is journaled as free (off the hot path), so no restart serves it again."""
        with self._entries_lock:
            if self._entries.get(ld.slot, (None,))[0] == ld.key:
                del self._entries[ld.slot]
        if not self.writes:
            return  # the writer reads the same bytes, finds them corrupt too and journals the slot free

        def free() -> None:
            self.store.record_free([ld.slot])
            self.store.sync_journal()

        self._jobs.put(free)

    def take_failed_blocks(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        self._failed_keys = set()
        return out

    # ================================================================ stores
    def _begin_stores(self, stores: list[StoreChunk]) -> list[StoreChunk]:
        """Admit as many of the step's stores as the staging ring can hold for every layer.

        The slots for all layers are reserved now, so a store admitted here never runs out of
        staging halfway through the forward pass; what does not fit is skipped and counted
        (a future miss), and the forward pass never waits for the disk.
        """
        self._release_reserved()
        if not stores:
            return []
        with self._tk_lock:
            # The scheduler holds these requests' blocks until every worker reports them finished
            # (vLLM counts finished_sending per worker), whether this worker stores, skips or only reads.
            self._req_had_stores.update(st.req_id for st in stores)
        if not self.writes:
            return []
        with self._slot_lock:
            budget = min(self.cfg.max_inflight_stores - self._store_slots_used, self.ring.free_count)
            groups = min(-(-len(stores) // self.per_slot), max(0, budget) // self.num_layers)
            admit = min(len(stores), groups * self.per_slot)
            for _ in range(groups * self.num_layers):
                slot = self.ring.try_acquire()
                assert slot is not None
                self._reserved.append(slot)
            self._store_slots_used += len(self._reserved)
        if admit < len(stores):
            self._skip(stores[admit:], "staging ring full")
            stores = stores[:admit]
        if not stores:
            return []
        with self._entries_lock:
            for st in stores:
                self._entries.pop(st.slot, None)  # its old contents are gone from now on
        with self._tk_lock:
            for st in stores:
                self._tickets[st.ticket] = _Ticket(st, [None] * self.num_layers)
                self._req_inflight[st.req_id] += 1
                self._req_had_stores.add(st.req_id)
        self._gathered = 0
        self._free_pending = [st.slot for st in stores]
        self._store_t0 = time.perf_counter()
        return stores

    def _skip(self, stores: Sequence[StoreChunk], why: str, *, skipped: bool = True) -> None:
        """Report these stores as not done. `skipped`: by choice (no staging room), as opposed to
        failed (a write or sync error, a full disk): both free their slots, only the first is
        counted in stores_skipped, so stores_failed - stores_skipped counts IO failures."""
        log.debug("tutti: dropping %d stores: %s", len(stores), why)
        with self._report_lock:
            if skipped:
                self._count_locked(stores_skipped=len(stores))
            self._report.store_failed.extend(st.ticket for st in stores)

    def _release_reserved(self) -> None:
        """Give back store slots reserved for layers whose hooks never ran."""
        for slot in self._reserved:
            self.ring.release(slot)
            with self._slot_lock:
                self._store_slots_used -= 1
        self._reserved = []

    def _gather_layer(self, layer: int) -> None:
        stores = self._store_active
        jobs = []
        for i in range(0, len(stores), self.per_slot):
            jobs.append((stores[i:i + self.per_slot], self._reserved.pop()))
        for group, slot in jobs:
            n = len(group)
            ready = None
            if self.cuda:
                with nvtx_range("compute_wait", layer):
                    compute_done = torch.cuda.Event()
                    compute_done.record(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.store_stream):
                    self.store_stream.wait_event(compute_done)
                    ids = self._index([st.block_ids for st in group])
                    dev = slot.device[: n * self.seg].view(1, n, self.seg)
                    self.kernel.gather([self.caches[layer]], self.layout, ids, dev, kernel_blocks_per_block=self.kbpb)
                    sums = self.checksum(dev[0])
                    gathered = torch.cuda.Event()
                    gathered.record(self.store_stream)
                    self._store_events.append(gathered)
                    slot.host[: n * self.seg].copy_(slot.device[: n * self.seg], non_blocking=True)
                    sums_host = sums.to("cpu", non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(self.store_stream)
                checks: list[int] | torch.Tensor = sums_host
            else:
                ids = self._index([st.block_ids for st in group])
                out = slot.host[: n * self.seg].view(1, n, self.seg)
                self.kernel.gather([self.caches[layer]], self.layout, ids, out, kernel_blocks_per_block=self.kbpb)
                checks = self.checksum(out[0]).tolist()
            free = None
            if self._free_pending:
                free, self._free_pending = self._free_pending, []
            self._jobs.put(_StoreJob(layer, group, slot, checks, ready, free))
        self._gathered += 1

    def _fail_tickets(self, stores: Sequence[StoreChunk], why: str, *, skipped: bool = True) -> None:
        with self._tk_lock:
            failed = []
            for st in stores:
                tk = self._tickets.get(st.ticket)
                if tk is not None and not tk.failed:
                    tk.failed = True
                    failed.append(st)
            if failed:
                self._skip(failed, why, skipped=skipped)
                for st in failed:
                    self._ticket_done(st)

    def _ticket_done(self, st: StoreChunk) -> None:
        with self._tk_lock:
            if self._tickets.pop(st.ticket, None) is not None:
                self._req_inflight[st.req_id] -= 1

    # ---------------------------------------------------------------- writer thread
    def _writer_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if callable(job):
                try:
                    job()
                except Exception:  # noqa: BLE001
                    log.exception("tutti: journal update failed")
                continue
            try:
                with nvtx_range("write", job.layer):
                    self._write_job(job)
            except Exception:  # noqa: BLE001 - a writer must never die silently
                log.exception("tutti: store job failed")
                self._fail_tickets(job.chunks, "writer error", skipped=False)
            finally:
                self.ring.release(job.slot)
                with self._slot_lock:
                    self._store_slots_used -= 1

    def _write_job(self, job: _StoreJob) -> None:
        if job.ready is not None:
            with nvtx_range("d2h_wait", job.layer):
                job.ready.synchronize()  # releases the GIL while the copy finishes
        sums = job.checksums.tolist() if isinstance(job.checksums, torch.Tensor) else job.checksums
        if job.free_slots:
            self.store.record_free(job.free_slots)
            self.store.sync_journal()
        with self._tk_lock:
            live = [(i, st) for i, st in enumerate(job.chunks) if not self._tickets.get(st.ticket, _DEAD).failed]
        reqs = []
        for i, st in live:
            fd, off = self.store.location(st.slot, job.layer)
            reqs.append(IORequest(fd, off, self.ring.buffer, job.slot.offset + i * self.seg, self.seg, WRITE, tag=i))
        futures = submit_all(self.queue, reqs)
        errors: dict[int, BaseException] = {}
        for fut in futures:
            try:
                fut.result()
            except OSError as exc:
                errors[fut.request.tag] = exc
        done: list[_Ticket] = []
        for i, st in live:
            tk = self._tickets.get(st.ticket)
            if tk is None or tk.failed:
                continue
            if i in errors:
                log.warning("tutti: store of chunk %s failed: %s", st.key.hex()[:16], errors[i])
                self._fail_tickets([st], f"write failed: {errors[i]}", skipped=False)
                continue
            tk.checksums[job.layer] = int(sums[i]) & _U64
            tk.written += 1
            self._count(bytes_stored=self.seg)
            if tk.written == self.num_layers:
                done.append(tk)
        if done:
            try:
                with nvtx_range("commit"):
                    self.store.sync_data([tk.chunk.slot for tk in done])
                    for tk in done:
                        self.store.record_put(tk.chunk.key, tk.chunk.slot, tk.checksums)
                    self.store.sync_journal()
            except OSError as exc:
                log.warning("tutti: making %d chunks durable failed: %s", len(done), exc)
                self._fail_tickets([tk.chunk for tk in done], f"sync failed: {exc}", skipped=False)
                return
            with self._entries_lock:
                for tk in done:
                    self._entries[tk.chunk.slot] = (tk.chunk.key, tuple(tk.checksums))
            with self._report_lock:
                self._report.stored.extend(tk.chunk.ticket for tk in done)
                self._count_locked(store_seconds=time.perf_counter() - self._store_t0)
            for tk in done:
                self._ticket_done(tk.chunk)

    # ================================================================ reporting
    def _count(self, **amounts: float) -> None:
        with self._report_lock:
            self._count_locked(**amounts)

    def _count_locked(self, **amounts: float) -> None:
        """Add to the report's counters and to the stats counters (report lock held)."""
        for name, v in amounts.items():
            setattr(self._report, name, getattr(self._report, name) + v)
            self._stats[name] += v

    def take_stats(self) -> dict[str, float]:
        """Counters since the last call, keyed like WorkerReport (bytes_loaded, load_seconds,
        bytes_stored, store_seconds, stores_skipped)."""
        with self._report_lock:
            out, self._stats = self._stats, dict.fromkeys(_STAT_FIELDS, 0)
        return out

    def take_report(self) -> WorkerReport:
        with self._report_lock:
            rep, self._report = self._report, WorkerReport()
        return rep

    def finished_requests(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose stores are all done, among those vLLM says have finished."""
        with self._tk_lock:
            self._req_finished |= {r for r in finished_req_ids if r in self._req_had_stores}
            out = {r for r in self._req_finished if self._req_inflight.get(r, 0) <= 0}
            for r in out:
                self._req_finished.discard(r)
                self._req_had_stores.discard(r)
                self._req_inflight.pop(r, None)
        return out

    def preempt(self, req_ids: Sequence[str]) -> None:
        """The blocks of these requests are about to be reused: gathers from them must be done."""
        if self.cuda:
            self.store_stream.synchronize()

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until the writer thread has finished every queued store (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while (not self._jobs.empty() or self._tickets or self._store_slots_used) and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flush()
        self._jobs.put(None)
        self._writer.join(timeout=30)
        self.queue.close()
        self.store.close()


class _DeadTicket:
    failed = True


_DEAD = _DeadTicket()
