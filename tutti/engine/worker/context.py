"""What the load pipeline, the store pipeline and the writer share on one worker.

`WorkerContext` holds the fixed facts (caches, layout, kernels, store, queue, sizes) and the
host-side helpers every stage needs (a device index without a host sync, kernel keyword
arguments); `Counters` holds the report and stats that stages add to from several threads;
`JournalView` holds the journaled (key, per-layer checksums) of each slot.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from tutti.engine.config.settings import EngineConfig
from tutti.engine.plan import NULL_BLOCK, WorkerReport
from tutti.io.queue import IOQueue

log = logging.getLogger("tutti.engine")


class Throttled:
    """A warning said at most once per `interval_s` per key, with how many were held back: a
    failure that repeats every step (a full disk fails every store) must not flood the server's
    log, and must not go unsaid either."""

    def __init__(self, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # key -> (when last said, held back since)

    def warning(self, key: str, msg: str, *args) -> bool:
        now = time.monotonic()
        with self._lock:
            last, held = self._last.get(key, (None, 0))
            if last is not None and now - last < self.interval_s:
                self._last[key] = (last, held + 1)
                return False
            self._last[key] = (now, 0)
        if held:
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, held, now - last)
        log.warning(msg, *args)
        return True

U64 = (1 << 64) - 1
STAT_FIELDS = ("bytes_loaded", "load_seconds", "bytes_stored", "store_seconds", "stores_skipped")
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


def as_signed64(v: int) -> int:
    """A journaled unsigned 64-bit checksum as the int64 bit pattern the kernels compute."""
    v &= U64
    return v - (1 << 64) if v >= 1 << 63 else v


def _takes_id_range(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "id_range" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class PinnedInts:
    """int64 host memory pinned at start-up for the small host-to-device copies of every launch
    (block ids, expected checksums), so no step allocates pinned memory (cudaHostAlloc can
    synchronise the device). The ring is cut into sections; a section is written again only once
    the copies issued from it last time have finished (an event per stream, queried, never waited
    on); a request that finds none free, or one larger than a section, falls back to torch's
    pinned allocator and is counted in `fallbacks`."""

    def __init__(self, entries: int = 1 << 18, sections: int = 8) -> None:
        self.section = max(1, entries // sections)
        self.sections = sections
        self.buf = torch.empty(self.section * sections, dtype=torch.int64, pin_memory=True)
        self._lock = threading.Lock()
        self._k, self._pos = 0, 0
        self._events: list[dict] = [{} for _ in range(sections)]
        self.fallbacks = 0

    def upload(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        n = t.numel()
        with self._lock:
            base = self._k * self.section
            if n > self.section or (self._pos + n > base + self.section and not self._advance()):
                self.fallbacks += 1
                return t.pin_memory().to(device, non_blocking=True)
            dst = self.buf[self._pos:self._pos + n]
            self._pos += n
            dst.copy_(t.reshape(-1))
            out = dst.view(t.shape).to(device, non_blocking=True)
            stream = torch.cuda.current_stream(device)
            ev = self._events[self._k].get(stream.cuda_stream)
            if ev is None:
                ev = self._events[self._k][stream.cuda_stream] = torch.cuda.Event()
            ev.record(stream)
            return out

    def _advance(self) -> bool:
        k = (self._k + 1) % self.sections
        if not all(ev.query() for ev in self._events[k].values()):
            return False
        self._k, self._pos = k, k * self.section
        return True


@dataclass
class WorkerContext:
    cfg: EngineConfig
    caches: list[torch.Tensor]
    layout: Any
    store: Any
    queue: IOQueue
    kernel: Any
    checksum: Callable[[torch.Tensor], torch.Tensor]
    seg: int  # segment bytes
    chunk_tokens: int
    kbpb: int  # kernel blocks per manager block
    writes: bool  # False on a rank that only reads another rank's namespace (MLA under TP)
    mac: Any = None  # tutti.store.integrity.SegmentMac with a secret: keyed tags replace checksums
    # Hybrid models: the KV cache group of each layer (vLLM hands one block list per group; a
    # chunk's block ids are every group's, group after group). None: one group.
    group_of_layer: list[int] | None = None
    # tutti.io.queue.ReadsFirst where writes yield to the loads' reads (a drive); None elsewhere
    reads: Any = None
    # the tiers below this worker's store (tutti.engine.worker.tiers): (store, JournalView) each
    lower: list = field(default_factory=list)
    # tutti.codec: None for "identity" (the bytes go as they are); else stores encode each layer's
    # segment on the writer thread and loads decode it on the thread that processes them, and a
    # layer's stride in a slot is `stored_seg` (0: seg)
    codec: Any = None
    stored_seg: int = 0
    num_layers: int = field(init=False)
    device: torch.device = field(init=False)
    cuda: bool = field(init=False)
    pinned: PinnedInts | None = field(init=False)

    def __post_init__(self) -> None:
        self.num_layers = len(self.caches)
        self.device = self.caches[0].device
        self.cuda = self.device.type == "cuda"
        self.pinned = PinnedInts() if self.cuda else None
        self.stored_seg = self.stored_seg or self.seg
        # what a codec encodes one segment into, at most (the view its encode and decode get)
        self.encoded_max = self.codec.max_encoded_bytes(self.seg) if self.codec is not None else self.seg
        # A variant that accepts id_range gets the block ids' bounds from the host, so its
        # launcher never reads the device tensor back (a host sync per launch otherwise).
        self._ranged = _takes_id_range(self.kernel.gather) and _takes_id_range(self.kernel.scatter)

    @property
    def num_groups(self) -> int:
        return 1 if self.group_of_layer is None else max(self.group_of_layer) + 1

    def blocks_for(self, block_ids: Sequence[int], layer: int) -> tuple[int, ...]:
        """A chunk's blocks in the group of `layer`."""
        if self.group_of_layer is None:
            return tuple(block_ids)
        bpc = len(block_ids) // self.num_groups
        g = self.group_of_layer[layer]
        return tuple(block_ids[g * bpc:(g + 1) * bpc])

    def skip_for(self, block_ids: Sequence[int], skip_blocks: int, layer: int) -> int:
        """Blocks at the start of a chunk that a load must not write, in the group of `layer`:
        vLLM's own prefix cache hits (`skip_blocks`) and, in a sliding-window group, the blocks
        before the window (vLLM's null block, id 0, stands in for them)."""
        if self.group_of_layer is None:
            return skip_blocks
        blocks = self.blocks_for(block_ids, layer)
        lead = 0
        while lead < len(blocks) and blocks[lead] == NULL_BLOCK:
            lead += 1
        return max(skip_blocks, lead)

    def moves_layer(self, block_ids: Sequence[int], layer: int, skip_blocks: int = 0) -> bool:
        """Whether a chunk's load or store touches any block of `layer`: not when every block it
        would write there is vLLM's null block or already computed (a sliding-window layer outside
        its window; a state layer in a chunk entry, an attention layer in a state entry)."""
        if self.group_of_layer is None:
            return True
        return self.skip_for(block_ids, skip_blocks, layer) < len(self.blocks_for(block_ids, layer))

    def written_blocks(self, block_ids: Sequence[int], skip_blocks: int, keep_blocks: int | None = None) -> set[int]:
        """Every block a load of this chunk writes (all groups): what fails when it fails. Never
        a block past `keep_blocks` (LoadChunk): vLLM computes that one itself, and a block
        reported failed would have it recompute from there."""
        if self.group_of_layer is None:
            return set(block_ids[skip_blocks:keep_blocks])
        out: set[int] = set()
        for layer in {self.group_of_layer.index(g) for g in range(self.num_groups)}:
            out.update(self.blocks_for(block_ids, layer)[self.skip_for(block_ids, skip_blocks, layer):keep_blocks])
        out.discard(NULL_BLOCK)
        return out

    @property
    def chunk_bytes(self) -> int:
        """One chunk, every layer, raw: one store region (and the slab's slot without a codec)."""
        return self.num_layers * self.seg

    @property
    def stored_chunk_bytes(self) -> int:
        """One chunk's slot in the store: chunk_bytes without a codec, its encoded segments with one."""
        return self.num_layers * self.stored_seg

    @property
    def seg_token_bytes(self) -> int:
        return self.layout.num_heads * self.layout.content_bytes

    def index(self, values) -> torch.Tensor:
        """A small int64 tensor on the device, copied from pinned memory on the CURRENT stream
        without blocking the host: a plain torch.tensor(..., device='cuda') is a pageable copy
        that makes the host wait for it."""
        t = torch.tensor(values, dtype=torch.int64)
        if not self.cuda:
            return t
        return self.pinned.upload(t, self.device)

    def kernel_kwargs(self, block_lists: Sequence[Sequence[int]]) -> dict:
        kw: dict[str, Any] = {"kernel_blocks_per_block": self.kbpb}
        if self._ranged:
            flat = [b for ids in block_lists for b in ids]
            if flat:
                kw["id_range"] = (min(flat), max(flat))
        return kw

    def gather(self, caches: Sequence[torch.Tensor], block_lists: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        ids = self.index([list(b) for b in block_lists])
        self.kernel.gather(list(caches), self.layout, ids, out, **self.kernel_kwargs(block_lists))

    def scatter(self, caches: Sequence[torch.Tensor], block_lists: Sequence[Sequence[int]], src: torch.Tensor) -> None:
        ids = self.index([list(b) for b in block_lists])
        self.kernel.scatter(list(caches), self.layout, ids, src, **self.kernel_kwargs(block_lists))


class Counters:
    """The report for the scheduler and the stats for vLLM's metrics: the same counters, taken
    apart at different times (vLLM asks for stats and for the report separately)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.report = WorkerReport()
        self._stats: dict[str, float] = dict.fromkeys(STAT_FIELDS, 0)

    def add(self, **amounts: float) -> None:
        with self.lock:
            self.add_locked(**amounts)

    def add_locked(self, **amounts: float) -> None:
        for name, v in amounts.items():
            setattr(self.report, name, getattr(self.report, name) + v)
            if name in self._stats:  # the rest go to the scheduler only (the read-rate sample)
                self._stats[name] += v

    def record(self, *, stored: Iterable[int] = (), store_failed: Iterable[int] = (),
               load_failed: Iterable[bytes] = (), steps_done: Iterable[int] = (), **amounts: float) -> None:
        """Outcomes for the scheduler (tickets, keys, steps) and counters, under one lock hold:
        a report taken meanwhile has all of them or none."""
        with self.lock:
            self.report.stored.extend(stored)
            self.report.store_failed.extend(store_failed)
            self.report.load_failed.extend(load_failed)
            self.report.steps_done.extend(steps_done)
            self.add_locked(**amounts)

    def take_stats(self) -> dict[str, float]:
        with self.lock:
            out, self._stats = self._stats, dict.fromkeys(STAT_FIELDS, 0)
        return out

    def take_report(self) -> WorkerReport:
        with self.lock:
            rep, self.report = self.report, WorkerReport()
        return rep


class JournalView:
    """slot -> (key, per-layer checksums) as journaled, kept current by our own puts.

    A reader follows another rank's writer: when its copy does not hold a planned chunk it
    replays that journal, at most once a step.
    """

    def __init__(self, store, follows_writer: bool) -> None:
        self.store = store
        self.follows_writer = follows_writer
        self._lock = threading.Lock()
        self._entries = self._read()
        self._refreshed = False

    def _read(self) -> dict[int, tuple[bytes, tuple[int, ...]]]:
        return {s: (e.key, tuple(e.checksums)) for s, e in self.store.entries().items()}

    def __len__(self) -> int:
        return len(self._entries)

    def new_step(self) -> None:
        """A step with loads begins: a reader catches up with the writer's journal if it changed
        (one stat), so checksums compared on the device are never stale ones."""
        self._refreshed = False
        if self.follows_writer and self.store.refresh_if_changed():
            self._refreshed = True
            fresh = self._read()
            with self._lock:
                self._entries = fresh

    def checksums(self, slot: int, key: bytes) -> tuple[int, ...] | None:
        """The journaled checksums of `slot` if it holds `key`, else None."""
        with self._lock:
            entry = self._entries.get(slot)
        if (entry is None or entry[0] != key) and self.follows_writer and not self._refreshed:
            self._refreshed = True
            self.store.refresh()
            fresh = self._read()
            with self._lock:
                self._entries = fresh
                entry = self._entries.get(slot)
        return entry[1] if entry is not None and entry[0] == key else None

    def put(self, slot: int, key: bytes, checksums: Sequence[int]) -> None:
        with self._lock:
            self._entries[slot] = (key, tuple(checksums))

    def drop(self, slot: int, key: bytes | None = None) -> None:
        """Forget `slot` (only if it still holds `key`, when given)."""
        with self._lock:
            if key is None or self._entries.get(slot, (None,))[0] == key:
                self._entries.pop(slot, None)
