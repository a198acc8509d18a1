"""The layer-wise pipeline on CPU tensors with real files, a real IO queue and real kernels."""

import os
import shutil
import time

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk
from tutti.engine.build import Geometry, build_worker
from tutti.io.queue import WrappedQueue
from tutti.kernels import PagedLayout

L, B, H, N, D = 3, 24, 2, 16, 8  # layers, kernel blocks, kv heads, tokens/block, head size
T = 32  # chunk tokens: 2 blocks
BPC = T // N


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES, autouse=True)
def device(request):
    """Every test runs on the CPU (synchronous kernels) and, where CUDA exists, on the GPU
    (compiled Triton, side streams and events)."""
    global DEV
    DEV = request.param
    yield request.param


DEV = "cpu"


def make_caches(seed=0):
    g = torch.Generator().manual_seed(seed)
    # vLLM's CPU backend: [B, H, N, 2D], each (block, head) page K rows then V rows
    return [torch.randn(B, H, N, 2 * D, generator=g).to(DEV) for _ in range(L)]


def views(caches):
    return [c.as_strided((B, H, 2, N, D), (c.stride(0), c.stride(1), N * D, D, 1)) for c in caches]


def geometry():
    return Geometry(model="tiny", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L,
                    num_heads=H, content_bytes=2 * D * 4)


def config(root, **kw):
    cfg = {"root": str(root), "capacity_bytes": 64 * geometry().slot_bytes, "chunk_tokens": T,
           "staging_bytes": 16 * 16384, "staging_slots": 16, "max_inflight_stores": 8, "lookahead": 1}
    cfg.update(kw)
    return cfg


def worker(root, caches, **kw):
    v = views(caches)
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    return build_worker(config(root, **kw), geometry(), caches=v, layout=layout)


def run_step(w, plan):
    w.start_step(plan)
    for layer in range(L):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()


def block_bytes(caches, blocks):
    return [c[list(blocks)].clone() for c in caches]


def store_chunks(root, caches, chunks):
    w = worker(root, caches)
    stores = [StoreChunk("r", bytes([i]) * 32, slot, tuple(blocks), ticket=i + 1)
              for i, (slot, blocks) in enumerate(chunks)]
    run_step(w, StepPlan(1, stores=stores))
    w.flush()
    rep = w.take_report()
    w.close()
    return rep


def test_store_then_load_into_other_blocks_is_bit_exact(tmp_path):
    src = make_caches(0)
    rep = store_chunks(tmp_path, src, [(3, [0, 1]), (7, [4, 5]), (8, [10, 11])])
    assert sorted(rep.stored) == [1, 2, 3] and not rep.store_failed
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst)
    loads = [LoadChunk("q", bytes([0]) * 32, 3, (20, 21)), LoadChunk("q", bytes([2]) * 32, 8, (2, 3))]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == set()
    for s, d, b in zip(src, dst, before):
        assert torch.equal(d[[20, 21]], s[[0, 1]])
        assert torch.equal(d[[2, 3]], s[[10, 11]])
        untouched = [i for i in range(B) if i not in (20, 21, 2, 3)]
        assert torch.equal(d[untouched], b[untouched])
    rep = w.take_report()
    assert rep.steps_done == [2] and rep.bytes_loaded == 2 * L * geometry().segment_bytes
    w.close()


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


@pytest.mark.parametrize("asynchronous", [False, True], ids=["in_step", "async"])
@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_the_warm_up_runs_every_op_a_load_runs_and_changes_no_byte(tmp_path, mapped, asynchronous):
    """CUDA loads a kernel's module on its first launch, holding the context's lock: a serving trace
    caught vLLM's thread stalled 25 ms behind a load's first index_select. Every op of these loads
    (partial chunks, rows picked by index, verdicts) ran at start-up first, on block 0's own bytes."""
    def ops(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
        return {e.key for e in prof.key_averages() if e.key.startswith("aten::")}

    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])])
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst, mapped_loads=mapped, async_loads=asynchronous)
    warm = ops(w.warm_up)
    assert all(torch.equal(a, b) for a, b in zip(dst, before))
    if DEV == "cuda":  # pinned room for the verdicts of a step loading every block: never allocated while serving
        lp = w.async_loads.pipeline if asynchronous else w.loads
        assert lp._verdict_buf is not None and lp._verdict_buf.numel() >= (B // 2) * L
        inline = w.async_loads.inline if asynchronous else None
        if inline is not None:  # jobs launched from the step's thread: a pinned buffer each, sized now
            assert inline._pool_free and all(b.numel() >= (B // 2) * L and b.is_pinned() for b in inline._pool_free)
            assert inline._verdict_buf is None  # its verdicts go to the pool's buffers only

    def step(n, lds):
        run_step(w, StepPlan(n, async_step=n + 100, async_loads=lds) if asynchronous else StepPlan(n, loads=lds))
        w.flush()

    def loads():
        step(2, [LoadChunk("q", bytes([0]) * 32, 0, (10, 11), skip_blocks=1),
                 LoadChunk("q", bytes([1]) * 32, 1, (12, 13)), LoadChunk("q", bytes([2]) * 32, 2, (14, 15))])
        step(3, [LoadChunk("q", bytes([0]) * 32, 0, (16, 17)),
                 LoadChunk("q", bytes([2]) * 32, 2, (18, 19), skip_blocks=1)])
        run_step(w, StepPlan(4))

    served = ops(loads)
    assert w.take_failed_blocks() == set()
    assert served - warm == set()
    for s, d in zip(src, dst):
        assert torch.equal(d[11], s[1]) and torch.equal(d[[12, 13, 14, 15]], s[[2, 3, 4, 5]])
    w.close()


class RecordingQueue(WrappedQueue):
    """Wraps a real queue: records each submit and can fail the k-th read."""

    def __init__(self, inner, fail_read=None):
        super().__init__(inner)
        self.fail_read, self.log, self.reads = fail_read, [], 0
        self.sized = []  # (submit, op, offset, length)

    def submit(self, requests):
        futs = self.inner.submit(requests)
        for r, f in zip(requests, futs):
            self.log.append(("submit", r.op, r.offset))
            self.sized.append(("submit", r.op, r.offset, r.length))
            if r.op == "read":
                self.reads += 1
                if self.reads == self.fail_read:
                    f.result()
                    f._error = OSError(5, "injected read failure")
        return futs


def _wrapped_worker(tmp_path, caches, fail_read=None, **kw):
    w = worker(tmp_path, caches, **kw)
    w.queue = RecordingQueue(w.queue, fail_read)
    return w


def finish_two_chunk_load(w, src, dst, first_layer=0):
    """Run the rest of a step that loads slots 1 and 2 (stored from blocks 0-3) into blocks 8-11,
    and check every block landed bit exact, none failed."""
    for layer in range(first_layer, L):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()
    assert w.take_failed_blocks() == set()
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9, 10, 11]], s[[0, 1, 2, 3]])
    w.close()


