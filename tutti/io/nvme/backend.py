"""The "nvme" IOQueue: tutti's queue contract on one NVMe queue pair.

A request becomes one or more NVMe Read/Write commands: its file range is translated to
device ranges through the file's extents (split where the file is not contiguous on disk),
then cut at the controller's real transfer limit. A request is accepted whole or not at all
(partial acceptance of a batch stops at the first request that does not fit the free SQ
slots); its future completes when its last command does. The queue works against two small
interfaces, DmaMemory (bus addresses) and an extent resolver, so the very same code runs on
hardware and against the tests' controller model.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from ..queue import READ, WRITE, IOErrorWithRequest, IOFuture, IOQueue, IORequest, QueueCaps, check_request
from .fiemap import FileExtents
from .prp import build_prps, max_prp_bytes, pages_touched
from .qpair import QueuePair
from .spec import MAX_NLB, OPC_READ, OPC_WRITE, describe_status, encode_rw


class DmaMemory(Protocol):
    """Where the controller can reach host memory."""

    page_size: int

    def ensure(self, buf: torch.Tensor) -> None:
        """Make `buf` reachable by the controller (map/pin it once); idempotent."""

    def pages(self, addr: int, length: int) -> list[int]:
        """Bus address of every controller page touched by [addr, addr+length), in order."""

    def prp_list(self, slot: int) -> tuple[int, int]:
        """(host address, bus address) of the PRP list page reserved for command slot `slot`."""


class ExtentResolver(Protocol):
    def resolve(self, fd: int) -> FileExtents: ...


@dataclass
class _Parent:
    future: IOFuture
    remaining: int
    error: str | None = None


@dataclass(frozen=True)
class _Cmd:
    opcode: int
    slba: int
    nblocks: int
    addr: int  # host address of the data
    nbytes: int


class NvmeQueue(IOQueue):
    name = "nvme"

    def __init__(
        self,
        qpair: QueuePair,
        dma: DmaMemory,
        resolver: ExtentResolver,
        *,
        lba_size: int,
        max_transfer: int,
        nsid: int,
        on_close: Callable[[], None] | None = None,
        drop_cache_after_write: bool = False,
        extra: dict | None = None,
    ) -> None:
        if lba_size < 512 or lba_size & (lba_size - 1):
            raise ValueError(f"lba_size={lba_size}: the device reported a logical block size that is not a power of two >= 512")
        self.qpair = qpair
        self.dma = dma
        self.resolver = resolver
        self.lba_size = lba_size
        self.nsid = nsid
        limit = min(max_prp_bytes(dma.page_size), MAX_NLB * lba_size)
        if max_transfer:  # 0 = the controller reported no MDTS limit
            limit = min(limit, max_transfer)
        self.max_transfer = limit - limit % lba_size
        if self.max_transfer <= 0:
            raise ValueError(f"max_transfer={max_transfer}: smaller than one {lba_size} B logical block")
        self._on_close = on_close
        self._drop_cache = drop_cache_after_write
        self._extra = dict(extra or {})
        self._lock = threading.RLock()
        self._by_cid: dict[int, _Parent] = {}
        self._live = 0  # requests not yet finished
        self._closed = False
        self._broken: BaseException | None = None

    # -- contract --------------------------------------------------------------------------
    def caps(self) -> QueueCaps:
        depth = self.qpair.max_outstanding
        return QueueCaps(
            backend=self.name,
            alignment=self.lba_size,
            max_io_bytes=self.max_transfer,
            queue_depth=depth,
            max_in_flight=depth,
            direct_io=True,
            extra={"lba_size": self.lba_size, "page_size": self.dma.page_size, "qid": self.qpair.qid,
                   "nsid": self.nsid, **self._extra},
        )

    def open_file(self, path: str | os.PathLike, write: bool = False, create: bool = False, *,
                  dir_fd: int | None = None) -> int:
        # Data moves through raw LBAs; the fd is only a handle for FIEMAP and the access mode.
        return super().open_file(path, write=write, create=create, dir_fd=dir_fd)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        for b in buffers:
            self.dma.ensure(b)

    def submit(self, requests: Sequence[IORequest]) -> list[IOFuture]:
        if self._closed:
            raise ValueError("NvmeQueue.submit: the queue is closed; open a new one")
        if self._broken is not None:
            raise OSError(errno.EIO, f"nvme queue {self.qpair.qid} is unusable: {self._broken}")
        plans = [self._plan(req) for req in requests]  # every check before any IO
        for req in requests:
            self.dma.ensure(req.buf)
        futures: list[IOFuture] = []
        with self._lock:
            for req, cmds in zip(requests, plans):
                if len(cmds) > self.qpair.free_slots():
                    break
                fut = IOFuture(req)
                fut._waiter = lambda t, f=fut: self._wait_for(f, t)
                parent = _Parent(fut, len(cmds))
                self._live += 1
                for c in cmds:
                    self._push(c, parent)
                futures.append(fut)
            self.qpair.ring()
        return futures

    def poll(self, timeout: float | None = 0.0) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        spins = 0
        while True:
            with self._lock:
                n = self._reap()
                idle = not self._by_cid
            if n or idle or (deadline is not None and time.monotonic() >= deadline):
                return n
            spins += 1
            if spins > 64:
                time.sleep(20e-6)

    def drain(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                self._reap()
                if not self._by_cid:
                    return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nvme queue {self.qpair.qid}: {len(self._by_cid)} commands still outstanding "
                                   f"after {timeout}s")
            time.sleep(20e-6)

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._broken is None:
                self.drain()
        finally:
            self._closed = True
            with self._lock:
                for parent in {id(p): p for p in self._by_cid.values()}.values():
                    if not parent.future.done():
                        parent.future.set_exception(OSError(errno.ECANCELED, "nvme queue closed with IO in flight"))
                self._by_cid.clear()
            if self._on_close is not None:
                self._on_close()

    # -- planning ------------------------------------------------------------------------
    def _plan(self, req: IORequest) -> list[_Cmd]:
        check_request(req, align=self.lba_size, max_io=self.max_transfer)
        if req.op == WRITE:
            try:
                mode = fcntl.fcntl(req.fd, fcntl.F_GETFL) & os.O_ACCMODE
            except OSError as exc:
                raise ValueError(f"IORequest.fd={req.fd}: not an open file ({exc.strerror})") from exc
            if mode == os.O_RDONLY:
                raise ValueError(f"IORequest.fd={req.fd}: opened read-only, cannot write; open it with write=True")
        segments = self.resolver.resolve(req.fd).translate(req.offset, req.length, align=self.lba_size)
        opcode = OPC_READ if req.op == READ else OPC_WRITE
        cmds: list[_Cmd] = []
        addr = req.buffer_address()
        for seg in segments:
            done = 0
            while done < seg.length:
                n = min(self.max_transfer, seg.length - done)
                cmds.append(_Cmd(opcode, (seg.device_offset + done) // self.lba_size, n // self.lba_size,
                                 addr + (seg.file_offset - req.offset) + done, n))
                done += n
        if len(cmds) > self.qpair.max_outstanding:
            raise ValueError(
                f"IORequest at offset {req.offset}, length {req.length}: needs {len(cmds)} NVMe commands "
                f"(file fragmentation), more than the queue's {self.qpair.max_outstanding}; split the request"
            )
        return cmds

    def _push(self, c: _Cmd, parent: _Parent) -> None:
        ps = self.dma.page_size
        cid = self.qpair.alloc_cid()
        first = c.addr % ps
        iovas = self.dma.pages(c.addr, c.nbytes)
        list_addr = list_iova = None
        if pages_touched(first, c.nbytes, ps) > 2:
            list_addr, list_iova = self.dma.prp_list(cid)
        plan = build_prps(iovas, first, c.nbytes, ps, list_iova)
        if plan.list_entries:
            packed = struct.pack(f"<{len(plan.list_entries)}Q", *plan.list_entries)
            ctypes.memmove(list_addr, packed, len(packed))
        self._by_cid[cid] = parent
        self.qpair.push(encode_rw(c.opcode, cid, self.nsid, plan.prp1, plan.prp2, c.slba, c.nblocks))

    # -- completion ----------------------------------------------------------------------
    def _reap(self) -> int:
        if self._broken is not None:
            return 0
        try:
            cqes = self.qpair.reap()
        except OSError as exc:  # controller protocol violation: fail every outstanding IO
            self._broken = exc
            for parent in {id(p): p for p in self._by_cid.values()}.values():
                parent.future.set_exception(exc)
            self._by_cid.clear()
            raise
        for cqe in cqes:
            parent = self._by_cid.pop(cqe.cid)
            if not cqe.ok and parent.error is None:
                parent.error = f"{describe_status(cqe.status)} on CID {cqe.cid}"
            parent.remaining -= 1
            if parent.remaining == 0:
                self._finish(parent)
        return len(cqes)

    def _finish(self, parent: _Parent) -> None:
        self._live -= 1
        req = parent.future.request
        if parent.error is not None:
            parent.future.set_exception(IOErrorWithRequest(errno.EIO, req, parent.error))
            return
        if req.op == WRITE and self._drop_cache:
            # Raw writes bypass the page cache; drop any cached copy of the range so a later
            # buffered read of the file does not return the bytes from before this write.
            try:
                os.posix_fadvise(req.fd, req.offset, req.length, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
        parent.future.set_result(req.length)

    def _wait_for(self, fut: IOFuture, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            self.poll(left if left is None else min(left, 0.01))
