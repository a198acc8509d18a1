"""Loads from mapped slabs (RAM roots), chunk-major: one copy of a chunk's every layer.

On a RAM root whose slabs are mapped (and registered with CUDA at start-up,
`tutti.store.slabs.Slabs.map_all`), a chunk needs no read call: its slot in the mapping is copied
to the device whole (one DMA from the page cache on CUDA, a memcpy on the CPU), the chunks of
the step grouped into the whole load ring, then verified and scattered for every layer at once
through the load pipeline's one `verify`/`scatter` pair. Chunks that cannot be mapped (another
writer's, a shrunk slab) stay with the pipeline's file path. With a secret, each chunk's keyed
tags are checked on the host before anything is copied.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tutti.engine.worker.loads.core import LoadCore


def load_mapped(lp: "LoadCore") -> set[int]:
    """Every load of the step whose slab is mapped, loaded; returns their indices (the file path
    takes the rest). Their KV is complete only when all of them are: every layer waits on one
    event (`lp.whole_ready`)."""
    ctx = lp.ctx
    cb = ctx.chunk_bytes
    views: dict[int, torch.Tensor] = {}
    # per writer, its slabs' sizes, one fstat each: every view is copied from within this call, so
    # the check stays as close to the copy as one per chunk was (the layer-wise path, whose copies
    # run through the forward, keeps one fstat per chunk and layer)
    sizes: dict[object, dict] = {}
    for i, ld in enumerate(lp.loads):
        try:
            v = lp.source(ld)[0].mapped(ld.slot, 0, cb, sizes.setdefault(ld.source, {}))
        except Exception:  # noqa: BLE001 - the file path reports what is wrong
            v = None
        if v is not None:
            views[i] = v
    if not views:
        return set()
    per_group = lp.ring.slot_bytes * len(lp.ring) // cb
    if per_group == 0 or (slots := lp.ring.acquire_all()) is None:
        return set()  # a chunk is larger than the load ring, or reads of an earlier step still hold it
    order = sorted(views)
    buf = lp.ring.device_buffer if ctx.cuda else lp.ring.buffer
    with lp.on_stream():
        for g in range(0, len(order), per_group):
            _load_group(lp, buf, order[g:g + per_group], views)
        ev = None
        if ctx.cuda:
            ev = torch.cuda.Event()
            ev.record(lp.stream)
    for slot in slots:
        lp.ring.release(slot, ev)
    lp.whole_ready, lp.whole_pending = ev, True
    return set(order)


def _load_group(lp: "LoadCore", buf: torch.Tensor, idx: list[int], views: dict[int, torch.Tensor]) -> None:
    """One ring's worth of chunks: copied into the ring, verified, scattered (every layer)."""
    ctx = lp.ctx
    L, seg, cb, n = ctx.num_layers, ctx.seg, ctx.chunk_bytes, len(idx)
    good = []
    for r, i in enumerate(idx):
        ld = lp.loads[i]
        if ld.key in lp.failed_keys:
            continue
        if ctx.mac is not None and not lp.tags_match(ld, lp.sums[i], views[i]):
            continue
        good.append(r)
    if not good:
        return
    for r0, src in _runs(good, [views[i] for i in idx], cb):
        buf[r0 * cb:r0 * cb + src.numel()].copy_(src, non_blocking=ctx.cuda)
    chunks = buf[: n * cb].view(n, L, seg)
    layers = list(range(L))
    lp.verify(chunks, idx, layers, 0)
    lp.scatter(chunks, idx, layers, good, 0)
    lp.step_bytes += len(good) * L * seg
    lp.mapped_bytes += len(good) * L * seg


def _runs(rows: list[int], views: list[torch.Tensor], cb: int):
    """(first ring row, source) per run of rows whose chunks lie back to back in one mapping
    (a prompt's chunks are usually stored in consecutive slots): one copy each instead of one
    per chunk, since every copy call releases the GIL and may wait out vLLM's spinning loop."""
    start = prev = rows[0]
    for r in rows[1:] + [None]:
        if r is not None and r == prev + 1 and _adjacent(views[prev], views[r], cb):
            prev = r
            continue
        n = prev - start + 1
        v = views[start]
        yield start, (v if n == 1 else v.as_strided((n * cb,), (1,)))
        if r is not None:
            start = prev = r


def _adjacent(a: torch.Tensor, b: torch.Tensor, cb: int) -> bool:
    """b starts where a ends, in the same mapping (storage)."""
    return (b.data_ptr() == a.data_ptr() + cb
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