def test_lookahead_auto_reads_as_far_as_the_load_slots_allow(tmp_path):
    """lookahead "auto": read-ahead bounded by staging space, not by a count of layers: with 8 load
    slots and 3 layers of one item each, every layer's reads are out before layer 0 computes."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = _wrapped_worker(tmp_path, dst, lookahead="auto")
    seg = geometry().segment_bytes
    w.start_step(StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]))
    assert {(o % geometry().slot_bytes) // seg for _, op, o in w.queue.log if op == "read"} == set(range(L))
    finish_two_chunk_load(w, src, dst)


def test_rolling_read_never_runs_ahead_of_lookahead(tmp_path):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = _wrapped_worker(tmp_path, dst)  # lookahead 1
    seg = geometry().segment_bytes
    layer_of = lambda off: (off % geometry().slot_bytes) // seg
    w.start_step(StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]))
    order = []
    for layer in range(L):
        submitted = {layer_of(o) for _, op, o in w.queue.log if op == "read"}
        order.append((layer, sorted(submitted)))
        assert max(submitted) <= layer + 1, f"reads ran ahead: {submitted} before layer {layer}"
        assert layer in submitted
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()
    assert order == [(0, [0]), (1, [0, 1]), (2, [0, 1, 2])]
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9, 10, 11]], s[[0, 1, 2, 3]])
    w.close()


def test_a_traced_layer_wise_load_keeps_each_layers_reads_landing_and_readiness_in_order(tmp_path, monkeypatch):
    """TUTTI_TRACE: the host's timeline of a rolling load (start, reads submitted, reads landed,
    layer ready), and on CUDA the device's (each layer's scatter done on the load stream, the
    compute stream past its wait): what a benchmark reads to see whether a step waited for the
    disk, for the host or for the compute."""
    monkeypatch.setenv("TUTTI_TRACE", "1")
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst)
    run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]))
    assert w.take_failed_blocks() == set()
    events = [(what, layer) for what, layer, _ in w.trace]
    assert events[0] == ("start", -1)
    times = [t for _, _, t in w.trace]
    assert times == sorted(times)
    for layer in range(L):
        at = {what: events.index((what, layer)) for what in ("read", "io_done", "ready")}
        assert at["read"] < at["io_done"] < at["ready"], (layer, events)
    gpu = w.loads.gpu_timeline()
    if DEV == "cpu":
        assert w.loads.gpu_marks is None and gpu == []
    else:
        when = {(what, layer): ms for what, layer, ms in gpu}
        for layer in range(L):
            # the compute stream passed layer's wait only after the load stream had scattered it
            assert when[("compute", layer)] >= when[("loaded", layer)] >= 0.0
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9, 10, 11]], s[[0, 1, 2, 3]])
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


@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_whole_step_loads_finish_before_the_forward(tmp_path, mapped):
    """A step without per-layer hooks (a FULL CUDA graph) gets every layer at start_step."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=mapped)
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]
    w.start_step(StepPlan(2, loads=loads), layerwise=False)
    if DEV == "cuda":
        torch.cuda.current_stream().synchronize()  # what the forward's kernels would wait for
    for s, d in zip(src, dst):  # before any hook
        assert torch.equal(d[[8, 9, 10, 11]], s[[0, 1, 2, 3]])
    w.end_step()
    assert w.take_failed_blocks() == set()
    w.close()


@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_loads_the_forward_did_not_wait_for_are_failed(tmp_path, mapped):
    """Layer-wise loads whose hooks never ran (the forward computed without them) are never served."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1])])
    w = worker(tmp_path, make_caches(1), mapped_loads=mapped)
    w.start_step(StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 1, (8, 9))]))
    w.end_step()  # no wait_layer: as if a graph replayed the forward
    assert w.take_failed_blocks() == {8, 9}
    w.close()


def test_second_writer_on_one_root_is_refused(tmp_path):
    """The same writer slot twice is refused (writer_id "" asked for explicitly; "auto", the
    default, takes another slot: tests/engine/test_sharing.py)."""
    w = worker(tmp_path, make_caches(0), writer_id="")
    with pytest.raises(Exception, match="(?i)lock|in use|writer"):
        worker(tmp_path, make_caches(1), writer_id="")
    w.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host/device synchronization exists only on CUDA")
def test_a_step_of_loads_and_stores_never_makes_the_host_wait(tmp_path):
    """torch's sync debug mode raises on any synchronizing CUDA call (.item(), .tolist(),
    pageable copies, stream/device synchronize) made inside a step's loads and stores."""
    if DEV != "cuda":
        pytest.skip("CUDA case only")
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst)
    w.warm_up()
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11, ))]
    stores = [StoreChunk("q", bytes([9]) * 32, 5, (12, 13), ticket=7)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for layerwise in (True, False):
            w.start_step(StepPlan(2, loads=loads, stores=stores if layerwise else []), layerwise=layerwise)
            for layer in range(L):
                w.wait_layer(layer)
                w.save_layer(layer)
            w.end_step()
            failed = w.take_failed_blocks()  # the one read-back: an event wait, not a sync call
            assert failed == set()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    w.flush()
    assert w.take_report().stored == [7]
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9, 10, 11]], s[[0, 1, 2, 3]])
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


