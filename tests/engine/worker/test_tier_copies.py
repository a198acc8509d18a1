"""The worker's tiers (tutti.engine.worker.tiers): a chunk copied from tier 0 to tier 1 off the
forward thread, its bytes and checksums carried whole; a load served from tier 1 gives the bytes
stored, through tier 1's own IO queue where its backend differs; a copy whose source is gone
fails alone; a lower tier held by another server is refused with the fix."""

import pytest
import torch

from tutti.engine.plan import CopyChunk, LoadChunk, StepPlan, StoreChunk
from tutti.store.chunk_store import StoreLockedError

from worker_helpers import block_bytes, config, geometry, make_caches, run_step, views  # noqa: F401

pytestmark = pytest.mark.usefixtures("device")


def tiered(tmp_path, caches, writer_id="", disk=None, first=None, top=None, **lower):
    cfg = config(tmp_path / "ram", writer_id=writer_id, **(top or {}))
    cap = cfg.pop("capacity_bytes")
    del cfg["root"]
    cfg["tiers"] = [{"root": str(tmp_path / "ram"), "capacity_bytes": cap, **(first or {})},
                    {"root": str(disk or tmp_path / "disk"), "capacity_bytes": 4 * cap, **lower}]
    from tutti.engine.build import build_worker
    from tutti.kernels import PagedLayout

    v = views(caches)
    return build_worker(cfg, geometry(), caches=v, layout=PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim")))


def step(w, plan):
    """One step of `plan`, its stores and copies done: the worker's report."""
    run_step(w, plan)
    w.flush()
    return w.take_report()


@pytest.mark.parametrize("medium", ["file", "tests.store.memory_medium:MemoryMedium"])
def test_a_chunk_copied_down_loads_back_from_the_lower_tier_bit_exact(tmp_path, medium):
    """Each tier with its own medium: the lower one on slab files, or in memory (the medium seam's example)."""
    caches = make_caches(1)
    w = tiered(tmp_path, caches, medium=medium)
    key = b"k" * 32
    want = block_bytes(caches, [2, 3])
    assert step(w, StepPlan(1, stores=[StoreChunk("r", key, 5, (2, 3), ticket=1)])).stored == [1]
    rep = step(w, StepPlan(2, copies=[CopyChunk(key, 0, 5, 1, 9, ticket=2)]))
    assert rep.stored == [2] and not rep.store_failed
    lower, journal = w.ctx.lower[0]
    assert type(lower.slabs.medium).__name__ == ("FileMedium" if medium == "file" else "MemoryMedium")
    assert lower.get(9).key == key and journal.checksums(9, key) == w.journal.checksums(5, key)
    for c in caches:
        c[[10, 11]] = 0
    rep = step(w, StepPlan(3, loads=[LoadChunk("q", key, 9, (10, 11), tier=1)]))
    assert not rep.load_failed and rep.steps_done
    got = block_bytes(caches, [10, 11])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    w.close()


def test_each_tier_reads_and_writes_through_its_own_io_backend(tmp_path):
    """tiers[0] on io_uring, tiers[1] on the thread pool with its own options: two queues, each
    slab routed to its tier's (tutti.io.routed); the store goes to tier 0's queue, the load from
    tier 1 to tier 1's, bit exact, and the start-up decisions name each tier's backend."""
    from tutti.io.routed import RoutedQueue

    caches = make_caches(5)
    w = tiered(tmp_path, caches, first={"io_backend": "uring"}, io_backend="threads", io_options={"workers": 2})
    try:
        q = w.queue
        assert isinstance(q, RoutedQueue) and [x.name for x in q.queues] == ["uring", "threads"]
        assert w.decisions.made["io_backend"].value == "uring"
        assert w.decisions.made["tiers[1].io_backend"].value == "threads"
        seen = [[], []]
        for i, inner in enumerate(q.queues):  # count what each real queue is handed
            def counted(reqs, inner_submit=inner.submit, i=i):
                got = inner_submit(reqs)
                seen[i].extend(r.op for r in reqs[:len(got)])
                return got
            inner.submit = counted
        key = b"m" * 32
        want = block_bytes(caches, [2, 3])
        assert step(w, StepPlan(1, stores=[StoreChunk("r", key, 5, (2, 3), ticket=1)])).stored == [1]
        assert seen[0] and set(seen[0]) == {"write"} and not seen[1]
        assert step(w, StepPlan(2, copies=[CopyChunk(key, 0, 5, 1, 9, ticket=2)])).stored == [2]
        for c in caches:
            c[[10, 11]] = 0
        n0 = len(seen[0])
        rep = step(w, StepPlan(3, loads=[LoadChunk("q", key, 9, (10, 11), tier=1)]))
        assert not rep.load_failed and len(seen[0]) == n0 and set(seen[1]) == {"read"}
        assert all(torch.equal(a, b) for a, b in zip(block_bytes(caches, [10, 11]), want))
    finally:
        w.close()


def test_a_promotion_reads_the_drive_only_after_the_hits_reads_in_flight(tmp_path, monkeypatch):
    """A promotion's source is on the drive the hits read: while a hit's read is in flight its
    reads wait (ReadsFirst), and once that read lands the copy goes ahead, bytes and checksums
    whole. An ordering, not a speed: the wait's cap is raised far past the test's pauses."""
    import mmap
    import os
    import time

    from tutti.engine.worker import tiers as tiers_mod
    from tutti.io.queue import READ, IOFuture, IORequest

    monkeypatch.setattr(tiers_mod, "MAX_YIELD_S", 30.0)
    caches = make_caches(6)
    w = tiered(tmp_path, caches)
    try:
        key = b"p" * 32
        assert step(w, StepPlan(1, stores=[StoreChunk("r", key, 5, (2, 3), ticket=1)])).stored == [1]
        assert step(w, StepPlan(2, copies=[CopyChunk(key, 0, 5, 1, 9, ticket=2)])).stored == [2]
        hit_read = IOFuture(IORequest(0, 0, torch.empty(4096, dtype=torch.uint8), 0, 4096, READ))
        w.copier.reads.track([hit_read])  # a hit's read in flight on the drive
        w.copier.submit([CopyChunk(key, 1, 9, 0, 7, ticket=3)])  # promote it back into tier 0, slot 7
        time.sleep(0.3)
        assert w.copier.copied[0] == 0 and w.copier.pending  # still waiting for the hit's read
        lower = w.ctx.lower[0][0]
        marker = bytes(range(256)) * 16
        page = mmap.mmap(-1, len(marker))  # page-aligned, as the slab files' O_DIRECT takes
        page[:] = marker
        with lower.held(9) as (fd, off):  # the source changes now: a copy that read it already has the old bytes
            os.pwritev(fd, [page], off)
        hit_read.set_result(4096)
        assert w.copier.flush(10)
        assert w.copier.copied[0] == 1 and w.journal.checksums(7, key) == w.ctx.lower[0][1].checksums(9, key)
        with w.store.held(7) as (fd, off):
            os.preadv(fd, [page], off)
        assert page[:] == marker  # read after the hit's read landed, not before
    finally:
        w.close()


def test_a_promotion_goes_ahead_of_the_write_downs_waiting(tmp_path, monkeypatch):
    """A staged hit's request waits for its promotion (promote "stage"): the copier takes it before
    every write-down not started yet, whichever step queued them; each copy still lands whole."""
    import threading

    caches = make_caches(8)
    w = tiered(tmp_path, caches)
    try:
        keys = [bytes([65 + i]) * 32 for i in range(4)]
        stores = [StoreChunk("r", k, i, (2 * i, 2 * i + 1), ticket=i + 1) for i, k in enumerate(keys)]
        assert step(w, StepPlan(1, stores=stores)).stored == [1, 2, 3, 4]
        assert step(w, StepPlan(2, copies=[CopyChunk(keys[0], 0, 0, 1, 10, ticket=5)])).stored == [5]
        order, gate, real = [], threading.Event(), w.copier._copy

        def gated(c):
            order.append((c.src, c.dst))
            if len(order) == 1:
                gate.wait(10)  # the copier is busy with a write-down while the next step queues more
            real(c)

        monkeypatch.setattr(w.copier, "_copy", gated)
        w.copier.submit([CopyChunk(keys[1], 0, 1, 1, 11, ticket=6), CopyChunk(keys[2], 0, 2, 1, 12, ticket=7)])
        for _ in range(1000):
            if order:
                break
            threading.Event().wait(0.01)
        w.copier.submit([CopyChunk(keys[3], 0, 3, 1, 13, ticket=8), CopyChunk(keys[0], 1, 10, 0, 20, ticket=9)])
        gate.set()
        assert w.copier.flush(10)
        assert order == [(0, 1), (1, 0), (0, 1), (0, 1)]
        assert sorted(w.take_report().stored) == [6, 7, 8, 9]
        assert w.journal.checksums(20, keys[0]) == w.ctx.lower[0][1].checksums(10, keys[0])
    finally:
        w.close()


@pytest.mark.parametrize("promote", ["stage", "hits"])
def test_with_stage_a_copy_up_reports_its_read_as_the_lower_tiers_rate(tmp_path, promote):
    """promote "stage": hits read the drive through copies up, so those reads measure the rate the
    planner prices lower-tier hits by; otherwise the loads alone measure it, as before."""
    caches = make_caches(2)
    w = tiered(tmp_path, caches, top={"promote": promote})
    try:
        key = b"s" * 32
        assert step(w, StepPlan(1, stores=[StoreChunk("r", key, 5, (2, 3), ticket=1)])).stored == [1]
        assert step(w, StepPlan(2, copies=[CopyChunk(key, 0, 5, 1, 9, ticket=2)])).stored == [2]
        w.take_report()
        rep = step(w, StepPlan(3, copies=[CopyChunk(key, 1, 9, 0, 7, ticket=3)]))
        assert rep.stored == [3]
        if promote == "stage":
            assert rep.lower_rate_bytes == w.copier.slot_bytes and rep.lower_rate_seconds > 0
        else:
            assert rep.lower_rate_bytes == 0 and rep.lower_rate_seconds == 0
    finally:
        w.close()


def test_a_copy_whose_source_is_gone_fails_alone(tmp_path):
    caches = make_caches(2)
    w = tiered(tmp_path, caches)
    step(w, StepPlan(1, stores=[StoreChunk("r", b"a" * 32, 0, (2, 3), ticket=1)]))
    rep = step(w, StepPlan(2, copies=[CopyChunk(b"b" * 32, 0, 0, 1, 0, ticket=7),  # not what slot 0 holds
                                    CopyChunk(b"a" * 32, 0, 0, 1, 1, ticket=8)]))
    assert rep.store_failed == [7] and rep.stored == [8] and w.copier.failed == 1
    w.close()


def test_a_lower_tier_another_server_writes_as_this_writer_is_refused_with_the_fix(tmp_path):
    caches = make_caches(3)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = tiered(tmp_path / "a", caches, writer_id="n1", disk=tmp_path / "disk")
    # the second server: its own RAM tier, the first one's disk tier, the same writer id
    with pytest.raises(StoreLockedError, match=r"tiers\[1\] roots .*writer 'n1' is held there.*own \"writer_id\""):
        tiered(tmp_path / "b", caches, writer_id="n1", disk=tmp_path / "disk")
    tiered(tmp_path / "b", caches, writer_id="n2", disk=tmp_path / "disk").close()  # its own id: fine
    first.close()


def test_a_restarted_worker_probes_its_lower_tier_and_reports_the_rate(tmp_path):
    caches = make_caches(4)
    w = tiered(tmp_path, caches)
    step(w, StepPlan(1, stores=[StoreChunk("r", b"p" * 32, 0, (2, 3), ticket=1)]))
    step(w, StepPlan(2, copies=[CopyChunk(b"p" * 32, 0, 0, 1, 3, ticket=2)]))
    w.close()
    again = tiered(tmp_path, caches)
    again.warm_up()
    (nbytes, seconds), = again.lower_probes
    rep = again.take_report()
    assert nbytes > 0 and rep.lower_rate_bytes == nbytes and rep.lower_rate_seconds == seconds > 0
    again.close()


def test_a_lower_tier_smaller_than_a_chunk_is_refused_by_name_before_any_file(tmp_path):
    from tutti.engine.config.values import ConfigError

    with pytest.raises(ConfigError, match=r"tiers\[1\]\.capacity_bytes=100: smaller than one chunk"):
        tiered(tmp_path, make_caches(5), capacity_bytes=100)
    assert list(tmp_path.iterdir()) == []  # neither tier's root was touched
