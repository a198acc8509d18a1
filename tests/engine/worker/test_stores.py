"""The store pipeline (tutti/engine/worker/stores.py) through a worker: admission into staging, one
write a chunk, stalled writes, stores copied into a mapped root, writes yielding to reads."""

import os

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk

from worker_helpers import (
    L, B, DEV, make_caches, geometry, worker, run_step, RecordingQueue, _wrapped_worker, StallingQueue,
)

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


def test_full_staging_skips_stores_and_counts_them(tmp_path):
    caches = make_caches(0)
    w = worker(tmp_path, caches)
    busy = w.stores.arena.take(w.store_regions)  # every region held by stores still in flight
    many = [StoreChunk("r", bytes([i]) * 32, i, (2 * i, 2 * i + 1), ticket=i + 1) for i in range(3)]
    run_step(w, StepPlan(1, stores=many))
    w.flush()
    rep = w.take_report()
    assert rep.stores_skipped == len(many) and sorted(rep.store_failed) == [s.ticket for s in many]
    assert w.finished_requests({"r"}) == {"r"}  # skipped stores do not hold the request's blocks
    for first, count in busy:
        w.stores.arena.release(first, count)
    w.close()


def test_stores_admitted_only_as_far_as_staging_holds_whole_chunks(tmp_path):
    caches = make_caches(0)
    chunk = geometry().slot_bytes
    # stores may hold 2 slots of 8 KiB = 16 KiB: one chunk of 3 layers x 4 KiB fits, not two
    w = worker(tmp_path, caches, staging_slots=4, max_inflight_stores=2, staging_bytes=4 * 8192)
    assert w.store_regions == (2 * 8192) // chunk == 1
    many = [StoreChunk("r", bytes([i]) * 32, i, (2 * i, 2 * i + 1), ticket=i + 1) for i in range(3)]
    run_step(w, StepPlan(1, stores=many))
    w.flush()
    rep = w.take_report()
    assert sorted(rep.stored) == [many[0].ticket]
    assert sorted(rep.store_failed) == [s.ticket for s in many[1:]] and rep.stores_skipped == 2
    # the admitted chunk is whole: it loads back bit-exact
    dst = make_caches(1)
    w.close()
    w = worker(tmp_path, dst)
    run_step(w, StepPlan(2, loads=[LoadChunk("q", many[0].key, 0, (20, 21))]))
    assert w.take_failed_blocks() == set()
    for s, d in zip(caches, dst):
        assert torch.equal(d[[20, 21]], s[[0, 1]])
    w.close()


def test_a_chunk_is_written_with_one_request(tmp_path):
    """Stores gather every layer after the forward and write each chunk whole."""
    src = make_caches(0)
    w = _wrapped_worker(tmp_path, src)
    stores = [StoreChunk("r", bytes([i]) * 32, i, (2 * i, 2 * i + 1), ticket=i + 1) for i in range(3)]
    w.start_step(StepPlan(1, stores=stores))
    for layer in range(L):
        w.wait_layer(layer)
        w.save_layer(layer)
        assert not w.queue.log  # nothing is written while layers compute
    w.end_step()
    w.flush()
    writes = [(op, off) for _, op, off in w.queue.log if op == "write"]
    assert sorted(off for _, off in writes) == [s.slot * geometry().slot_bytes for s in stores]
    assert sorted(w.take_report().stored) == [1, 2, 3]
    w.close()


def test_a_stalled_write_fails_its_chunk_and_holds_its_buffers_until_it_lands(tmp_path):
    src = make_caches(0)
    w = worker(tmp_path, src, io_timeout_s=0.2)
    w.queue = StallingQueue(w.queue, [2 * geometry().slot_bytes], op="write")  # slot 2's write hangs
    stores = [StoreChunk("r", bytes([i]) * 32, slot, (2 * i, 2 * i + 1), ticket=i + 1) for i, slot in enumerate((1, 2))]
    run_step(w, StepPlan(1, stores=stores))
    w.flush(timeout=10)
    rep = w.take_report()
    assert rep.stored == [1] and 2 in rep.store_failed  # failed after the deadline, the writer went on
    held = w.stores.reap_stragglers()
    assert held == 1 and w.store.slabs.pins  # its staging region and slab descriptor stay held ...
    w.queue.release()
    assert w.stores.reap_stragglers() == 0 and not w.store.slabs.pins  # ... until the late write lands
    dst = make_caches(1)
    run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 1, (8, 9)),
                                   LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]))
    assert w.take_failed_blocks() == {10, 11}  # never journaled: not served
    w.close()