class StallingQueue(RecordingQueue):
    """A real queue whose reads at chosen file offsets never complete until released (a stalled
    network file system), to prove a load fails its chunk instead of hanging the step."""

    def __init__(self, inner, stall_offsets, op="read"):
        super().__init__(inner)
        self.stall_offsets, self.held, self.op = set(stall_offsets), [], op

    def submit(self, requests):
        from tutti.io.queue import IOFuture

        out = []
        for r in requests:
            if r.op == self.op and r.offset in self.stall_offsets:
                fut = IOFuture(r)
                self.held.append(fut)
                out.append(fut)
            else:
                out.extend(self.inner.submit([r]))
        return out

    def release(self):
        for fut in self.held:
            fut.set_result(fut.request.length)  # the stalled read lands, long after its deadline
        self.held = []


class ShallowGatedQueue(WrappedQueue):
    """A real queue that takes at most `depth` requests in flight (a full queue refuses the rest, as
    io_uring's does) and holds the reads of `gated` layers back from the file until open() (a disk
    busy with them): what a full queue looks like to the forward thread."""

    def __init__(self, inner, depth, gated, layer_of):
        super().__init__(inner)
        import threading

        self.depth, self.gated, self.layer_of = depth, set(gated), layer_of
        self.cond = threading.Condition()
        self.in_flight = self.completed = self.polled = 0
        self.held = []  # (request, its future) not yet handed to the file

    def caps(self):
        import dataclasses

        return dataclasses.replace(self.inner.caps(), queue_depth=self.depth, max_in_flight=self.depth)

    def _landed(self, _fut):
        with self.cond:
            self.in_flight -= 1
            self.completed += 1
            self.cond.notify_all()

    def _send(self, req, out):
        inner = self.inner.submit([req])[0]
        inner.add_done_callback(lambda f, out=out: out.set_exception(f._error) if f._error is not None
                                else out.set_result(f._result))

    def submit(self, requests):
        from tutti.io.queue import IOFuture

        with self.cond:
            room = max(0, self.depth - self.in_flight)
            taken = list(requests)[:room]
            self.in_flight += len(taken)
        outs = []
        for r in taken:
            out = IOFuture(r)
            out.add_done_callback(self._landed)
            outs.append(out)
            if r.op == "read" and self.layer_of(r.offset) in self.gated:
                self.held.append((r, out))
            else:
                self._send(r, out)
        return outs

    def poll(self, timeout=0.0):
        with self.cond:
            if self.completed == self.polled and timeout:
                self.cond.wait_for(lambda: self.completed != self.polled, timeout)
            n, self.polled = self.completed - self.polled, self.completed
            return n

    def open(self):
        self.gated = set()
        held, self.held = self.held, []
        for r, out in held:
            self._send(r, out)


def test_a_full_io_queue_never_holds_up_a_layer_whose_reads_have_landed(tmp_path):
    """The forward thread submits later layers' reads as it goes (lookahead); a full IO queue takes
    them later, on its own time: layer 0, whose reads have landed, is ready although the queue is
    full of layer 1 and 2 reads that the disk has not served yet (before, wait_layer(0) waited for
    room for layer 2's reads, i.e. for the disk to serve layer 1 first)."""
    import threading

    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, lookahead=2)
    seg = geometry().segment_bytes
    w.queue = q = ShallowGatedQueue(w.queue, depth=3, gated={1, 2},
                                    layer_of=lambda off: (off % geometry().slot_bytes) // seg)
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]
    w.start_step(StepPlan(2, loads=loads))
    t = threading.Thread(target=w.wait_layer, args=(0,), daemon=True)
    t.start()
    t.join(10)
    layer0_waited = t.is_alive()
    q.open()  # the disk serves layers 1 and 2 (and lets a waiting forward thread go)
    t.join(10)
    assert not layer0_waited, "layer 0 waited for room in the queue for later layers' reads"
    assert torch.equal(dst[0][[8, 9, 10, 11]], src[0][[0, 1, 2, 3]])  # layer 0 ready before the gate opened
    w.save_layer(0)
    finish_two_chunk_load(w, src, dst, first_layer=1)


