"""Host-cost counters: a busy tutti thread's CPU is counted, an idle one's is not, hook time adds up."""
from __future__ import annotations

import threading
import time

import pytest

from tutti.engine.hostcost import HookClock, ThreadCPU, scheduler_threads, timed, worker_threads


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clocks")
def test_thread_cpu_counts_busy_tutti_threads_only():
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop,), name="tutti-writer-hosttest")
    idle = threading.Thread(target=stop.wait, name="tutti-async-loads-hosttest")
    other = threading.Thread(target=_spin, args=(stop,), name="not-tutti")
    # only this test's threads (other tests' tutti threads may still be alive in this process)
    clock = ThreadCPU(lambda n: worker_threads(n) and n.endswith("-hosttest"))
    follow_clock = ThreadCPU(lambda n: scheduler_threads(n) and n.endswith("-hosttest"))
    for t in (busy, idle, other):
        t.start()
    try:
        clock.take(), follow_clock.take()
        time.sleep(0.4)
        spent = clock.take()
        assert follow_clock.take() == 0.0  # no follower thread: the scheduler counts nothing
        # the busy thread shares the GIL with `other`: it gets some of 0.4 s, and never more
        assert 0.02 < spent < 0.45, spent
        assert clock.take() < spent  # deltas, not totals
    finally:
        stop.set()
        for t in (busy, idle, other):
            t.join()
    assert clock.take() == 0.0  # ended threads add nothing more


def test_timed_hooks_add_their_wall_time():
    class Hooks:
        def __init__(self):
            self.clock = HookClock()

        @timed("clock")
        def hook(self, s):
            """doc kept"""
            time.sleep(s)
            return s

        @timed("clock")
        def fails(self):
            time.sleep(0.01)
            raise RuntimeError("x")

    h = Hooks()
    assert h.hook(0.02) == 0.02 and h.hook.__doc__ == "doc kept" and h.hook.__name__ == "hook"
    with pytest.raises(RuntimeError):
        h.fails()
    got = h.clock.take()
    assert 0.03 <= got < 0.5
    assert h.clock.take() == 0.0


def test_gil_free_waits_count_on_tutti_threads_only():
    from tutti.engine.hostcost import WAITS, gil_free_wait

    WAITS.take()
    with gil_free_wait():  # the test's own thread: the hooks time it, not WAITS
        time.sleep(0.02)
    assert WAITS.take() == 0.0

    def waits():
        with gil_free_wait():
            time.sleep(0.05)

    t = threading.Thread(target=waits, name="tutti-writer-hosttest")
    t.start()
    t.join()
    assert 0.05 <= WAITS.take() < 0.5


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread CPU clocks")
def test_thread_cpu_is_read_at_most_every_interval_and_loses_nothing():
    stop = threading.Event()
    busy = threading.Thread(target=_spin, args=(stop,), name="tutti-writer-interval")
    clock = ThreadCPU(lambda n: n.endswith("-interval"), interval_s=10.0)
    busy.start()
    try:
        assert clock.take(now=100.0) >= 0.0  # the first reading
        time.sleep(0.2)
        assert clock.take(now=105.0) == 0.0  # within the interval: not read (no thread walk)
        later = clock.take(now=110.5)
        assert later > 0.02  # the busy time of both periods arrives with the next reading
    finally:
        stop.set()
        busy.join()
