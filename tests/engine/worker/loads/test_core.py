"""The load paths' common core (tutti/engine/worker/loads/core.py): verifying (checksums, keyed tags),
failing exactly a chunk's blocks, stragglers past their deadline, and the blocks a partial or
kept chunk writes on every load path."""

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk

import worker_helpers
from worker_helpers import (
    L, B, N, make_caches, geometry, worker, run_step, store_chunks, _wrapped_worker, StallingQueue, damage,
    _run_whole,
)

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


def test_partial_chunk_load_leaves_local_blocks_alone(tmp_path):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1])])
    dst = make_caches(1)
    keep = [c[5].clone() for c in dst]
    w = worker(tmp_path, dst)
    run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 0, (5, 6), skip_blocks=1)]))
    for s, d, k in zip(src, dst, keep):
        assert torch.equal(d[5], k)  # vLLM's own prefix-cache block: not written
        assert torch.equal(d[6], s[1])
    w.close()


@pytest.mark.parametrize("k", [1, 2, 4])
def test_kth_read_failure_fails_exactly_that_chunks_blocks(tmp_path, k):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = _wrapped_worker(tmp_path, dst, fail_read=k)
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]
    run_step(w, StepPlan(2, loads=loads))
    bad = loads[(k - 1) % 2]  # reads go out layer by layer, chunk by chunk
    good = loads[k % 2]
    assert w.take_failed_blocks() == set(bad.block_ids)
    assert w.take_report().load_failed == [bad.key]
    gsrc = [0, 1] if good is loads[0] else [2, 3]
    for s, d in zip(src, dst):
        assert torch.equal(d[list(good.block_ids)], s[gsrc])
    w.close()


@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_corrupt_slab_is_caught_by_checksum(tmp_path, mapped):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3])])
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    with open(slab, "r+b") as f:  # flip a byte in layer 1 of slot 1
        off = geometry().slot_bytes + geometry().segment_bytes + 100
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x40]))
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=mapped)
    loads = [LoadChunk("q", bytes([0]) * 32, 0, (8, 9)), LoadChunk("q", bytes([1]) * 32, 1, (10, 11))]
    run_step(w, StepPlan(2, loads=loads))
    # verified on the device, read back once after the step: the bad chunk's blocks are
    # reported failed (vLLM drops the step's output for them and recomputes), the good one is exact
    assert w.take_failed_blocks() == {10, 11}
    assert w.take_report().load_failed == [loads[1].key]
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9]], s[[0, 1]])
    assert not torch.equal(dst[1][[10, 11]], src[1][[2, 3]])  # the flipped byte is in layer 1
    w.close()
    # the chunk was journaled free: a fresh worker does not hold it any more
    w = worker(tmp_path, make_caches(2))
    run_step(w, StepPlan(3, loads=loads))
    assert w.take_failed_blocks() == {10, 11}
    w.close()


def _forge(tmp_path, slot, new_bytes_of_layer1):
    """What anyone who can write the store could do without a secret: new bytes in a slab and a
    journal record whose (unkeyed) checksums match them."""
    from tutti.store.fingerprint import Fingerprint
    from tutti.store.chunk_store import ChunkStore, list_namespaces
    from tutti.kernels import segment_checksum

    ns = list_namespaces(str(tmp_path))[0]
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    seg = geometry().segment_bytes
    with open(slab, "r+b") as f:
        f.seek(slot * geometry().slot_bytes + seg)
        f.write(new_bytes_of_layer1)
        f.seek(slot * geometry().slot_bytes)
        data = f.read(geometry().slot_bytes)
    st = ChunkStore(str(tmp_path), Fingerprint.from_dict(ns.manifest["fingerprint"]),
                    capacity_bytes=64 * geometry().slot_bytes, writer=True)
    key = st.entries()[slot].key
    sums = segment_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(L, seg)).tolist()
    st.record_put(key, slot, [int(v) & ((1 << 64) - 1) for v in sums])
    st.sync_journal()
    st.close()


@pytest.mark.parametrize("secret", [False, True])
@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_forged_kv_is_refused_only_with_a_secret(tmp_path, monkeypatch, secret, mapped):
    """Without a secret the store trusts whoever can write it (private modes make that only its
    user): forged bytes with matching checksums are served. With one, their keyed tags fail and
    nothing of them is scattered."""
    kw = {}
    if secret:
        monkeypatch.setenv("TUTTI_TEST_SECRET", "0123456789abcdef-secret")
        kw = {"secret_env": "TUTTI_TEST_SECRET"}
    src = make_caches(0)
    w = worker(tmp_path, src, **kw)
    run_step(w, StepPlan(1, stores=[StoreChunk("r", bytes([1]) * 32, 0, (0, 1), ticket=1),
                                    StoreChunk("r", bytes([2]) * 32, 1, (2, 3), ticket=2)]))
    w.flush()
    assert sorted(w.take_report().stored) == [1, 2]
    w.close()
    _forge(tmp_path, 1, bytes(range(256)) * (geometry().segment_bytes // 256))
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst, mapped_loads=mapped, **kw)
    loads = [LoadChunk("q", bytes([1]) * 32, 0, (8, 9)), LoadChunk("q", bytes([2]) * 32, 1, (10, 11))]
    run_step(w, StepPlan(2, loads=loads))
    failed = w.take_failed_blocks()
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9]], s[[0, 1]])  # the untouched chunk loads either way
    if secret:
        assert failed == {10, 11}
        assert torch.equal(dst[1][[10, 11]], before[1][[10, 11]])  # checked before scatter: nothing of it lands
    else:
        assert failed == set() and not torch.equal(dst[1][[10, 11]], src[1][[2, 3]])  # served: the documented trust
    w.close()


