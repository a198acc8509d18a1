"""The thread-pool backend ("threads"): os.preadv/os.pwritev workers.

The portable fallback where io_uring is refused (old kernels, seccomp, containers with
kernel.io_uring_disabled) and the reference the io_uring backend is benchmarked against. The
workers block in preadv/pwritev with the GIL released, straight into the tensor's memory
(a zero-copy memoryview through numpy), so a pool of a few threads keeps a device busy.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from typing import Sequence

import torch

from tutti.io.buffers import open_direct
from tutti.io.queue import (
    ALIGN,
    CountedCompletions,
    READ,
    IOErrorWithRequest,
    IOFuture,
    IOQueue,
    IORequest,
    QueueCaps,
    check_request,
    register_backend,
)

log = logging.getLogger(__name__)

#: Same cap as the uring backend so both accept the same requests (see uring.DEFAULT_MAX_IO).
DEFAULT_MAX_IO = 32 << 20


@register_backend("threads")
class ThreadQueue(CountedCompletions, IOQueue):
    """A pool of `workers` threads; at most `max_in_flight` requests queued or running.

    `queue_depth` is accepted for symmetry with the uring backend (the "auto" fallback passes
    the same arguments): here it only sets the default of `max_in_flight`.
    """

    name = "threads"

    def __init__(
        self,
        queue_depth: int = 128,
        max_in_flight: int | None = None,
        max_io_bytes: int = DEFAULT_MAX_IO,
        workers: int = 16,
        direct: bool = True,
    ) -> None:
        if not isinstance(queue_depth, int) or queue_depth < 1:
            raise ValueError(f"queue_depth={queue_depth!r}: expected a positive int")
        if not isinstance(direct, bool):
            raise ValueError(f"direct={direct!r}: expected true (O_DIRECT where the file system allows it) or false "
                             "(buffered reads: the page cache may already hold the data)")
        self._prefer_direct = direct
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers={workers!r}: expected a positive int")
        if max_io_bytes <= 0 or max_io_bytes % ALIGN:
            raise ValueError(f"max_io_bytes={max_io_bytes!r}: expected a positive multiple of {ALIGN}")
        if max_in_flight is None:
            max_in_flight = queue_depth
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight!r}: expected a positive int")
        self._queue_depth = queue_depth
        self._max_in_flight = max_in_flight
        self._max_io = max_io_bytes
        self._direct: dict[int, bool] = {}
        self._said_buffered = False
        self._cond = threading.Condition()
        self._pending: collections.deque[IOFuture] = collections.deque()
        self._outstanding = 0  # queued + running + future not yet set
        self._completed = 0
        self._polled = 0
        self._closing = False
        self._workers = [
            threading.Thread(target=self._work, name=f"tutti-io-{i}", daemon=True) for i in range(min(workers, max_in_flight))
        ]
        for t in self._workers:
            t.start()

    def caps(self) -> QueueCaps:
        return QueueCaps(
            backend=self.name,
            alignment=ALIGN,
            max_io_bytes=self._max_io,
            queue_depth=self._max_in_flight,
            max_in_flight=self._max_in_flight,
            direct_io=all(self._direct.values()) if self._direct else True,
            extra={"workers": len(self._workers), "buffered_fds": sorted(fd for fd, d in self._direct.items() if not d)},
        )

    def open_file(self, path: str | os.PathLike, write: bool = False, create: bool = False, *,
                  dir_fd: int | None = None) -> int:
        """O_DIRECT where the file system allows it, else buffered (recorded; see open_direct)."""
        fd, direct = open_direct(path, write=write, create=create, dir_fd=dir_fd, prefer=self._prefer_direct)
        if not direct and self._prefer_direct and not self._said_buffered:
            # once per queue: a RAM root refuses O_DIRECT for every slab (a line each filled the log)
            self._said_buffered = True
            log.info("tutti threads: %s refuses O_DIRECT; using buffered IO for it and any other file that "
                     "refuses it (said once)", path)
        self._direct[fd] = direct
        return fd

    def is_direct(self, fd: int) -> bool | None:
        return self._direct.get(fd)

    def submit(self, requests: Sequence[IORequest]) -> list[IOFuture]:
        requests = list(requests)
        for req in requests:
            check_request(req, ALIGN, self._max_io)
        with self._cond:
            if self._closing:
                raise RuntimeError("ThreadQueue.submit: the queue is closed")
            room = min(len(requests), self._max_in_flight - self._outstanding)
            if room <= 0:
                return []
            futures = [IOFuture(req) for req in requests[:room]]
            self._pending.extend(futures)
            self._outstanding += room
            self._cond.notify(room)
        return futures

    def close(self) -> None:
        with self._cond:
            if self._closing:
                return
        self.drain()
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._workers:
            t.join()

    # -- workers --------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                fut = self._pending.popleft()
            try:
                nbytes, error = self._transfer(fut.request), None
            except OSError as exc:
                nbytes, error = -1, IOErrorWithRequest(exc.errno or errno.EIO, fut.request, exc.strerror or str(exc))
            except Exception as exc:  # noqa: BLE001 - never leave a future pending
                nbytes, error = -1, exc
            try:
                if error is None:
                    fut.set_result(nbytes)  # short -> EIO error naming the request
                else:
                    fut.set_exception(error)
            except Exception:  # noqa: BLE001 - a caller's callback must not kill the worker
                log.exception("tutti threads: done-callback raised")
            with self._cond:
                self._outstanding -= 1
                self._completed += 1
                self._cond.notify_all()

    def _transfer(self, req: IORequest) -> int:
        """Move all of req's bytes, looping over partial transfers; returns the count moved.

        A 0-byte read means end of file: the count comes back short and IOFuture turns it into
        an error naming the request. On an O_DIRECT file a partial that leaves the position
        unaligned cannot be continued (EINVAL), so it is reported as the short transfer it is.
        """
        view = memoryview(_numpy_view(req.buf))[req.buf_offset : req.buf_offset + req.length]
        io = os.preadv if req.op == READ else os.pwritev
        direct = self._direct.get(req.fd, True)
        done = 0
        while done < req.length:
            n = io(req.fd, [view[done:]], req.offset + done)
            if n <= 0:
                break
            done += n
            if direct and done % ALIGN:
                break
        return done


def _numpy_view(t: torch.Tensor):
    """The tensor's memory as a flat numpy array, without a copy."""
    return t.detach().numpy().reshape(-1)
