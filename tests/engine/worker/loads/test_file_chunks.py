"""Whole loads through the file path, chunk-major (tutti/engine/worker/loads/file_chunks.py): one read
a chunk, groups of half the load ring, corrupted, truncated and stalled chunks."""

import os
import time

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk

from worker_helpers import (
    make_caches, geometry, worker, run_step, _wrapped_worker, StallingQueue, damage, _run_whole,
)

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


# ---------------------------------------------------------------- whole loads, chunk-major (file path)
WHOLE = 11  # chunks of a whole load: the default load ring holds 10 (two halves of 5), so 3 groups


def _whole_loads(n=WHOLE, skip_last=False):
    return [LoadChunk("q", bytes([i]) * 32, i, (2 * i, 2 * i + 1), skip_blocks=1 if skip_last and i == n - 1 else 0)
            for i in range(n)]


def _stored_whole(tmp_path, src, n=WHOLE):
    """Chunk i (key bytes([i]) * 32) in slot i from src blocks i and i + 12, a few chunks a step
    (the store arena holds fewer than WHOLE)."""
    w = worker(tmp_path, src)
    for first in range(0, n, 4):
        run_step(w, StepPlan(first + 1, stores=[StoreChunk("r", bytes([i]) * 32, i, (i, i + 12), ticket=i + 1)
                                                for i in range(first, min(n, first + 4))]))
        w.flush()
    assert sorted(w.take_report().stored) == list(range(1, n + 1))
    w.close()


@pytest.mark.parametrize("how", ["full_graph", "async"])
@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_whole_load_reads_each_chunk_with_one_request_and_is_bit_exact(tmp_path, backend, how):
    """A whole load through the file path reads each chunk's slot (every layer) with one request,
    in groups of half the load ring (11 chunks: 3 groups, a half written twice), and scatters
    every byte where the per-layer path did; bytes and the read rate's seconds come in one report."""
    src = make_caches(0)
    _stored_whole(tmp_path, src)
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = _wrapped_worker(tmp_path, dst, io_backend=backend, mapped_loads=False, async_loads=how == "async")
    assert w.queue.inner.name == backend
    lp = w.async_loads.pipeline if how == "async" else w.loads
    from tutti.engine.worker.loads.file_chunks import chunks_per_ring

    assert 2 * WHOLE > chunks_per_ring(lp) * 2 >= WHOLE  # more than two halves' worth: a half is reused
    adds, add = [], w.counters.add
    w.counters.add = lambda **kw: (adds.append(dict(kw)), add(**kw))[1]
    loads = _whole_loads(skip_last=True)
    assert _run_whole(w, 2, loads, how) == set()
    reads = [(off, length) for _, op, off, length in w.queue.sized if op == "read"]
    cb = geometry().slot_bytes
    assert sorted(reads) == [(ld.slot * cb, cb) for ld in loads]  # one read of the whole slot per chunk
    for layer, (s, d, b0) in enumerate(zip(src, dst, before)):
        for i, ld in enumerate(loads):
            got, want = d[list(ld.block_ids)], s[[i, i + 12]]
            if ld.skip_blocks:  # vLLM's own prefix-cache block: untouched
                assert torch.equal(got[0], b0[ld.block_ids[0]]) and torch.equal(got[1], want[1])
            else:
                assert torch.equal(got, want), (layer, i)
    moved = [a for a in adds if a.get("bytes_loaded")]
    assert sum(a["bytes_loaded"] for a in moved) == WHOLE * cb
    assert all(a["rate_bytes"] == a["bytes_loaded"] and a["rate_seconds"] > 0 for a in moved)
    assert lp.ring.free_count == len(lp.ring) and not w.store.slabs.pins  # the ring and descriptors went back
    w.close()


def test_whole_loads_layer_reads_each_layer_as_before_and_loads_the_same_bytes(tmp_path):
    """`whole_loads: layer` (kept to compare): the per-layer path's reads, one per segment, and
    the same KV as the chunk-major default."""
    src = make_caches(0)
    _stored_whole(tmp_path, src)
    dst = make_caches(1)
    w = _wrapped_worker(tmp_path, dst, io_backend="threads", mapped_loads=False, async_loads=False,
                        whole_loads="layer")
    loads = _whole_loads()
    assert _run_whole(w, 2, loads, "full_graph") == set()
    reads = [(off, length) for _, op, off, length in w.queue.sized if op == "read"]
    g = geometry()
    assert sorted(reads) == sorted((ld.slot * g.slot_bytes + layer * g.segment_bytes, g.segment_bytes)
                                   for ld in loads for layer in range(g.num_layers))
    for s, d in zip(src, dst):
        for i, ld in enumerate(loads):
            assert torch.equal(d[list(ld.block_ids)], s[[i, i + 12]])
    w.close()


