"""The one queue contract every IO backend implements (io_uring, threads, libnvm).

A backend takes batches of requests, accepts as many as it can take right now (partial
acceptance, as Tutti's StorageRuntime does) and hands back one future per accepted request.
The engine never knows which backend it talks to.
"""

from __future__ import annotations

import abc
import collections
import errno as _errno
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from tutti.plugins import Registry

READ = "read"
WRITE = "write"

#: Direct IO alignment every backend demands of buffer address, buffer offset, file offset and length.
ALIGN = 4096


class IOErrorWithRequest(OSError):
    """An IO failure that carries the errno and the request that failed."""

    def __init__(self, err: int, request: "IORequest", detail: str = "") -> None:
        msg = f"{request.op} of {request.length} B at offset {request.offset} of fd {request.fd} failed"
        if detail:
            msg += f": {detail}"
        super().__init__(err, f"{msg} ({os.strerror(err) if err > 0 else 'error'})")
        self.request = request


@dataclass(frozen=True, eq=False)
class IORequest:
    """One read or write of `length` bytes between `buf[buf_offset:]` and `fd` at `offset`."""

    fd: int
    offset: int
    buf: torch.Tensor
    buf_offset: int
    length: int
    op: str = READ
    tag: object = None  # caller's cookie, handed back untouched

    def buffer_address(self) -> int:
        return self.buf.data_ptr() + self.buf_offset


def check_request(req: IORequest, align: int = ALIGN, max_io: int | None = None) -> None:
    """Raise ValueError naming the field, value and fix, before any IO is issued."""
    if req.op not in (READ, WRITE):
        raise ValueError(f"IORequest.op={req.op!r}: expected 'read' or 'write'")
    if not isinstance(req.buf, torch.Tensor) or req.buf.dtype != torch.uint8 or req.buf.device.type != "cpu":
        raise ValueError(
            f"IORequest.buf: expected a CPU torch.uint8 tensor, got "
            f"{getattr(req.buf, 'dtype', type(req.buf))} on {getattr(req.buf, 'device', '?')}; "
            "allocate it with tutti.io.buffers.aligned_buffer"
        )
    if not req.buf.is_contiguous():
        raise ValueError("IORequest.buf: expected a contiguous tensor")
    nbytes = req.buf.numel()
    if req.length <= 0:
        raise ValueError(f"IORequest.length={req.length}: expected a positive byte count")
    if req.buf_offset < 0 or req.buf_offset + req.length > nbytes:
        raise ValueError(
            f"IORequest.buf_offset={req.buf_offset}, length={req.length}: the range runs past "
            f"the buffer's {nbytes} bytes"
        )
    if req.offset < 0:
        raise ValueError(f"IORequest.offset={req.offset}: expected a non-negative file offset")
    if align > 1:
        for name, value in (
            ("offset", req.offset),
            ("buf_offset", req.buf_offset),
            ("length", req.length),
            ("buffer address", req.buffer_address()),
        ):
            if value % align:
                raise ValueError(
                    f"IORequest.{name}={value}: must be a multiple of {align} for direct IO; "
                    "pad segments to 4 KiB and use tutti.io.buffers.aligned_buffer"
                )
    if max_io is not None and req.length > max_io:
        raise ValueError(
            f"IORequest.length={req.length}: larger than this queue's largest single IO "
            f"({max_io} B, see caps().max_io_bytes); split the request"
        )


