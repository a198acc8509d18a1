"""The worker facade (tutti/engine/worker/pipeline.py) on CPU tensors with real files, a real IO queue
and real kernels: a step's round trip, start-up (warm-up, probes, refusals), the decisions it
takes (write window, reads first, GIL switch interval, idle waits) and what it reports."""

import os
import shutil

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk
from tutti.engine.build import build_worker
from tutti.kernels import PagedLayout

from worker_helpers import (
    L, B, DEV, make_caches, views, geometry, config, worker, run_step, store_chunks, RecordingQueue,
)

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


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
    # an empty mapped RAM root copies scratch host memory as its loads copy: RAM's rate is known
    # before anything is stored, and nothing in the caches changes
    dst = make_caches(0)
    before = [c.clone() for c in dst]
    w = worker(tmp_path / "empty_mapped", dst, mapped_loads=True)
    assert w.loads.maps
    w.warm_up()
    assert w.probe[0] >= w.store.slot_bytes and w.probe[1] > 0 and w.take_report().probe_bytes == w.probe[0]
    assert all(torch.equal(a, b) for a, b in zip(dst, before))
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