def test_reads_a_full_queue_never_takes_fail_their_chunks_within_the_timeout(tmp_path):
    """A queue that stays full (a stalled file system holding its one entry) never hangs the step:
    the awaited layer's reads it never took fail their chunks at io_timeout_s, as a stalled read
    does; once the stall clears, the next step loads both chunks."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, io_timeout_s=0.2)
    seg = geometry().segment_bytes
    w.queue = q = ShallowGatedQueue(w.queue, depth=1, gated={0, 1, 2},
                                    layer_of=lambda off: (off % geometry().slot_bytes) // seg)
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]
    t0 = time.monotonic()
    run_step(w, StepPlan(2, loads=loads))
    assert time.monotonic() - t0 < 5
    assert w.take_failed_blocks() == {8, 9, 10, 11}
    q.open()  # the stalled read lands; the queue frees its entry
    q.depth = 8
    w.start_step(StepPlan(3, loads=loads))
    finish_two_chunk_load(w, src, dst)


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


def test_slab_descriptors_stay_bounded_and_data_round_trips(tmp_path):
    """One slot per slab and room for two open slabs: 8 chunks stored and loaded back through
    8 slab files, bit exact, with never more than two slab descriptors left open (IO in flight
    holds its descriptor; closing one under a read could let the next open reuse its number)."""
    src = make_caches(0)
    chunks = [(s, [2 * s, 2 * s + 1]) for s in range(8)]
    w = worker(tmp_path, src, slots_per_slab=1, max_open_slabs=2)
    stores = [StoreChunk("r", bytes([i]) * 32, slot, tuple(b), ticket=i + 1) for i, (slot, b) in enumerate(chunks)]
    run_step(w, StepPlan(1, stores=stores))
    w.flush()
    assert sorted(w.take_report().stored) == list(range(1, 9))
    assert w.store.open_slabs <= 2 and w.store.slabs_closed >= 6
    w.close()
    dst = make_caches(1)
    w = worker(tmp_path, dst, slots_per_slab=1, max_open_slabs=2)
    loads = [LoadChunk("q", bytes([i]) * 32, slot, (2 * (7 - i), 2 * (7 - i) + 1)) for i, (slot, _) in enumerate(chunks)]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == set()
    for s, d in zip(src, dst):
        for i in range(8):
            assert torch.equal(d[[2 * (7 - i), 2 * (7 - i) + 1]], s[[2 * i, 2 * i + 1]])
    assert w.store.open_slabs <= 2 and w.store.slabs_closed >= 6
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


@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_async_loads_are_bit_exact_and_fail_block_by_block(tmp_path, mapped):
    """`async_loads` (one KV cache group): a hit loads on its own thread and stream while vLLM
    holds the request; a good chunk arrives bit exact, a damaged one is reported with exactly the
    blocks it would have written (vLLM recomputes from the first), in the same take() as its
    request, and nothing of it reaches the step's own failed blocks."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])])
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    with open(slab, "r+b") as f:  # flip a byte in layer 2 of slot 1
        off = geometry().slot_bytes + 2 * geometry().segment_bytes + 9
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x10]))
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst, mapped_loads=mapped, async_loads=True)
    assert w.async_loads is not None and w.store.maps_ram == mapped
    adds, add = [], w.counters.add
    w.counters.add = lambda **kw: (adds.append(dict(kw)), add(**kw))[1]
    loads = [LoadChunk("a", bytes([0]) * 32, 0, (14, 15)), LoadChunk("b", bytes([1]) * 32, 1, (16, 17)),
             LoadChunk("b", bytes([2]) * 32, 2, (18, 19), skip_blocks=1)]
    # on CUDA a mapped root's jobs are launched from the step's thread (async_launch "auto"; on the
    # CPU a launch would be the whole load), the file path's run on the loading thread
    assert (w.async_loads.inline is not None) == (mapped and DEV == "cuda")
    run_step(w, StepPlan(2, async_step=3, async_loads=loads))
    w.flush()
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert w.received_requests() == ({"a"}, {"b"}, {16, 17})
    # bytes and the seconds they took arrive in one report (the hit policy's read rate): a report
    # taken while the job runs never holds bytes without their time
    moved = [a for a in adds if a.get("bytes_loaded")]
    assert moved and all(a.get("rate_seconds", 0) > 0 and a.get("rate_bytes") == a["bytes_loaded"] for a in moved)
    assert sum(a["bytes_loaded"] for a in moved) == 3 * L * geometry().segment_bytes  # read (the bad one is judged after)
    assert w.take_failed_blocks() == set()
    for s, d, b0 in zip(src, dst, before):
        assert torch.equal(d[[14, 15]], s[[0, 1]])
        assert torch.equal(d[19], s[5]) and torch.equal(d[18], b0[18])  # the skipped block is vLLM's own
    rep = w.take_report()
    assert 3 in rep.steps_done and rep.load_failed == [loads[1].key]
    w.close()


def damage(tmp_path, slot, layer):
    slab = next(p for p in tmp_path.rglob("slab-*.bin"))
    with open(slab, "r+b") as f:
        off = slot * geometry().slot_bytes + layer * geometry().segment_bytes + 9
        f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0x10]))


def test_async_loads_launched_from_the_step_thread_report_each_job_with_its_own_failures(tmp_path):
    """A mapped root's asynchronous loads are launched from the step's thread and only polled
    after (async_launch "auto"): several jobs in flight land in order, and each is reported with
    its own failed chunks and blocks, never with another job's."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3]), (2, [4, 5])])
    damage(tmp_path, 1, 2)
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True, async_loads=True, async_launch="step")
    w.warm_up()
    assert w.async_loads.inline is not None
    w.async_loads._run = lambda *a, **kw: pytest.fail("the loading thread ran a mapped root's job")
    run_step(w, StepPlan(2, async_step=3, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (14, 15))]))
    run_step(w, StepPlan(4, async_step=5, async_loads=[LoadChunk("b", bytes([1]) * 32, 1, (16, 17)),
                                                       LoadChunk("b", bytes([2]) * 32, 2, (18, 19))]))
    run_step(w, StepPlan(6, async_step=7, async_loads=[LoadChunk("c", bytes([2]) * 32, 2, (20, 21))]))
    w.flush()
    assert w.received_requests() == ({"a", "c"}, {"b"}, {16, 17})
    for s, d in zip(src, dst):
        assert torch.equal(d[[14, 15]], s[[0, 1]]) and torch.equal(d[[18, 19, 20, 21]], s[[4, 5, 4, 5]])
    rep = w.take_report()
    assert {3, 5, 7} <= set(rep.steps_done) and rep.load_failed == [bytes([1]) * 32]
    assert w.async_loads.pending == 0
    w.close()


def test_a_step_thread_job_fails_a_chunk_whose_slab_shrank_without_reading_it(tmp_path):
    """Launched from the step's thread, a job never reads (a read would make the step wait): a
    chunk whose slab shrank under its mapping fails with its blocks, the others arrive."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True, async_loads=True, async_launch="step")
    w.warm_up()
    os.truncate(next(tmp_path.rglob("slab-*.bin")), geometry().slot_bytes + geometry().segment_bytes)
    reads = []
    submit = w.queue.submit
    w.queue.submit = lambda *a, **kw: (reads.append(a), submit(*a, **kw))[1]
    run_step(w, StepPlan(2, async_step=3, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (8, 9)),
                                                       LoadChunk("b", bytes([1]) * 32, 1, (10, 11))]))
    w.flush()
    assert w.received_requests() == ({"a"}, {"b"}, {10, 11}) and reads == []
    for s, d in zip(src, dst):
        assert torch.equal(d[[8, 9]], s[[0, 1]])
    w.close()