@pytest.mark.parametrize("how", ["full_graph", "async"])
def test_a_whole_load_fails_exactly_a_corrupted_chunk(tmp_path, how):
    """Bytes changed on disk in one chunk of the second group: its blocks fail through the device
    verdicts (and it is journaled free), every other chunk of every group loads bit exact."""
    src = make_caches(0)
    _stored_whole(tmp_path, src)
    damage(tmp_path, 7, 2)  # slot 7, layer 2
    dst = make_caches(1)
    w = _wrapped_worker(tmp_path, dst, mapped_loads=False, async_loads=how == "async")
    loads = _whole_loads()
    assert _run_whole(w, 2, loads, how) == {14, 15}
    assert w.take_report().load_failed == [loads[7].key]
    assert len([1 for _, op, _, _ in w.queue.sized if op == "read"]) == WHOLE
    for s, d in zip(src, dst):
        for i, ld in enumerate(loads):
            if i != 7:
                assert torch.equal(d[list(ld.block_ids)], s[[i, i + 12]])
    w.close()
    w = worker(tmp_path, make_caches(2), mapped_loads=False)  # journaled free: no longer held
    w.start_step(StepPlan(3, loads=[loads[7]]), layerwise=False)
    w.end_step()
    assert w.take_failed_blocks() == {14, 15}
    w.close()


@pytest.mark.parametrize("backend", ["uring", "threads"])
def test_a_whole_load_fails_a_truncated_slabs_chunk_by_its_read_error(tmp_path, backend):
    """A slab cut inside slot 9 (a restore, a full disk): that chunk's read comes back short and
    fails it on the host at once (nothing of it scattered, journaled free); the chunks before it
    load bit exact, the one past the cut fails too."""
    src = make_caches(0)
    _stored_whole(tmp_path, src)
    os.truncate(next(tmp_path.rglob("slab-*.bin")), 9 * geometry().slot_bytes + geometry().segment_bytes)
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = _wrapped_worker(tmp_path, dst, io_backend=backend, mapped_loads=False)
    loads = _whole_loads()
    w.start_step(StepPlan(2, loads=loads), layerwise=False)
    w.end_step()
    assert w.take_failed_blocks() == {18, 19, 20, 21}
    assert len([1 for _, op, _, _ in w.queue.sized if op == "read"]) == WHOLE  # one (short) read each
    assert sorted(w.take_report().load_failed) == sorted([loads[9].key, loads[10].key])
    for s, d, b0 in zip(src, dst, before):
        for i, ld in enumerate(loads[:9]):
            assert torch.equal(d[list(ld.block_ids)], s[[i, i + 12]])
        assert torch.equal(d[18:22], b0[18:22])  # failed on the host: never scattered
    w.close()
    w = worker(tmp_path, make_caches(2), mapped_loads=False)
    w.start_step(StepPlan(3, loads=[loads[9]]), layerwise=False)  # journaled free: not planned again
    w.end_step()
    assert w.take_failed_blocks() == {18, 19}
    assert w.loads.loads == []  # refused at start (not in the store), not read again
    w.close()


def test_a_whole_loads_stalled_read_fails_its_chunk_and_holds_its_half_until_it_lands(tmp_path):
    """A chunk read that misses io_timeout_s fails that chunk (not journaled free: the disk was
    slow), never hangs the load, and the half of the ring it may still land in stays held until it
    does (the next whole load goes through the free slots); once it lands the ring is whole again."""
    src = make_caches(0)
    _stored_whole(tmp_path, src)
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=False, io_timeout_s=0.2)
    w.queue = StallingQueue(w.queue, [2 * geometry().slot_bytes])  # slot 2: the first group
    loads = _whole_loads()
    t0 = time.monotonic()
    w.start_step(StepPlan(2, loads=loads), layerwise=False)
    w.end_step()
    assert time.monotonic() - t0 < 5
    assert w.take_failed_blocks() == {4, 5}
    for s, d in zip(src, dst):
        for i, ld in enumerate(loads):
            if i != 2:
                assert torch.equal(d[list(ld.block_ids)], s[[i, i + 12]])
    ring = w.loads.ring
    assert 0 < ring.free_count < len(ring) and w.store.slabs.pins  # the first half and slot 2's slab stay held
    w.queue.stall_offsets = set()
    dst2 = make_caches(2)
    for c, c2 in zip(dst, dst2):
        c.copy_(c2)
    w.start_step(StepPlan(3, loads=loads[3:6]), layerwise=False)  # per layer, through the free slots
    w.end_step()
    assert w.take_failed_blocks() == set()
    for s, d in zip(src, dst):
        assert torch.equal(d[[6, 7, 8, 9, 10, 11]], s[[3, 15, 4, 16, 5, 17]])
    w.queue.release()  # the late read lands
    w.start_step(StepPlan(4, loads=loads), layerwise=False)
    w.end_step()
    assert w.take_failed_blocks() == set()  # the slow chunk was kept
    assert ring.free_count == len(ring) and not w.store.slabs.pins
    for s, d in zip(src, dst):
        assert torch.equal(d[[4, 5]], s[[2, 14]])
    w.close()