def test_a_stalled_read_fails_its_chunk_and_never_hangs_the_step(tmp_path):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, io_timeout_s=0.2)
    stall = 2 * geometry().slot_bytes  # slot 2, layer 0
    w.queue = StallingQueue(w.queue, [stall])
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == {10, 11}
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9]], s[[0, 1]])
    w.queue.release()
    w.queue.stall_offsets = set()
    run_step(w, StepPlan(3, loads=loads))  # the slot came back; the chunk was not dropped (the disk was slow)
    assert w.take_failed_blocks() == set()
    for s, d in zip(src, dst):
        assert torch.equal(d[[10, 11]], s[[2, 3]])
    w.close()


# ---------------------------------------------------------------- a hit's last chunk (keep_blocks)
TAIL_PATHS = ["layer", "whole_full_graph", "whole_async", "mapped", "mapped_async"]


def _tail_worker(tmp_path, caches, how):
    """A worker loading through `how`: the layer-wise file path, a whole chunk-major file load
    (a FULL-graph step or an asynchronous one), or mapped slabs (a RAM root, forced on)."""
    mapped = how.startswith("mapped")
    w = _wrapped_worker(tmp_path, caches, mapped_loads=mapped, async_loads=how.endswith("async"))
    if mapped:
        w.warm_up()  # maps every stored slab, as the connector does at start
        assert w.store.maps_ram
    return w


def _tail_load(w, how, loads):
    """Runs `loads` (every one of request "q") through `how`; returns the blocks reported failed."""
    if how in ("layer", "mapped"):
        run_step(w, StepPlan(2, loads=loads))
        return w.take_failed_blocks()
    return _run_whole(w, 2, loads, "async" if how.endswith("async") else "full_graph")


@pytest.fixture
def four_block_chunks(monkeypatch):
    """Chunks of 4 blocks (worker_helpers' default has 2): a load may then skip one and keep three."""
    monkeypatch.setattr(worker_helpers, "T", 4 * N)  # geometry() and config() read it at each call
    return 4


def _tail_loads():
    """Chunk i (key bytes([i]) * 32, slot i) from src blocks 4i..4i+3 into dst blocks 12+4i..: chunk 0
    keeps 3 blocks (its 4th is the null block's stand-in, as the planner pads an asynchronous
    load's list: block 0 here, which must stay untouched), chunk 1 skips 1 and keeps 3, chunk 2 is whole."""
    return [LoadChunk("q", bytes([0]) * 32, 0, (12, 13, 14, 0), keep_blocks=3),
            LoadChunk("q", bytes([1]) * 32, 1, (16, 17, 18, 19), skip_blocks=1, keep_blocks=3),
            LoadChunk("q", bytes([2]) * 32, 2, (20, 21, 22, 23))]


@pytest.mark.parametrize("how", TAIL_PATHS)
def test_a_load_keeping_blocks_writes_only_those(tmp_path, four_block_chunks, how):
    """A hit reaching the prompt's last chunk loads all of it but its last block (vLLM computes
    that one): exactly blocks[skip:keep] are written, byte-equal to the stored ones, on every
    load path; the whole chunk is still read (and verified)."""
    src = make_caches(0)
    rep = store_chunks(tmp_path, src, [(i, range(4 * i, 4 * i + 4)) for i in range(3)])
    assert sorted(rep.stored) == [1, 2, 3]
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = _tail_worker(tmp_path, dst, how)
    loads = _tail_loads()
    assert _tail_load(w, how, loads) == set()
    written = {12: 0, 13: 1, 14: 2, 17: 5, 18: 6, 20: 8, 21: 9, 22: 10, 23: 11}
    for s, d, b0 in zip(src, dst, before):
        for blk in range(B):
            want = s[written[blk]] if blk in written else b0[blk]
            assert torch.equal(d[blk], want), (how, blk)
    if not how.startswith("mapped"):
        assert w.queue.reads > 0
    assert 2 in w.take_report().steps_done or how.endswith("async")
    w.close()


@pytest.mark.parametrize("how", TAIL_PATHS)
def test_a_corrupt_kept_chunk_fails_only_the_blocks_it_would_write(tmp_path, four_block_chunks, how):
    """A damaged chunk loaded with skip and keep fails blocks[skip:keep] only: never the block vLLM
    computes itself (nor its own cached one), so vLLM recomputes from the first of them."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(i, range(4 * i, 4 * i + 4)) for i in range(3)])
    damage(tmp_path, 1, 2)  # slot 1 (the chunk that skips 1 and keeps 3), layer 2
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = _tail_worker(tmp_path, dst, how)
    loads = _tail_loads()
    assert _tail_load(w, how, loads) == {17, 18}
    assert w.take_report().load_failed == [loads[1].key]
    for s, d, b0 in zip(src, dst, before):
        assert torch.equal(d[[12, 13, 14]], s[[0, 1, 2]]) and torch.equal(d[[0, 15]], b0[[0, 15]])
        assert torch.equal(d[[16, 19]], b0[[16, 19]])  # vLLM's own blocks: never written
    w.close()