@pytest.mark.parametrize("why", ["async_launch_thread", "no_verdict_buffer_free"])
def test_a_mapped_roots_job_runs_on_the_loading_thread_when_asked_or_when_no_verdict_buffer_is_free(tmp_path, why):
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True, async_loads=True,
               async_launch="thread" if why == "async_launch_thread" else "step")
    assert w.store.maps_ram and (w.async_loads.inline is None) == (why == "async_launch_thread")
    if w.async_loads.inline is not None:
        w.async_loads.inline.can_detach = lambda: False
    ran = []
    run = w.async_loads._run
    w.async_loads._run = lambda *a, **kw: (ran.append(1), run(*a, **kw))[1]
    run_step(w, StepPlan(2, async_step=3, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (14, 15))]))
    w.flush()
    assert w.received_requests() == ({"a"}, set(), set()) and ran == [1]
    for s, d in zip(src, dst):
        assert torch.equal(d[[14, 15]], s[[0, 1]])
    w.close()


def test_a_step_thread_job_never_makes_the_host_wait_and_is_reported_only_once_landed(tmp_path):
    """On CUDA: launched while the compute stream is still busy, the job returns at once (the
    host never waited for the device), is not reported while its stream has not reached its
    event, and is reported at the first poll after."""
    if DEV != "cuda":
        pytest.skip("streams and events exist only on CUDA")
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=True, async_loads=True)
    w.warm_up()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of the compute stream
    run_step(w, StepPlan(2, async_step=3, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (14, 15))]))
    assert not torch.cuda.current_stream().query()  # the launch returned while the forward's stream was busy
    assert w.received_requests() == (set(), set(), set()) and w.async_loads.pending == 1
    torch.cuda.synchronize()
    assert w.received_requests() == ({"a"}, set(), set())
    for s, d in zip(src, dst):
        assert torch.equal(d[[14, 15]], s[[0, 1]])
    w.close()


def test_async_loads_keep_a_timeline_of_each_job(tmp_path):
    """Each asynchronous job records when it was submitted, started, queued, landed and taken by
    the step that tells vLLM, in that order (where a hit's wait outside the batch goes)."""
    store_chunks(tmp_path, make_caches(0), [(0, [0, 1])])
    w = worker(tmp_path, make_caches(1), async_loads=True)
    run_step(w, StepPlan(2, async_step=3, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (14, 15))]))
    w.flush()
    assert w.received_requests()[0] == {"a"}
    (e,) = list(w.async_loads.timeline)
    assert e["step"] == 3 and e["chunks"] == 1
    assert e["submitted"] <= e["started"] <= e["launched"] <= e["landed"] <= e["taken"]
    w.close()


def test_async_loads_need_two_load_slots(tmp_path):
    with pytest.raises(ValueError, match="async_loads: needs at least 2 load staging slots"):
        worker(tmp_path, make_caches(0), staging_slots=9, max_inflight_stores=8, async_loads=True)


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


def test_keyed_tags_bind_the_rank(tmp_path, monkeypatch):
    """Hardening round two, item 1: a segment's keyed tag binds the namespace it is right for
    (rank, geometry, model), not only (key, layer, bytes). TP rank 1's slab and journal copied
    into rank 0's namespace (what a group member without the secret can do) fail their tags
    there: rank 1's heads are never served to rank 0. Rank 1 itself still loads them."""
    import dataclasses
    import shutil

    monkeypatch.setenv("TUTTI_TEST_SECRET", "0123456789abcdef-secret")
    kw = {"secret_env": "TUTTI_TEST_SECRET"}

    def rank_worker(rank, caches):
        v = views(caches)
        layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
        geom = dataclasses.replace(geometry(), tp_size=2, tp_rank=rank)
        return build_worker(config(tmp_path, **kw), geom, caches=v, layout=layout, rank=rank)

    src = make_caches(0)
    w1 = rank_worker(1, src)
    run_step(w1, StepPlan(1, stores=[StoreChunk("r", bytes([1]) * 32, 0, (0, 1), ticket=1)]))
    w1.flush()
    assert w1.take_report().stored == [1]
    ns1 = w1.store.namespaces[0]
    w1.close()
    dst = make_caches(1)
    w0 = rank_worker(0, dst)
    ns0 = w0.store.namespaces[0]
    w0.close()
    assert ns0 != ns1
    for name in os.listdir(ns1):  # rank 1's files over rank 0's (the manifest names its own namespace: kept)
        if name.startswith("slab-") or name == "journal.bin":
            shutil.copyfile(os.path.join(ns1, name), os.path.join(ns0, name))
    before = [c.clone() for c in dst]
    w0 = rank_worker(0, dst)
    run_step(w0, StepPlan(2, loads=[LoadChunk("q", bytes([1]) * 32, 0, (8, 9))]))
    assert w0.take_failed_blocks() == {8, 9}
    assert all(torch.equal(d[[8, 9]], b[[8, 9]]) for d, b in zip(dst, before))
    w0.close()
    w1 = rank_worker(1, dst)
    run_step(w1, StepPlan(3, loads=[LoadChunk("q", bytes([1]) * 32, 0, (8, 9))]))
    assert w1.take_failed_blocks() == set()
    assert all(torch.equal(d[[8, 9]], s[[0, 1]]) for d, s in zip(dst, src))
    w1.close()