class IOFuture:
    """Completion of one request: `done()`, `result()` (bytes moved) or the IO error it raised."""

    __slots__ = ("request", "_event", "_result", "_error", "_callbacks", "_waiter")

    def __init__(self, request: IORequest, waiter: Callable[[float | None], None] | None = None) -> None:
        self.request = request
        self._event = threading.Event()
        self._result: int | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[["IOFuture"], None]] = []
        # Called to make progress while waiting (a polling backend reaps completions here).
        self._waiter = waiter

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block (the GIL released) until done or `timeout` passes; whether it is done. Makes no
        progress itself: for a thread other than the one reaping the queue (a writer waiting for
        the hits' reads), where `result()` would reap on a polling backend."""
        return self._event.wait(timeout)

    def result(self, timeout: float | None = None) -> int:
        if not self._event.is_set():
            if self._waiter is not None:
                self._waiter(timeout)
            if not self._event.wait(timeout):
                raise TimeoutError(f"IO {self.request.op} at offset {self.request.offset} not done after {timeout}s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed back, not swallowed
            return exc
        return None

    def add_done_callback(self, fn: Callable[["IOFuture"], None]) -> None:
        if self._event.is_set():
            fn(self)
        else:
            self._callbacks.append(fn)

    # -- backend side -------------------------------------------------------------------
    def set_result(self, nbytes: int) -> None:
        req = self.request
        if nbytes < 0:
            self._error = IOErrorWithRequest(-nbytes, req)
        elif nbytes != req.length:
            self._error = IOErrorWithRequest(
                _errno.EIO, req, f"short {req.op}: {nbytes} of {req.length} bytes"
            )
        else:
            self._result = nbytes
        self._finish()

    def set_exception(self, exc: BaseException) -> None:
        self._error = exc
        self._finish()

    def _finish(self) -> None:
        self._event.set()
        for fn in self._callbacks:
            fn(self)
        self._callbacks.clear()


@dataclass(frozen=True)
class QueueCaps:
    """The real limits of a queue, as the backend found them."""

    backend: str
    alignment: int  # required alignment of buffer, offsets and length (1 = none)
    max_io_bytes: int  # largest single request
    queue_depth: int  # entries one submit can take
    max_in_flight: int  # requests outstanding at once
    direct_io: bool  # whether files are opened with O_DIRECT
    extra: dict = field(default_factory=dict)


class IOQueue(abc.ABC):
    """Batched submit with partial acceptance; completions are futures."""

    name: str = "abstract"

    @abc.abstractmethod
    def caps(self) -> QueueCaps: ...

    @abc.abstractmethod
    def submit(self, requests: Sequence[IORequest]) -> list[IOFuture]:
        """Validate all requests (ValueError before any IO), then accept a prefix of them.

        Returns one future per accepted request, in order; `len(result) < len(requests)` means
        the queue is full and the caller resubmits the rest later (see `submit_all`).
        """

    def open_file(self, path: str | os.PathLike, write: bool = False, create: bool = False, *,
                  dir_fd: int | None = None) -> int:
        """Open a file the way this backend wants it (O_DIRECT where supported), relative to
        `dir_fd` when given, never through a symbolic link. Returns an fd."""
        from tutti.io.safefs import open_file

        flags = os.O_RDWR if write else os.O_RDONLY
        if create:
            flags |= os.O_CREAT
        return open_file(os.fspath(path), flags, dir_fd=dir_fd, check=False)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register staging buffers once (fixed buffers for io_uring). Optional."""

    def poll(self, timeout: float | None = 0.0) -> int:
        """Reap completions, waiting up to `timeout` seconds for at least one. Returns how many."""
        return 0

    def drain(self) -> None:
        """Wait until nothing is in flight."""

    def close(self) -> None:
        """Finish in-flight IO and release the queue."""

    def __enter__(self) -> "IOQueue":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WrappedQueue(IOQueue):
    """A queue that hands every call to `inner`: subclass it and override `submit` to watch,
    count, delay or fail requests (a trace of what a pipeline reads, a fault injected into a real
    backend) without writing a backend. The name is the inner queue's."""

    def __init__(self, inner: IOQueue) -> None:
        self.inner = inner
        self.name = inner.name

    def caps(self) -> QueueCaps:
        return self.inner.caps()

    def submit(self, requests: Sequence[IORequest]) -> list[IOFuture]:
        return self.inner.submit(requests)

    def open_file(self, path: str | os.PathLike, write: bool = False, create: bool = False, *,
                  dir_fd: int | None = None) -> int:
        return self.inner.open_file(path, write, create, dir_fd=dir_fd)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        self.inner.register_buffers(buffers)

    def poll(self, timeout: float | None = 0.0) -> int:
        return self.inner.poll(timeout)

    def drain(self) -> None:
        self.inner.drain()

    def close(self) -> None:
        self.inner.close()


class CountedCompletions:
    """poll() and drain() for a backend that counts completions under one condition variable:
    `_cond` (a threading.Condition), `_completed` and `_polled` (running totals) and
    `_outstanding` (requests in flight), updated by its completion path."""

    _cond: threading.Condition
    _completed: int
    _polled: int
    _outstanding: int

    def poll(self, timeout: float | None = 0.0) -> int:
        """Completions delivered since the last poll, waiting up to `timeout` for one if none."""
        with self._cond:
            if self._completed == self._polled and (timeout is None or timeout > 0) and self._outstanding:
                self._cond.wait_for(lambda: self._completed != self._polled or not self._outstanding, timeout)
            n = self._completed - self._polled
            self._polled = self._completed
            return n

    def drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._outstanding)


def submit_all(queue: IOQueue, requests: Iterable[IORequest], poll_timeout: float = 0.05) -> list[IOFuture]:
    """Submit every request, resubmitting the part a full queue refused in windows.

    The whole list is validated first (ValueError before any IO), then handed over one
    in-flight-sized window at a time: passing the whole rest on every call would make each
    `submit` re-validate everything it is about to refuse, O(n^2) for a long list.
    """
    pending = list(requests)
    caps = queue.caps()
    for req in pending:
        check_request(req, caps.alignment, caps.max_io_bytes)
    window = size = max(1, caps.max_in_flight)
    futures: list[IOFuture] = []
    start = 0
    while start < len(pending):
        accepted = queue.submit(pending[start : start + size])
        futures.extend(accepted)
        start += len(accepted)
        if start < len(pending) and len(accepted) < size:
            # Full: wait for room, then offer about as many as completed since the last poll
            # (offering more would only re-validate requests about to be refused again).
            size = min(window, max(1, queue.poll(poll_timeout)))
        else:
            size = min(window, 2 * size)  # all taken: offer more next time
    return futures


def wait_all(futures: Iterable[IOFuture], timeout: float | None = None) -> list[int]:
    """Wait for every future; raise the first error after all have finished."""
    futures = list(futures)
    results: list[int] = []
    first: BaseException | None = None
    for fut in futures:
        try:
            results.append(fut.result(timeout))
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001
            if first is None:
                first = exc
            results.append(-1)
    if first is not None:
        raise first
    return results


class ReadsFirst:
    """Writes yield to reads on a shared drive: while a tracked read is in flight, a writer's
    window (`submit_windowed`) shrinks to `yield_bytes`, one small write at a time.

    Why: a drive splits its time between whatever is queued. With a window of writes always
    queued beside them, a hit's reads got about a third of a disk that stores kept busy (the
    H200's virtio disk under `vllm serve`: 11.4 GB read against 25.2 GB written), and the hit
    policy recomputed most hits. A read done sooner saves prefill now; a write done later only
    delays a future hit (and a store that cannot wait is skipped and counted). Tracking polls
    `done()` rather than taking callbacks, so a read that lands while it is being tracked is
    never counted forever."""

    def __init__(self, yield_bytes: int = 4 << 20) -> None:
        if yield_bytes <= 0:
            raise ValueError(f"yield_bytes={yield_bytes!r}: expected a positive size")
        self.yield_bytes = yield_bytes
        self._lock = threading.Lock()
        self._reads: collections.deque[IOFuture] = collections.deque()
        self.yields = 0  # windows handed out shrunk (a writer waited for reads)

    def track(self, futures: Iterable[IOFuture]) -> None:
        """Reads just submitted: writers yield until they are done."""
        with self._lock:
            self._drop_landed()  # bounded while no writer asks (a server that only loads)
            self._reads.extend(futures)

    def reading(self) -> bool:
        """Whether a tracked read is in flight."""
        with self._lock:
            self._drop_landed()
            return bool(self._reads)

    def wait_idle(self, timeout: float) -> bool:
        """Block (the GIL released) until no tracked read is in flight or `timeout` passes;
        whether none is. A writer that yields sleeps on the newest read in flight and wakes once
        per batch of reads landed, where polling woke its thread every half millisecond beside the
        step (`bench/gil_spin_load.py --parts yield`)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._drop_landed()
                # the newest read not landed: reads land about in order, so the rest land before it
                newest = next((f for f in reversed(self._reads) if not f.done()), None)
                if newest is None:
                    self._reads.clear()
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            newest.wait(left)

    def _drop_landed(self) -> None:
        """Reads land about in the order they were submitted: the done ones are dropped from the
        front, O(1) amortized (a 32k hit tracks thousands of segment reads, and the writer asks
        before every write)."""
        reads = self._reads
        while reads and reads[0].done():
            reads.popleft()

    def window(self, base: int | None) -> int | None:
        """The writer's window now: `base`, or at most `yield_bytes` while reads are in flight.
        No window (None) stays none: RAM roots share no drive queue."""
        if base is None or not self.reading():
            return base
        self.yields += 1
        return min(base, self.yield_bytes)


def submit_windowed(queue: IOQueue, requests: Sequence[IORequest], window: int | None | Callable[[], int | None],
                    timeout: float, errors: dict) -> tuple[list[IOFuture], bool]:
    """Submit `requests` with at most `window` bytes in flight (None: all at once) and wait for
    every one; returns (the submitted futures, whether one stalled: no write completed for
    `timeout` seconds). Errors go into `errors[request.tag]` (the first per tag); after a stall
    the requests not yet submitted are not submitted and fail with a TimeoutError. `window` may
    be a function, asked before each request (`ReadsFirst.window`: smaller while reads wait).

    Why a window: reads share the drive's queue with these requests, and a read waits for
    whatever is queued ahead of it; more bytes in flight than keep the drive busy only delay
    the reads submitted behind them."""
    limit: Callable[[], int | None] = window if callable(window) else (lambda: window)  # type: ignore[assignment]
    deadline = time.monotonic() + timeout
    futures: list[IOFuture] = []
    stalled = False

    def wait(fut: IOFuture) -> None:
        nonlocal stalled, deadline
        try:
            fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:  # a stalled file system: the caller holds the buffers until it lands
            errors.setdefault(fut.request.tag, exc)
            stalled = True
            return
        except OSError as exc:
            errors.setdefault(fut.request.tag, exc)
        deadline = time.monotonic() + timeout

    if window is None:
        futures = submit_all(queue, requests)
        for fut in futures:
            wait(fut)
        return futures, stalled
    done_upto, inflight = 0, 0
    for k, req in enumerate(requests):
        while inflight and not stalled and (w := limit()) is not None and inflight + req.length > w:
            wait(futures[done_upto])
            inflight -= futures[done_upto].request.length
            done_upto += 1
        if stalled:
            for later in requests[k:]:
                errors.setdefault(later.tag, TimeoutError("not submitted: an earlier request of the batch stalled"))
            break
        futures.extend(submit_all(queue, [req]))
        inflight += req.length
    for fut in futures[done_upto:]:
        wait(fut)
    return futures, stalled


def register_backend(name: str) -> Callable[[Callable[..., IOQueue]], Callable[..., IOQueue]]:
    """Register an IO backend factory under `name` (used by config: `io_backend`)."""

    def deco(factory: Callable[..., IOQueue]) -> Callable[..., IOQueue]:
        _BACKENDS.register(name, factory)
        return factory

    return deco


def available_backends() -> list[str]:
    return _BACKENDS.names()


def resolve_backend(backend: str) -> Callable[..., IOQueue]:
    """The factory of a backend: a registered name ("uring", "threads", "nvme", or one a module
    registered with @register_backend), or "package.module:attr" (an IOQueue subclass or a
    function returning one; importing the module may also register names). A name registered in a
    notebook exists only in that process: a server needs "package.module:attr"."""
    return _callable_factory(*_BACKENDS.resolve(backend), backend)


def _callable_factory(factory: Callable[..., IOQueue], registered: bool, backend: str) -> Callable[..., IOQueue]:
    """The IO backends' check: what "package.module:attr" names is called to open a queue."""
    if not registered and not callable(factory):
        raise ValueError(f"io_backend={backend!r}: {backend.partition(':')[2]!r} is not callable (give an "
                         "IOQueue subclass or a function returning an IOQueue)")
    return factory


def open_queue(backend: str = "auto", **kwargs) -> IOQueue:
    """Open a queue: "auto" tries io_uring and falls back to threads; otherwise see
    resolve_backend. `kwargs` are the backend's own options (config: `io_options`)."""
    return _BACKENDS.get(backend, **kwargs)


def _open_auto(**kwargs) -> IOQueue:
    """The "auto" rule: io_uring where its module loads, else threads; threads again, with one
    warning, when the kernel refuses io_uring."""
    backend = "uring" if _BACKENDS.has("uring") else "threads"
    try:
        return _BACKENDS.entry(backend)(**kwargs)
    except OSError as exc:
        import warnings

        # stacklevel: open_queue's caller (open_queue -> Registry.get -> here)
        warnings.warn(f"tutti: io_uring refused ({exc}); falling back to the threads backend", stacklevel=4)
        # Options only io_uring understands are named uring_*; the fallback drops them.
        kwargs = {k: v for k, v in kwargs.items() if not k.startswith("uring_")}
        return _BACKENDS.entry("threads")(**kwargs)


def _open_named(factory: Callable[..., IOQueue], backend: str, registered: bool, /, **kwargs) -> IOQueue:
    """A named backend's queue: its factory called with the options, checked to be an IOQueue."""
    factory = _callable_factory(factory, registered, backend)
    try:
        q = factory(**kwargs)
    except TypeError as exc:  # an option the backend does not take
        raise ValueError(f"io_options={kwargs!r}: backend {backend!r} refused them ({exc}); pass only options "
                         "its constructor takes") from None
    if not isinstance(q, IOQueue):
        raise ValueError(f"io_backend={backend!r}: built a {type(q).__name__}, not a tutti.io.queue.IOQueue")
    return q


#: The IO backends' share of the one registry (tutti.plugins). The built-ins are imported when
#: first chosen or listed, so `tutti.io.queue` has no import-time dependency on any backend; one
#: whose module does not import is absent. Importing a backend's module also registers its name.
_BACKENDS = Registry(
    "io_backend", "register_backend",
    {"threads": "tutti.io.threads:ThreadQueue", "uring": "tutti.io.uring:UringQueue",
     "nvme": "tutti.io.nvme:open_nvme_queue"},
    ("caps", "submit"), fresh=True, optional=True, auto=_open_auto, make=_open_named, typed=False,
    noun="backend", note="a name registered in a notebook does not exist in a server process",
    doc="tutti.io.queue.IOQueue")
