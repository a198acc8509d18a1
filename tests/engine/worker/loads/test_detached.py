"""Detached loads (tutti/engine/worker/loads/detached.py): a mapped root's asynchronous jobs launched
from the step's thread, each reported with its own failures, and when they run on the loading
thread instead."""

import os

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan

from worker_helpers import DEV, make_caches, geometry, worker, run_step, store_chunks, damage

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


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