def test_start_up_probes_the_read_rate_of_stored_chunks(tmp_path):
    """A fresh worker over stored chunks reads some of them at start-up (file path) and reports
    the bytes and seconds, so a planner's hit policy starts with a measured read rate; a mapped
    root copies its stored slots from the mapping instead of reading (no read request); an empty
    store measures nothing, and nothing in the caches changes."""
    from tutti.engine.sched.hit_policy import RateMeter

    w = worker(tmp_path / "empty", make_caches(0), mapped_loads=False)
    w.warm_up()
    assert w.probe == (0, 0.0) and w.take_report().probe_bytes == 0
    w.close()
    store_chunks(tmp_path, make_caches(0), [(3, [0, 1]), (7, [4, 5]), (8, [10, 11])])
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst, mapped_loads=False)
    w.queue = RecordingQueue(w.queue)
    w.warm_up()
    seg = geometry().segment_bytes
    assert w.probe[0] == 3 * L * seg and w.probe[1] > 0 and w.queue.reads == 3 * L
    rep = w.take_report()
    assert rep.probe_bytes == 3 * L * seg and rep.bytes_loaded == 0 and not rep.is_empty()
    assert all(torch.equal(a, b) for a, b in zip(dst, before))
    m = RateMeter()
    m.on_loads(rep.probe_bytes, rep.probe_seconds)
    assert m.load_rate == pytest.approx(rep.probe_bytes / rep.probe_seconds)
    w.close()
    mapped_dst = make_caches(1)
    before = [c.clone() for c in mapped_dst]
    w = worker(tmp_path, mapped_dst, mapped_loads=True)
    w.queue = RecordingQueue(w.queue)
    w.warm_up()
    assert w.probe[0] == 3 * L * seg and w.probe[1] > 0 and w.queue.reads == 0  # copied, not read
    assert all(torch.equal(a, b) for a, b in zip(mapped_dst, before))
    w.close()
    w = worker(tmp_path, make_caches(1), mapped_loads=False)
    assert w.probe_read_rate(max_bytes=seg)[0] == 3 * seg  # one layer of the group, then it stops
    w.close()


def test_the_write_window_is_on_for_a_drive_and_off_for_a_ram_root(tmp_path):
    from tutti.store.rammap import RAM_FILESYSTEMS, fs_type

    if fs_type(str(tmp_path)) in RAM_FILESYSTEMS or not os.path.isdir("/dev/shm") \
            or fs_type("/dev/shm") not in RAM_FILESYSTEMS:
        pytest.skip("needs a disk tmp_path and a tmpfs /dev/shm")
    w = worker(tmp_path / "disk", make_caches(0))
    try:
        assert w.ctx.cfg.write_window_bytes == 64 << 20
    finally:
        w.close()
    shm = f"/dev/shm/tutti-window-test-{os.getpid()}"
    try:
        w = worker(shm, make_caches(0))
        try:
            assert w.ctx.cfg.write_window_bytes is None
        finally:
            w.close()
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_whole_load_keeps_later_layers_reads_in_flight(tmp_path):
    """A load awaited whole (an asynchronous load, a FULL-graph step) that goes layer by layer (a
    load ring smaller than a chunk; hybrid models) submits reads past the layer being processed
    while load slots are free; pumping only that layer drained the read queue at every layer
    boundary (it halved the disk's read rate of small hits)."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1])])
    dst = make_caches(1)
    # two load slots of 4 KiB: no whole chunk (3 layers x 4 KiB) fits, so the per-layer path loads
    w = worker(tmp_path, dst, mapped_loads=False, staging_bytes=8 * 4096, staging_slots=8, max_inflight_stores=6)
    assert w.loads.ring.slot_bytes * len(w.loads.ring) < geometry().slot_bytes
    seen = []
    real = w.loads._process

    def process(item, *args):
        seen.append((item.layer, w.loads._next_submit))
        return real(item, *args)

    w.loads._process = process
    try:
        w.start_step(StepPlan(2, loads=[LoadChunk("q", bytes([0]) * 32, 0, (8, 9))]), layerwise=False)
        w.end_step()
        assert not w.take_failed_blocks()
    finally:
        w.close()
    assert seen[0][0] == 0 and seen[0][1] > 1  # layer 1's read was submitted before layer 0 was processed
    for layer in range(L):
        assert torch.equal(dst[layer][8:10], src[layer][0:2])


class SlowReadQueue(RecordingQueue):
    """A real queue whose reads land `delay` seconds after their submission (a slow disk)."""

    def __init__(self, inner, delay):
        super().__init__(inner)
        self.delay = delay

    def submit(self, requests):
        import threading

        from tutti.io.queue import IOFuture

        futs = self.inner.submit(requests)
        out = [IOFuture(r) for r in requests]

        def land():
            for f, o in zip(futs, out):
                o.set_result(f.result())

        threading.Timer(self.delay, land).start()
        return out


def test_a_layer_wise_loads_read_rate_is_measured_where_the_forward_stalled_on_reads(tmp_path):
    """The hit policy's read rate from a layer-wise load: its waits alone read a slow storage as
    faster than it is (the part that hid under compute counts as free), and the policy then
    loaded more than it could hide (on the H200's disk an 8k hit took 1.22x recompute). The
    sample is the bytes done when the forward last stalled on a read, over the time to then; a
    load that never stalled gives no rate."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(1, [0, 1]), (2, [2, 3])])
    loads = [LoadChunk("q", bytes([0]) * 32, 1, (8, 9)), LoadChunk("q", bytes([1]) * 32, 2, (10, 11))]
    per_load = 2 * L * geometry().segment_bytes
    w = worker(tmp_path, make_caches(1), lookahead=1)
    w.queue = SlowReadQueue(w.queue, 0.1)
    w.start_step(StepPlan(2, loads=loads))  # layers 0 and 1 read at once, layer 2 after layer 0
    for layer in range(L):
        w.wait_layer(layer)  # stalls 0.1 s at layer 0, not at 1, about 0.02 s at layer 2
        time.sleep(0.08)  # the layer's compute
        w.save_layer(layer)
    w.end_step()
    rep = w.take_report()
    assert rep.bytes_loaded == per_load and rep.rate_bytes == per_load  # the last layer's read was waited for
    # its reads ran until the last one landed: at least 0.1 + 0.08 + 0.1 s (the waits were 0.12)
    assert 0.27 <= rep.rate_seconds <= rep.load_seconds
    w.close()
    # reads all done before the forward asks for their layers: no rate sample
    w = worker(tmp_path, make_caches(1), lookahead=L)
    w.start_step(StepPlan(3, loads=loads))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(f.done() for it in w.loads._items for f in it.futures):
        time.sleep(0.01)
    for layer in range(L):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()
    rep = w.take_report()
    assert rep.bytes_loaded == per_load and (rep.rate_bytes, rep.rate_seconds) == (0, 0.0)
    assert w.take_failed_blocks() == set()
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


def test_reads_first_is_off_without_a_write_window(tmp_path):
    w = worker(tmp_path, make_caches(0), write_window_bytes="off")
    try:
        assert w.ctx.reads is None
    finally:
        w.close()


@pytest.mark.parametrize("setting, expected", [("off", 0.005), (0.0005, 0.0005), (0.05, 0.005)])
def test_the_worker_lowers_the_gil_switch_interval_never_raises_it(tmp_path, setting, expected):
    """A thread of tutti's that wakes to finish IO waits up to the switch interval for the GIL
    while vLLM's engine loop runs Python; given seconds, the worker lowers it at start-up, and
    never raises one the process chose itself."""
    import sys

    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        w = worker(tmp_path, make_caches(0), gil_switch_interval_s=setting)
        w.close()
        assert sys.getswitchinterval() == pytest.approx(expected)
    finally:
        sys.setswitchinterval(before)



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


def test_a_step_without_a_forward_waits_for_its_asynchronous_loads(tmp_path):
    """`idle_load_wait_s`: in a step vLLM scheduled no token for (its requests all wait), the
    worker sleeps until an asynchronous load lands (or the wait ends) before it reports, instead
    of handing control back to an engine loop that spins in Python; a step with a forward never
    waits."""
    import threading

    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1])])
    w = worker(tmp_path, make_caches(1), async_loads=True, idle_load_wait_s=0.05)
    gate = threading.Event()
    run = w.async_loads._run
    w.async_loads._run = lambda loads, after=None, entry=None: (gate.wait(30), run(loads, after, entry))[1]
    waits = []
    wait = w.async_loads.wait
    w.async_loads.wait = lambda timeout: (waits.append(timeout), wait(timeout))[1]
    run_step(w, StepPlan(1, async_step=2, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (14, 15))]))
    assert w.received_requests() == (set(), set(), set()) and waits == []  # a step with a forward: no wait
    run_step(w, StepPlan(3, idle=True))
    assert w.received_requests() == (set(), set(), set()) and waits == [0.05]  # waited, nothing landed
    assert w.received_requests() == (set(), set(), set()) and waits == [0.05]  # once a step
    gate.set()
    run_step(w, StepPlan(4, idle=True))
    got = w.received_requests()
    while got == (set(), set(), set()):  # a slow machine: the next idle steps wait again
        run_step(w, StepPlan(5, idle=True))
        got = w.received_requests()
    assert got == ({"a"}, set(), set()) and len(waits) >= 2
    w.close()


