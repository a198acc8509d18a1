"""A small pure-Python model of an NVMe controller's I/O queue processing.

It does what a controller does with one queue pair, at the level the host can observe:
on an SQ tail doorbell it consumes SQEs from the ring (a bytearray shared with the host
code), walks PRP1/PRP2/PRP lists in host memory (bus address == virtual address here),
moves data between host memory and a bytearray "disk", and posts 16-byte CQEs with the phase
tag, honouring the CQ head doorbell. `defer=True` makes it wait for `process()` so tests can
fill the queue.
"""

from __future__ import annotations

import ctypes
import mmap
import struct

from tutti.io.nvme.prp import pages_touched
from tutti.io.nvme.spec import (CQE_SIZE, OPC_READ, OPC_WRITE, SQE_SIZE, decode_sqe, encode_cqe)

SC_INVALID_OPCODE = 0x01
SC_INVALID_NS = 0x0B
SC_PRP_OFFSET_INVALID = 0x13
SC_LBA_OUT_OF_RANGE = 0x80


class ModelController:
    def __init__(self, depth: int, qid: int, disk: bytearray, lba_size: int, page_size: int = 4096,
                 nsid: int = 1, defer: bool = False) -> None:
        self.depth, self.qid, self.nsid = depth, qid, nsid
        self.sq = bytearray(depth * SQE_SIZE)
        self.cq = bytearray(depth * CQE_SIZE)
        self.disk = disk
        self._disk_addr = ctypes.addressof((ctypes.c_char * len(disk)).from_buffer(disk))
        self.lba_size, self.page_size = lba_size, page_size
        self.defer = defer
        self.sq_head = 0
        self.sq_tail = 0  # last SQ doorbell value
        self.cq_tail = 0
        self.cq_head = 0  # last CQ doorbell value
        self.phase = 1
        self.pending: list[tuple[int, int]] = []  # (cid, status) waiting for CQ space
        self.executed = []  # every SQE consumed, in order
        self.sq_doorbells: list[int] = []
        self.cq_doorbells: list[int] = []

    # doorbells ------------------------------------------------------------------------
    def ring_sq(self, value: int) -> None:
        assert 0 <= value < self.depth, f"SQ tail doorbell {value} out of range"
        self.sq_doorbells.append(value)
        self.sq_tail = value
        if not self.defer:
            self.process()

    def ring_cq(self, value: int) -> None:
        assert 0 <= value < self.depth, f"CQ head doorbell {value} out of range"
        self.cq_doorbells.append(value)
        self.cq_head = value
        self._post()

    # processing -----------------------------------------------------------------------
    def process(self, max_commands: int | None = None) -> int:
        n = 0
        while self.sq_head != self.sq_tail and (max_commands is None or n < max_commands):
            off = self.sq_head * SQE_SIZE
            sqe = decode_sqe(self.sq[off : off + SQE_SIZE])
            self.sq_head = (self.sq_head + 1) % self.depth
            self.executed.append(sqe)
            self.pending.append((sqe.cid, self._execute(sqe)))
            n += 1
        self._post()
        return n

    def _post(self) -> None:
        while self.pending and (self.cq_tail + 1) % self.depth != self.cq_head:
            cid, status = self.pending.pop(0)
            off = self.cq_tail * CQE_SIZE
            self.cq[off : off + CQE_SIZE] = encode_cqe(0, self.sq_head, self.qid, cid, self.phase, status)
            self.cq_tail += 1
            if self.cq_tail == self.depth:
                self.cq_tail = 0
                self.phase ^= 1

    def _execute(self, sqe) -> int:
        if sqe.opcode not in (OPC_READ, OPC_WRITE):
            return SC_INVALID_OPCODE
        if sqe.nsid != self.nsid:
            return SC_INVALID_NS
        nbytes = sqe.nblocks * self.lba_size
        start = sqe.slba * self.lba_size
        if start + nbytes > len(self.disk):
            return SC_LBA_OUT_OF_RANGE
        segs = self._prp_segments(sqe.prp1, sqe.prp2, nbytes)
        if segs is None:
            return SC_PRP_OFFSET_INVALID
        pos = start
        for addr, n in segs:
            if sqe.opcode == OPC_WRITE:
                ctypes.memmove(self._disk_addr + pos, addr, n)
            else:
                ctypes.memmove(addr, self._disk_addr + pos, n)
            pos += n
        return 0

    def _prp_segments(self, prp1: int, prp2: int, nbytes: int):
        ps = self.page_size
        first = prp1 % ps
        n = pages_touched(first, nbytes, ps)
        pages = [prp1 - first]
        if n == 2:
            pages.append(prp2)
        elif n > 2:
            if prp2 % 8:
                return None
            pages += struct.unpack(f"<{n - 1}Q", ctypes.string_at(prp2, 8 * (n - 1)))
        if any(p % ps for p in pages[1:]):
            return None
        segs, left = [], nbytes
        for i, p in enumerate(pages):
            off = first if i == 0 else 0
            take = min(ps - off, left)
            segs.append((p + off, take))
            left -= take
        return segs


class IdentityDma:
    """DmaMemory where the bus address is the virtual address (what the model reads)."""

    def __init__(self, page_size: int, slots: int) -> None:
        self.page_size = page_size
        self._pool = mmap.mmap(-1, slots * page_size)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._pool))
        self.ensured = 0

    def ensure(self, buf) -> None:
        self.ensured += 1

    def pages(self, addr: int, length: int) -> list[int]:
        ps = self.page_size
        start = addr - addr % ps
        n = pages_touched(addr - start, length, ps)
        return [start + i * ps for i in range(n)]

    def prp_list(self, slot: int) -> tuple[int, int]:
        a = self._base + slot * self.page_size
        return a, a


class DictResolver:
    """fd -> FileExtents given by the test (the FIEMAP side is tested on a real file)."""

    def __init__(self) -> None:
        self.files = {}

    def resolve(self, fd: int):
        return self.files[fd]
