"""Host costs: how much CPU tutti's own work takes beside the forward pass, measured.

Why: under vLLM's asynchronous scheduling the host prepares step t+1 while the GPU runs step t,
so tutti's host work is free only while the host keeps ahead of the GPU. Two costs can take that
margin away: time inside tutti's hooks on the thread that launches the forward pass, and tutti's
own threads (writer, loads, IO completions, the journal follower) holding the GIL that thread
needs. Both are counted here, cheaply enough to stay on while serving (one `perf_counter` pair
per hook, one thread-clock read per tutti thread every quarter second), and exported as Prometheus counters
(docs/metrics.md), so a TPOT gap can be traced to host time or ruled out.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from typing import Callable, Iterator


HOST_COST_INTERVAL_S = 0.25  # how often host costs are read and sent: cumulative, so nothing is lost


class HookClock:
    """Seconds spent inside hooks on the calling thread, summed until taken."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds = 0.0

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def timed(clock_attr: str) -> Callable:
    """Decorate a method so its wall time is added to `getattr(self, clock_attr)` (a HookClock)."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                getattr(self, clock_attr).seconds += time.perf_counter() - t0

        return wrapper

    return deco


class ThreadCPU:
    """CPU seconds used by this process's tutti threads whose names `select` accepts, as deltas.

    Each thread's own CPU clock (Linux `pthread_getcpuclockid`); a thread that ended since the
    last reading keeps what it had been counted. Where the platform has no thread clocks the
    delta is always 0. Read at most every `interval_s` (0 between readings): vLLM asks every
    step, and walking every thread of the process each step cost about 70 us of the step's own
    thread; the counter is cumulative, so a delta only arrives a little later."""

    def __init__(self, select: Callable[[str], bool], interval_s: float = HOST_COST_INTERVAL_S) -> None:
        self.select = select
        self.interval_s = interval_s
        self._last: dict[int, float] = {}
        self._ok = hasattr(time, "pthread_getcpuclockid")
        self._read_at = float("-inf")

    def take(self, now: float | None = None) -> float:
        if not self._ok:
            return 0.0
        now = time.monotonic() if now is None else now
        if now - self._read_at < self.interval_s:
            return 0.0
        self._read_at = now
        total, seen = 0.0, {}
        for t in threading.enumerate():
            ident = t.ident
            if ident is None or not t.name.startswith("tutti-") or not self.select(t.name):
                continue
            try:
                clock = time.clock_gettime(time.pthread_getcpuclockid(ident))
            except (OSError, OverflowError, ValueError):  # ended meanwhile
                continue
            seen[ident] = clock
            total += max(0.0, clock - self._last.get(ident, 0.0))
        self._last = seen
        return total


def worker_threads(name: str) -> bool:
    """A worker's threads: writer, asynchronous loads, IO (the follower is the scheduler's)."""
    return not name.startswith("tutti-follow")


def scheduler_threads(name: str) -> bool:
    return name.startswith("tutti-follow")


class _Waits:
    """Wall seconds tutti's threads spent in waits that release the GIL (CUDA event and stream
    synchronisation, which spin on the CPU): subtracted from their CPU time, what is left is the
    CPU they spent holding the GIL or in system calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self._seconds += seconds

    def take(self) -> float:
        with self._lock:
            out, self._seconds = self._seconds, 0.0
        return out


WAITS = _Waits()


@contextlib.contextmanager
def gil_free_wait() -> Iterator[None]:
    """Around a wait that releases the GIL; counted in WAITS when it runs on a tutti thread (the
    step's own thread is timed by its hooks instead)."""
    if not threading.current_thread().name.startswith("tutti-"):
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        WAITS.add(time.perf_counter() - t0)


def shorten_switch_interval(seconds: float | None) -> float:
    """Lower the interpreter's GIL switch interval to `seconds` (None: leave it; never raise it);
    returns the interval in force. Process-wide by nature: every thread's wait for the GIL held
    by a thread running Python is bounded by it, tutti's IO completions and the step's thread's
    alike."""
    if seconds is not None and seconds < sys.getswitchinterval():
        sys.setswitchinterval(seconds)
    return sys.getswitchinterval()
