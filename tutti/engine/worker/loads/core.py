"""The load paths' common core: a step's loads and their journaled checksums, verifying
segments on the device, scattering them into the paged cache, the verdicts read after the
forward, failing a chunk (and journaling its slot free), stragglers of reads past their
deadline. The layer-wise pipeline (pipeline.py), the detached loads (detached.py), the
chunk-major file path (file_chunks.py) and mapped copies (mapped.py) all go through it."""

from __future__ import annotations

import collections
from contextlib import nullcontext
from typing import Callable

import torch

from tutti.engine.config import resolve
from tutti.engine.worker.context import Counters, JournalView, WorkerContext, as_signed64, log, nvtx_range
from tutti.engine.hostcost import gil_free_wait
from tutti.engine.worker.loads.items import LoadItem
from tutti.engine.plan import LoadChunk
from tutti.engine.worker.staging import StagingRing
from tutti.format import segment_bytes, token_span


class LoadCore:
    """State and operations every load path shares (one per worker, reused step after step)."""

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
        self.ahead = resolve.lookahead(ctx.cfg.lookahead, num_layers=ctx.num_layers).value
        if ctx.cuda:
            self.stream = torch.cuda.Stream(ctx.device)
        self.loads: list[LoadChunk] = []
        self.sums: list[tuple[int, ...]] = []  # journaled checksums of each load
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
        self.failed_keys: set[bytes] = set()
        self._failed_blocks: set[int] = set()
        self._failed_log: set[bytes] = set()  # every key failed since take_failed_keys()
        self.stragglers: list[tuple[LoadItem, object]] = []  # (item, event) of reads that missed their deadline
        self.whole_ready: object = None  # CUDA event: the chunk-major loads (mapped slabs, whole-slot reads) are scattered
        self.whole_pending = False  # chunk-major loads issued that no wait_layer has waited for yet
        self._t0 = 0.0
        self.step_bytes = 0  # loaded this step, reported with the step's seconds at finish()
        self._waited, self._layerwise = 0.0, False  # the forward's waits of a layer-wise load
        # a layer-wise load's read-rate sample: bytes done when the forward last stalled on a read
        self._stall_bytes, self._stall_end = 0, None
        self.mapped_bytes = 0  # copied chunk-major from mapped slabs (one DMA, no host wait)
        self._pool_free: list[torch.Tensor] = []  # detached jobs' pinned verdict buffers not in use
        self._pool_sized, self._pool_size = False, 0
        self._pool_taken: torch.Tensor | None = None
        self.trace: list[tuple[str, int, float]] | None = None
        # (what, layer, CUDA event) of the last step that loaded: "start" (the compute stream at
        # start), "loaded" (the load stream past a layer's scatter), "compute" (the compute stream
        # past a layer's wait); None = off (TUTTI_TRACE on CUDA sets it; gpu_timeline reads it)
        self.gpu_marks: list[tuple[str, int, object]] | None = None

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
            want = ctx.index([as_signed64(self.sums[j][layer]) for j in idx for layer in layers]).view(n, k)
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
                full = [r for r in good if not self._partial(self.loads[idx[r]])]
                if full:
                    rows = data if len(full) == len(idx) else data.index_select(0, ctx.index(full))
                    # [layers, rows, seg]: one layer (the file path) as a contiguous [1, rows, seg]
                    src = rows[:, 0].unsqueeze(0) if len(layers) == 1 else rows.transpose(0, 1)
                    ctx.scatter([ctx.caches[layer] for layer in layers], [self.loads[idx[r]].block_ids for r in full],
                                src)
            # one group: only rows with blocks to skip are left; hybrid models: every row, layer by
            # layer (a layer's group decides its blocks and what its window skips)
            rest = good if ctx.num_groups > 1 else [r for r in good if self._partial(self.loads[idx[r]])]
            for li, layer in enumerate(layers if rest else ()):
                skips = {r: ctx.skip_for(self.loads[idx[r]].block_ids, self.loads[idx[r]].skip_blocks, layer)
                         for r in rest}
                if ctx.num_groups > 1:
                    full = [r for r in rest if skips[r] == 0 and self.loads[idx[r]].keep_blocks is None]
                    if full:
                        rows = data[:, li] if len(full) == len(idx) else data[:, li].index_select(0, ctx.index(full))
                        ctx.scatter([ctx.caches[layer]], [ctx.blocks_for(self.loads[idx[r]].block_ids, layer)
                                                          for r in full], rows.unsqueeze(0))
                for r in rest:
                    blocks = ctx.blocks_for(self.loads[idx[r]].block_ids, layer)
                    keep = self.loads[idx[r]].keep_blocks
                    end = len(blocks) if keep is None else min(keep, len(blocks))
                    if skips[r] < end and (skips[r] > 0 or end < len(blocks)):
                        self.scatter_partial(layer, data[r, li], blocks, skips[r], end)

    @staticmethod
    def _partial(ld: LoadChunk) -> bool:
        """Whether a load writes fewer than all of its chunk's blocks (it then goes block by block)."""
        return ld.skip_blocks > 0 or (ld.keep_blocks is not None and ld.keep_blocks < len(ld.block_ids))

    def tags_match(self, ld: LoadChunk, sums: tuple[int, ...], view: torch.Tensor) -> bool:
        """With a secret: every layer's keyed tag, on the host, before anything is copied."""
        seg, data = self.ctx.seg, view.numpy()
        with nvtx_range("verify", 0):
            return all(self._tag_ok(ld, layer, data[layer * seg:(layer + 1) * seg], sums[layer])
                       for layer in range(self.ctx.num_layers))

    def _tag_ok(self, ld: LoadChunk, layer: int, data, want: int) -> bool:
        """One segment's keyed tag; a mismatch fails the chunk and journals it free."""
        if self.ctx.mac.tag(ld.key, layer, data) == want:
            return True
        self.fail(ld, f"keyed tag mismatch in layer {layer}: not written by a holder of the secret")
        self.forget(ld)
        return False

    def decoded(self, ld: LoadChunk, layer: int, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """With a codec (tutti.codec): layer `layer` of `ld` decoded from its stored bytes `src` (host,
        a stored segment's stride) into the raw staging `dst` (host, one segment), on this thread,
        before the checksum, tag, copy and scatter that follow as without one. Stored bytes are
        hostile: a malformed segment fails its chunk (vLLM recomputes it) and journals it free as
        a checksum mismatch does, never the step."""
        ctx = self.ctx
        try:
            with nvtx_range("decode", layer):
                ctx.codec.decode(memoryview(src[:ctx.encoded_max].numpy()), memoryview(dst.numpy()))
        except Exception as exc:  # noqa: BLE001 - hostile bytes or a codec's bug: that chunk fails, never the step
            self.fail(ld, f"its layer {layer} does not decode (codec {ctx.codec.name!r}): {exc}")
            self.forget(ld)
            return False
        return True

    def decoded_chunk(self, ld: LoadChunk, src: torch.Tensor, dst: torch.Tensor) -> bool:
        """Every layer of `ld` decoded (as `decoded`) from its stored slot `src` into `dst`."""
        sseg, seg = self.ctx.stored_seg, self.ctx.seg
        return all(self.decoded(ld, layer, src[layer * sseg:(layer + 1) * sseg], dst[layer * seg:(layer + 1) * seg])
                   for layer in range(self.ctx.num_layers))

    def source(self, ld: LoadChunk) -> tuple[object, JournalView]:
        """(store, journal view) holding `ld`: ours, or another writer's (opened read-only)."""
        if ld.source is None:
            return (self.ctx.store, self.journal) if not ld.tier else self.ctx.lower[ld.tier - 1]
        if self.foreign is None:
            raise RuntimeError("this worker reads no other writers")
        return self.foreign.get(ld.source)

    def on_stream(self):
        return torch.cuda.stream(self.stream) if self.ctx.cuda else nullcontext()

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

    def warm_up(self, max_loads: int, blocks_per_chunk: int, *, detached: bool = False) -> None:
        """At start-up, every kernel a load launches beside the copy kernels: verdicts OR-ed in
        place and by index, rows picked by index, a partial chunk, one layer and every layer.
        CUDA loads a kernel's module on its first launch while holding the context's lock, and
        every thread's launch waits behind it: a serving trace (results/serve.md, serve/2026-12-03_profile_tutti_shm.json) caught the
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
        saved = (self.loads, self.sums, self._bad)
        try:
            with self.on_stream():
                data = torch.empty((3, L, ctx.seg), dtype=torch.uint8, device=ctx.device)
                ctx.gather(ctx.caches, [blocks] * 3, data.transpose(0, 1))
                self.loads = [LoadChunk("warm-up", b"", -1, blocks),
                               LoadChunk("warm-up", b"", -1, blocks, skip_blocks=1 if bpc > 1 else 0),
                               LoadChunk("warm-up", b"", -1, blocks)]
                self.sums = [tuple([0] * L)] * 3
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
            self.loads, self.sums, self._bad = saved

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
        bad, loads, sums = self._bad_host, self.loads, self.sums
        self._bad_host = self._bad = self._verified = None
        self._judge(bad, loads, sums)

    def _judge(self, bad: torch.Tensor, loads: list[LoadChunk], sums: list[tuple[int, ...]]) -> None:
        """Fail (and journal free) every load with a mismatched layer in the host verdicts `bad`."""
        if not bool(bad.any()):
            return
        for i, layers in enumerate(bad.tolist()):
            if any(layers) and loads[i].key not in self.failed_keys:
                ld, first = loads[i], layers.index(True)
                self.fail(ld, f"checksum mismatch in layer {first} (stored {sums[i][first]:#018x})")
                self.forget(ld)

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
                self.stragglers.append((item, None))
        self._unsent.clear()
        if self.ctx.cuda:
            torch.cuda.current_stream(self.ctx.device).wait_stream(self.stream)
        self._items, self.loads, self.sums = [], [], []
        self._next_submit = self._next_process = 0
        self._layer_events, self.whole_ready, self.whole_pending = {}, None, False
        self._bad = self._bad_host = self._verified = None
        for ld in loads:
            self.fail(ld, why)

    def take_failed_blocks(self) -> set[int]:
        self.resolve()
        out, self._failed_blocks = self._failed_blocks, set()
        self.failed_keys = set()
        return out

    def _done_with(self, item: LoadItem, ev: object) -> None:
        """Every read of `item` has landed: its staging slot and slab descriptors go back."""
        for slot in [item.slot] + item.more_slots:
            self.ring.release(slot, ev)
        for store, s in item.pinned:
            store.release(s)
        item.pinned = []

    def reap_stragglers(self) -> None:
        still = []
        for item, ev in self.stragglers:
            if all(f.done() for f in item.futures):
                self._done_with(item, ev)
            else:
                still.append((item, ev))
        self.stragglers = still

    def _check_tags(self, item: LoadItem, good: list[tuple[int, LoadChunk]]) -> list[tuple[int, LoadChunk]]:
        """With a secret: each segment's keyed tag, on the host, before anything reaches the GPU."""
        seg = self.ctx.seg
        host = item.slot.host.numpy()
        with nvtx_range("verify", item.layer):
            return [(i, ld) for i, ld in good
                    if self._tag_ok(ld, item.layer, item.mapped[i].numpy() if i in item.mapped else
                                    host[i * seg:(i + 1) * seg], self.sums[item.idx[i]][item.layer])]

    def scatter_partial(self, layer: int, seg: torch.Tensor, blocks: tuple[int, ...], skip: int,
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

    def fail(self, ld: LoadChunk, why: str) -> None:
        if ld.key not in self.failed_keys:
            log.warning("tutti: load of chunk %s for request %s failed: %s; vLLM recomputes it",
                        ld.key.hex()[:16], ld.req_id, why)
            self.failed_keys.add(ld.key)
            self._failed_log.add(ld.key)
            self.counters.record(load_failed=[ld.key])
        self._failed_blocks.update(self.ctx.written_blocks(ld.block_ids, ld.skip_blocks, ld.keep_blocks))