def copy_kw(copy: str) -> dict:
    """"dma_chunk+2": dma_chunk with two chunks' copies in flight (store_copies_in_flight)."""
    mode, _, ahead = copy.partition("+")
    return {"mapped_store_copy": mode, **({"store_copies_in_flight": int(ahead)} if ahead else {})}


@pytest.mark.parametrize("copy", ["auto", "dma", "dma_chunk", "dma_chunk+2", "host"])
def test_stores_into_a_mapped_root_copy_into_the_slots_not_write_calls(tmp_path, copy):
    """A writer that mapped its whole capacity at start-up stores by copying each chunk into its
    slot's mapping once the slot's free record is durable (no write request reaches the IO
    queue), whichever way the bytes travel (`mapped_store_copy`; on the CPU always from the host
    staging); a reader of the same root through the file path then loads every chunk bit exact,
    and a chunk whose slab shrank under its mapping fails its store instead of being journaled."""
    src = make_caches(0)
    w = worker(tmp_path, src, mapped_loads=True, slots_per_slab=8, **copy_kw(copy))
    w.warm_up()
    assert w.store.maps_every_slab and w.stores.into_maps
    mode = copy_kw(copy)["mapped_store_copy"]
    assert w.stores.map_copy == ("host" if DEV == "cpu" else {"auto": "dma_chunk"}.get(mode, mode))
    w.queue = RecordingQueue(w.queue)
    stores = [StoreChunk("r", bytes([i]) * 32, slot, blocks, ticket=i + 1)
              for i, (slot, blocks) in enumerate([(3, (0, 1)), (9, (2, 3)), (17, (4, 5))])]
    run_step(w, StepPlan(1, stores=stores))
    w.flush()
    assert sorted(w.take_report().stored) == [1, 2, 3]
    assert not [e for e in w.queue.log if e[1] == "write"]
    slab2 = sorted(tmp_path.rglob("slab-2.bin"))[0]
    os.truncate(slab2, 0)  # slots 16..23: slot 17's store must fail, not be journaled
    run_step(w, StepPlan(2, stores=[StoreChunk("r", bytes([9]) * 32, 18, (6, 7), ticket=4)]))
    w.flush()
    rep = w.take_report()
    assert rep.stored == [] and rep.store_failed == [4]
    w.close()
    dst = make_caches(1)
    r = worker(tmp_path, dst, mapped_loads=False, slots_per_slab=8)
    assert not r.store.maps_ram
    run_step(r, StepPlan(3, loads=[LoadChunk("q", bytes([0]) * 32, 3, (8, 9)),
                                   LoadChunk("q", bytes([1]) * 32, 9, (10, 11)),
                                   LoadChunk("q", bytes([9]) * 32, 18, (12, 13))]))
    assert r.take_failed_blocks() == {12, 13}  # never journaled: not served
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9]], s[[0, 1]]) and torch.equal(d[[10, 11]], s[[2, 3]])
    r.close()


@pytest.mark.parametrize("copy", ["dma", "dma_chunk", "dma_chunk+2", "host"])
def test_a_run_copied_into_the_maps_gives_its_staging_back_chunk_by_chunk(tmp_path, copy):
    """Stores copied chunk by chunk into a mapped root ("dma_chunk", "host") return each chunk's
    staging region as soon as its bytes are in the slot, not when the whole run is committed, so
    a burst of prefill finds room sooner; "dma" (every copy queued at once) returns the run at its
    end. Every region comes back exactly once (the arena asserts it) and the chunks are stored."""
    src = make_caches(0)
    w = worker(tmp_path, src, mapped_loads=True, slots_per_slab=8, **copy_kw(copy))
    w.warm_up()
    arena = w.stores.arena
    full = arena.free_count
    calls, release = [], arena.release
    arena.release = lambda first, count: (calls.append(count), release(first, count))[1]
    stores = [StoreChunk("r", bytes([i]) * 32, slot, blocks, ticket=i + 1)
              for i, (slot, blocks) in enumerate([(3, (0, 1)), (4, (2, 3)), (5, (4, 5))])]
    run_step(w, StepPlan(1, stores=stores))
    w.flush()
    assert sorted(w.take_report().stored) == [1, 2, 3]
    chunked = w.stores.map_copy != "dma"  # the CPU copies through the host staging whatever was asked
    assert calls == ([1, 1, 1] if chunked else [3]) and arena.free_count == full
    w.close()


def test_a_writer_that_could_not_map_everything_stores_through_the_file(tmp_path, monkeypatch):
    from tutti.store import slabs as slabs_mod

    monkeypatch.setattr(slabs_mod, "free_bytes", lambda fd: geometry().slot_bytes)
    w = worker(tmp_path, make_caches(0), mapped_loads=True, slots_per_slab=8)
    w.warm_up()
    assert not w.store.maps_every_slab and not w.stores.into_maps
    w.close()


