"""The layer-wise load pipeline (tutti/engine/worker/loads/pipeline.py): lookahead, its trace, loads
the forward did not wait for, whole steps, a full IO queue and the read rate it measures."""

import time

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan
from tutti.io.queue import WrappedQueue

from worker_helpers import (
    L, DEV, make_caches, geometry, worker, run_step, store_chunks, RecordingQueue, _wrapped_worker,
)

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


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
