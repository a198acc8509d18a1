"""One queue over several: each file goes to the queue it was opened through.

Why: a hierarchy of tiers puts a RAM tier in front of a drive (or a shared file system), and the
backend that is fastest for one is not for the other (the thread pool on /dev/shm, io_uring on
NVMe: tutti.engine.config.resolve.io_backend). The pipelines speak to one IOQueue; this one hands
each request to the queue that opened its file, so every tier keeps its own backend and options
without the pipelines knowing there are several.

    routed = RoutedQueue([threads, uring])
    fd = routed.opener(1)("/mnt/nvme/tutti/slab-0.bin")  # this file's requests go to `uring`

A file descriptor is routed by the last open that returned it (a closed fd number reused by
another tier's open is routed anew); an fd no opener returned goes to the first queue.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

import torch

from tutti.io.queue import IOFuture, IOQueue, IORequest, QueueCaps


class RoutedQueue(IOQueue):
    """The IOQueue contract over `queues`: submit hands each request to its file's queue (a
    prefix is accepted, as every queue does: it stops at the first queue that is full), poll
    reaps all of them, caps is what every one of them takes."""

    def __init__(self, queues: Sequence[IOQueue]) -> None:
        if not queues:
            raise ValueError("RoutedQueue: expected at least one queue")
        self.queues = list(queues)
        self.name = "+".join(q.name for q in self.queues)
        self._route: dict[int, int] = {}
        self._lock = threading.Lock()
        self._outstanding = [0] * len(self.queues)  # requests in flight per queue (poll waits on those)

    def opener(self, i: int) -> Callable[..., int]:
        """open_file through queue `i`: the fd it returns is routed there."""
        q = self.queues[i]

        def open_file(path: str | os.PathLike, write: bool = False, create: bool = False, *,
                      dir_fd: int | None = None) -> int:
            fd = q.open_file(path, write, create, dir_fd=dir_fd)
            with self._lock:
                self._route[fd] = i
            return fd

        return open_file

    def queue_of(self, fd: int) -> int:
        return self._route.get(fd, 0)

    def caps(self) -> QueueCaps:
        caps = [q.caps() for q in self.queues]
        return QueueCaps(backend=self.name, alignment=max(c.alignment for c in caps),
                         max_io_bytes=min(c.max_io_bytes for c in caps), queue_depth=min(c.queue_depth for c in caps),
                         max_in_flight=min(c.max_in_flight for c in caps), direct_io=any(c.direct_io for c in caps),
                         extra={"queues": [c.backend for c in caps]})

    def submit(self, requests: Sequence[IORequest]) -> list[IOFuture]:
        out: list[IOFuture] = []
        start = 0
        while start < len(requests):
            i = self.queue_of(requests[start].fd)
            end = start + 1
            while end < len(requests) and self.queue_of(requests[end].fd) == i:
                end += 1
            taken = self.queues[i].submit(requests[start:end])
            self._count(i, taken)
            out.extend(taken)
            if len(taken) < end - start:
                break  # that queue is full: the rest is the caller's to resubmit, in order
            start = end
        return out

    def _count(self, i: int, futures: list[IOFuture]) -> None:
        if not futures:
            return
        with self._lock:
            self._outstanding[i] += len(futures)

        def landed(_fut: IOFuture) -> None:
            with self._lock:
                self._outstanding[i] -= 1

        for f in futures:
            f.add_done_callback(landed)

    def open_file(self, path: str | os.PathLike, write: bool = False, create: bool = False, *,
                  dir_fd: int | None = None) -> int:
        return self.opener(0)(path, write, create, dir_fd=dir_fd)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        for q in self.queues:
            q.register_buffers(buffers)

    def poll(self, timeout: float | None = 0.0) -> int:
        """Completions reaped from every queue; waits up to `timeout` for one, on the queue that
        has requests in flight (taking turns in short slices where several have)."""
        n = sum(q.poll(0.0) for q in self.queues)
        if n or timeout == 0.0:
            return n
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                busy = [i for i, k in enumerate(self._outstanding) if k > 0]
            if not busy:
                return sum(q.poll(0.0) for q in self.queues)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return 0
            if len(busy) == 1:
                return self.queues[busy[0]].poll(left)
            for i in busy:
                n += self.queues[i].poll(0.001 if left is None else min(0.001, left))
            if n:
                return n

    def drain(self) -> None:
        for q in self.queues:
            q.drain()

    def close(self) -> None:
        errors = []
        for q in self.queues:
            try:
                q.close()
            except Exception as exc:  # noqa: BLE001 - every queue is closed; the first error is raised
                errors.append(exc)
        if errors:
            raise errors[0]