@pytest.mark.parametrize("launch, given, waits", [("step", "auto", 0.0), ("thread", "auto", 0.002),
                                                  ("step", 0.01, 0.01), ("thread", "off", 0.0)])
def test_the_idle_wait_auto_is_for_the_loading_thread_alone(tmp_path, launch, given, waits):
    """`idle_load_wait_s` "auto" (the default): a step without a forward waits 2 ms where tutti's
    loading thread loads (it needs the GIL the spinning loop would hold), and not at all where
    vLLM's own thread launches the loads (nothing waits for the GIL); a value given is kept."""
    store_chunks(tmp_path, make_caches(0), [(0, [0, 1])])
    w = worker(tmp_path, make_caches(1), mapped_loads=True, async_loads=True, async_launch=launch,
               idle_load_wait_s=given)
    try:
        assert (w.async_loads.inline is not None) == (launch == "step")
        assert w.idle_wait_s == waits
    finally:
        w.close()


def test_async_loads_wait_wakes_when_a_job_lands_and_returns_when_none_is_pending(tmp_path):
    import threading
    import time as _time

    store_chunks(tmp_path, make_caches(0), [(0, [0, 1])])
    w = worker(tmp_path, make_caches(1), async_loads=True)
    a = w.async_loads
    t0 = _time.monotonic()
    a.wait(30)  # nothing pending: at once
    gate = threading.Event()
    run = a._run
    a._run = lambda loads, after=None, entry=None: (gate.wait(30), run(loads, after, entry))[1]
    a.submit(7, [LoadChunk("a", bytes([0]) * 32, 0, (14, 15))])
    threading.Timer(0.05, gate.set).start()
    a.wait(30)  # returns when the job lands, not after 30 s
    assert _time.monotonic() - t0 < 20 and a.take()[0] == {"a"}
    w.close()


