"""Asynchronous loads (tutti/engine/worker/async_loads.py) on tutti's loading thread: bit exact, failed
block by block, their timeline, waits and a job that raises."""

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan

from worker_helpers import L, DEV, make_caches, geometry, worker, run_step, store_chunks

pytestmark = pytest.mark.usefixtures("device")  # every test on each device (conftest.py)


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