@pytest.mark.parametrize("reads_first", ["auto", False])
def test_store_writes_yield_to_a_loads_reads_in_flight(tmp_path, reads_first):
    """reads_first (auto wherever there is a write window: a drive): while a load's read is in
    flight the writer keeps one small write in flight, so the read is not queued behind a window
    of chunk writes; everything is still written and loads back bit-exact. The control
    (reads_first false) writes whole chunks, more than one segment at a time."""
    from tutti.io.queue import READ, IOFuture, IORequest, ReadsFirst

    src = make_caches(0)
    seg = geometry().segment_bytes
    w = worker(tmp_path, src, write_window_bytes="64KiB", reads_first=reads_first)
    peak, longest, submitted = [0], [0], []
    pending = IOFuture(IORequest(0, 0, torch.empty(seg, dtype=torch.uint8), 0, seg, READ))
    try:
        if reads_first == "auto":
            assert isinstance(w.ctx.reads, ReadsFirst) and w.ctx.reads.yield_bytes == 4 << 20
            w.ctx.reads = ReadsFirst(seg)  # one segment, so a chunk of this tiny geometry is split
            w.ctx.reads.track([pending])  # a load's read the drive has not answered yet
        else:
            assert w.ctx.reads is None
        real_submit = w.ctx.queue.submit

        def counting_submit(reqs):
            futs = real_submit(reqs)
            submitted.extend(f for f in futs if f.request.op != READ)
            longest[0] = max([longest[0]] + [f.request.length for f in futs if f.request.op != READ])
            peak[0] = max(peak[0], sum(f.request.length for f in submitted if not f.done()))
            return futs

        w.ctx.queue.submit = counting_submit
        chunks = [(s, [2 * s, 2 * s + 1]) for s in range(6)]
        stores = [StoreChunk("r", bytes([i]) * 32, slot, tuple(blocks), ticket=i + 1)
                  for i, (slot, blocks) in enumerate(chunks)]
        run_step(w, StepPlan(1, stores=stores))
        w.flush()
        rep = w.take_report()
        assert sorted(rep.stored) == [1, 2, 3, 4, 5, 6] and not rep.store_failed
        if reads_first == "auto":
            assert peak[0] <= seg and longest[0] == seg and w.ctx.reads.yields > 0
            pending.set_result(seg)  # the read lands: the window is the whole window again
            assert not w.ctx.reads.reading() and w.ctx.reads.window(64 << 10) == 64 << 10
        else:
            assert longest[0] == L * seg  # a whole chunk a request
    finally:
        w.close()
    dst = make_caches(1)
    w = worker(tmp_path, dst)
    try:
        run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([i]) * 32, s, (2 * s + 12, 2 * s + 13)) for i, (s, _) in enumerate(chunks[:5])]))
        assert w.take_failed_blocks() == set()
        for s_, d in zip(src, dst):
            for slot, blocks in chunks[:5]:
                assert torch.equal(d[[2 * slot + 12, 2 * slot + 13]], s_[blocks])
    finally:
        w.close()


def test_chunks_after_a_skipped_one_of_their_request_are_not_stored(tmp_path):
    """A hit needs every chunk from a prompt's first: once a request's chunk is skipped (no free
    staging region), its later chunks are skipped too until it finishes, leaving staging and the
    drive to stores a hit can reach; other requests are stored as before."""
    src = make_caches(0)
    w = worker(tmp_path, src)
    try:
        n = sum(count for _, count in w.stores.arena.take(10_000))  # the arena's whole room, in regions
        w.stores.arena.release(0, n)
        fill = [StoreChunk("q", bytes([100 + i]) * 32, i, (i % B, (i + 1) % B), ticket=100 + i) for i in range(n)]
        first = StoreChunk("r", bytes([1]) * 32, 40, (0, 1), ticket=1)
        run_step(w, StepPlan(1, stores=fill + [first]))  # the arena is full: r's first chunk is skipped
        w.flush()
        later = StoreChunk("r", bytes([2]) * 32, 41, (2, 3), ticket=2)
        other = StoreChunk("s", bytes([3]) * 32, 42, (4, 5), ticket=3)
        run_step(w, StepPlan(2, stores=[later, other]))
        w.flush()
        rep = w.take_report()
        assert sorted(rep.store_failed) == [1, 2] and rep.stores_skipped == 2
        assert 3 in rep.stored and all(100 + i in rep.stored for i in range(n))
        assert w.stores.leftovers()["holed"] == 1
        w.finished_requests({"r", "q", "s"})
        assert w.stores.leftovers()["holed"] == 0
    finally:
        w.close()
