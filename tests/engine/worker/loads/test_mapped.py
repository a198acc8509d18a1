"""Loads from mapped slabs (tutti/engine/worker/loads/mapped.py): copies, not reads; when a root is
mapped at all (RAM roots, no secret, room on the file system); a slab that shrank; their rate."""

import os

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan

from worker_helpers import L, make_caches, geometry, worker, run_step, store_chunks, RecordingQueue

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


def test_mapped_loads_come_from_the_mapping_not_read_calls(tmp_path):
    """A RAM root's loads (forced on here, on any file system) copy from the mapped slab: no read
    request reaches the IO queue, and whole and partial chunks land bit exact. The slab file a
    file-path writer left short is extended (sparse) by the mapping writer before it is mapped."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(3, [0, 1]), (7, [4, 5])])
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    assert slab.stat().st_size == 8 * geometry().slot_bytes  # written up to slot 7 only
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True)
    w.warm_up()  # maps (and on CUDA registers) every stored slab, as the connector does at start
    assert w.store.maps_ram and w.mapped_bytes == 64 * geometry().slot_bytes and slab.stat().st_size == 64 * geometry().slot_bytes  # capacity: 64 slots
    w.queue = RecordingQueue(w.queue)
    keep = [c[12].clone() for c in dst]
    loads = [LoadChunk("q", bytes([0]) * 32, 3, (20, 21)), LoadChunk("q", bytes([1]) * 32, 7, (12, 13), skip_blocks=1)]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == set() and w.queue.reads == 0
    for s, d, k in zip(src, dst, keep):
        assert torch.equal(d[[20, 21]], s[[0, 1]]) and torch.equal(d[13], s[5]) and torch.equal(d[12], k)
    w.close()


def test_mapped_loads_copy_chunks_in_consecutive_slots_at_once(tmp_path, monkeypatch):
    """Chunks stored back to back in one slab reach the ring in one copy (every copy call
    releases the GIL, and beside vLLM's spinning loop may wait out its switch interval); a chunk
    elsewhere gets its own, a damaged chunk inside a run still fails alone, and all land bit exact."""
    from tutti.engine.worker.loads import mapped as mapped_loads

    src = make_caches(0)
    store_chunks(tmp_path, src, [(3, [0, 1]), (4, [2, 3]), (5, [4, 5]), (9, [6, 7])])
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    with open(slab, "r+b") as f:  # flip a byte in layer 1 of slot 4
        off = 4 * geometry().slot_bytes + geometry().segment_bytes + 5
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x01]))
    runs, real = [], mapped_loads._runs
    monkeypatch.setattr(mapped_loads, "_runs", lambda rows, views, cb: [
        (r0, v) for r0, v in real(rows, views, cb) if not runs.append((r0, v.numel() // cb))])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True)
    w.warm_up()
    loads = [LoadChunk("q", bytes([i]) * 32, slot, blocks) for i, (slot, blocks) in
             enumerate([(3, (14, 15)), (4, (16, 17)), (5, (18, 19)), (9, (20, 21))])]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == {16, 17}
    assert runs == [(0, 3), (3, 1)]
    for s, d in zip(src, dst):
        assert torch.equal(d[[14, 15, 18, 19, 20, 21]], s[[0, 1, 4, 5, 6, 7]])
    w.close()


def test_mapped_loads_are_off_by_default_off_ram_file_systems(tmp_path):
    from tutti.store.rammap import fs_type

    w = worker(tmp_path, make_caches(0))
    assert w.store.maps_ram == (fs_type(str(tmp_path)) in ("tmpfs", "ramfs"))
    w.close()


def test_a_mapped_slab_that_shrank_is_never_touched(tmp_path):
    """Hardening round two, item 4: a slab file truncated under its mapping (a restore, `: >
    slab-0.bin`) would fault (SIGBUS) the server at the next load through the mapping; the load
    goes to the file path instead, which reads short and fails the chunk (vLLM recomputes)."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True)
    w.warm_up()  # maps every slab, as the connector does at start
    assert w.store.maps_ram and w.mapped_bytes > 0
    slab = next(tmp_path.rglob("slab-*.bin"))
    os.truncate(slab, geometry().slot_bytes + geometry().segment_bytes)  # slot 1 cut in its layer 1
    assert w.store.mapped(1, 1) is None and w.store.mapped(0, 0) is not None
    loads = [LoadChunk("q", bytes([0]) * 32, 0, (8, 9)), LoadChunk("q", bytes([1]) * 32, 1, (10, 11))]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == {10, 11}
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9]], s[[0, 1]])
    w.close()


def test_a_secret_turns_mapped_loads_off(tmp_path, monkeypatch):
    """Item 3: with keyed tags, a tag checked over the mapping and a DMA copying it later read the
    bytes twice; the file path verifies the very copy that goes to the GPU."""
    monkeypatch.setenv("TUTTI_TEST_SECRET", "s" * 32)
    w = worker(tmp_path, make_caches(0), mapped_loads=True, secret_env="TUTTI_TEST_SECRET")
    assert not w.store.maps_ram
    w.close()


def test_a_capacity_the_file_system_cannot_hold_is_not_pinned_at_start(tmp_path, monkeypatch):
    """A writer maps (and on CUDA pins) its whole capacity at start-up only where the file system
    can hold it: pinning pages past a tmpfs's size would fault the server. Otherwise the slabs
    that exist are mapped and the rest as they are created."""
    from tutti.store import slabs as slabs_mod

    monkeypatch.setattr(slabs_mod, "free_bytes", lambda fd: geometry().slot_bytes)  # room for one slot
    w = worker(tmp_path, make_caches(1), mapped_loads=True, slots_per_slab=8)
    w.warm_up()
    assert len(w.store.slabs.maps) == 0 and not list(tmp_path.rglob("slab-*.bin"))  # none created ahead
    w.close()
    monkeypatch.setattr(slabs_mod, "free_bytes", lambda fd: 1 << 40)
    w = worker(tmp_path, make_caches(1), mapped_loads=True, slots_per_slab=8)
    w.warm_up()
    assert len(w.store.slabs.maps) == 8 and len(list(tmp_path.rglob("slab-*.bin"))) == 8  # 64 slots / 8
    w.close()


def test_a_mapped_layer_wise_load_still_measures_a_rate(tmp_path):
    """A mapped RAM root's chunks are copied whole (no read to stall on) and it has no start-up
    probe: its loads must still give the hit policy a rate, or every hit found while another
    load is queued would be recomputed (an unmeasured store is loaded one hit at a time)."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1])])
    w = worker(tmp_path, make_caches(1), mapped_loads=True)
    assert w.store.maps_ram
    run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 1, (8, 9))]))
    rep = w.take_report()
    assert rep.bytes_loaded == L * geometry().segment_bytes and rep.rate_bytes == rep.bytes_loaded
    assert w.take_failed_blocks() == set()
    w.close()