def test_an_asynchronous_load_that_raises_fails_its_chunks_for_good(tmp_path):
    """A job that raises outside the per-chunk checks (a bug, an unexpected error) fails its
    requests with every block they would have written, and its chunks are reported failed, so
    the planner stops offering them: vLLM recomputes once instead of getting the same hit, failing
    and asking again forever (a GPU run hung that way when a probe's stand-in load raised)."""
    store_chunks(tmp_path, make_caches(0), [(0, [0, 1]), (1, [2, 3])])
    w = worker(tmp_path, make_caches(1), async_loads=True)

    def boom(loads, after=None, entry=None):
        raise RuntimeError("injected")

    w.async_loads._run = boom
    loads = [LoadChunk("a", bytes([0]) * 32, 0, (14, 15)), LoadChunk("a", bytes([1]) * 32, 1, (16, 17), skip_blocks=1)]
    run_step(w, StepPlan(2, async_step=3, async_loads=loads))
    w.flush()
    assert w.received_requests() == (set(), {"a"}, {14, 15, 17})
    rep = w.take_report()
    assert 3 in rep.steps_done and sorted(rep.load_failed) == sorted(ld.key for ld in loads)
    del w.async_loads._run  # the next job runs as ever: no failure state carried over
    run_step(w, StepPlan(4, async_step=5, async_loads=[LoadChunk("b", bytes([0]) * 32, 0, (20, 21))]))
    w.flush()
    assert w.received_requests() == ({"b"}, set(), set())
    assert w.take_report().load_failed == []
    w.close()


@pytest.mark.parametrize("where", ["start", "layer"])
@pytest.mark.parametrize("mapped", [False, True], ids=["file", "mapped"])
def test_a_layer_wise_load_that_raises_fails_its_chunks_never_the_step(tmp_path, mapped, where):
    """An error that escapes the per-chunk checks (a bug, an unexpected one) when the step's loads
    start or while a layer is awaited fails every chunk of the step (counted, so the planner stops
    offering them; their blocks reported for vLLM to recompute) and never reaches the forward pass;
    the staging slots its reads held come back, so the next step loads as ever."""
    src = make_caches(0)
    store_chunks(tmp_path, src, [(0, [0, 1]), (1, [2, 3])])
    dst = make_caches(1)
    w = worker(tmp_path, dst, mapped_loads=mapped)
    lp = w.loads
    name = "start" if where == "start" else "wait_layer"
    orig = getattr(lp, name)
    calls = []

    def boom(*args, **kw):
        calls.append(1)
        if where == "start":
            orig(*args, **kw)  # reads (or copies) are in flight when it raises
        elif len(calls) < 2:
            return orig(*args, **kw)  # layer 0 loads, layer 1 raises
        raise RuntimeError("injected")

    setattr(lp, name, boom)
    loads = [LoadChunk("a", bytes([0]) * 32, 0, (14, 15)), LoadChunk("a", bytes([1]) * 32, 1, (16, 17))]
    run_step(w, StepPlan(2, loads=loads))  # raises nothing
    assert calls
    assert w.take_failed_blocks() == {14, 15, 16, 17}
    rep = w.take_report()
    assert sorted(rep.load_failed) == sorted(ld.key for ld in loads) and 2 in rep.steps_done
    del lp.__dict__[name]
    w.flush()
    for step in (3, 4):  # every slot came back: two more steps of the whole ring's worth load
        run_step(w, StepPlan(step, loads=[LoadChunk("b", bytes([0]) * 32, 0, (20, 21))]))
        assert w.take_failed_blocks() == set()
    for s, d in zip(src, dst):
        assert torch.equal(d[[20, 21]], s[[0, 1]])
    w.close()


def test_a_step_thread_job_that_raises_fails_its_request_and_keeps_its_verdict_buffer(tmp_path):
    """A job launched from the step's thread that raises (a bug) fails its request with every block
    it would have written, gives its verdict buffer back, and the next job runs as ever."""
    store_chunks(tmp_path, make_caches(0), [(0, [0, 1])])
    w = worker(tmp_path, make_caches(1), mapped_loads=True, async_loads=True, async_launch="step")
    w.warm_up()
    inline = w.async_loads.inline
    free = len(inline._pool_free)
    finish = inline.finish

    def boom(*, detached=False):
        finish(detached=detached)
        raise RuntimeError("injected")

    inline.finish = boom
    run_step(w, StepPlan(2, async_step=3, async_loads=[LoadChunk("a", bytes([0]) * 32, 0, (14, 15))]))
    w.flush()
    assert w.received_requests() == (set(), {"a"}, {14, 15})
    assert len(inline._pool_free) == free
    del inline.finish
    run_step(w, StepPlan(4, async_step=5, async_loads=[LoadChunk("b", bytes([0]) * 32, 0, (20, 21))]))
    w.flush()
    assert w.received_requests() == ({"b"}, set(), set())
    w.close()


# ---------------------------------------------------------------- whole loads, chunk-major (file path)
WHOLE = 11  # chunks of a whole load: the default load ring holds 10 (two halves of 5), so 3 groups


def _whole_loads(n=WHOLE, skip_last=False):
    return [LoadChunk("q", bytes([i]) * 32, i, (2 * i, 2 * i + 1), skip_blocks=1 if skip_last and i == n - 1 else 0)
            for i in range(n)]


def _run_whole(w, step, loads, how):
    """A whole load: a FULL-graph step's (start_step with layerwise=False) or an asynchronous one
    (tutti's loading thread): both go through LoadPipeline.start(layerwise=False)."""
    if how == "full_graph":
        w.start_step(StepPlan(step, loads=loads), layerwise=False)
        w.end_step()
        return w.take_failed_blocks()
    run_step(w, StepPlan(step, async_step=step + 100, async_loads=loads))
    w.flush()
    deadline = time.monotonic() + 30
    done, failed, blocks = set(), set(), set()
    while not (done | failed) and time.monotonic() < deadline:
        w.async_loads.wait(0.05)
        done, failed, blocks = w.received_requests()
    assert done | failed == {"q"}
    return blocks


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
    """Chunks of 4 blocks (this module's default has 2): a load may then skip one and keep three."""
    monkeypatch.setitem(globals(), "T", 4 * N)  # geometry() and config() read it at each call
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
