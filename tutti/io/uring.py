"""The io_uring backend ("uring"), on the raw syscalls through ctypes: no liburing, no build step.

Why raw syscalls: Tutti must install with pip alone, and io_uring's ABI is small and stable.
The rings are mapped with Python's `mmap` and read/written through ctypes views, submission is
one `io_uring_enter` per batch, and a background thread waits for completions inside
`io_uring_enter(GETEVENTS)` with the GIL released (ctypes drops the GIL around foreign calls),
so reaping costs no polling and the caller's thread never blocks on IO.

Memory ordering. The kernel publishes CQEs before it advances the CQ tail, and reads SQEs after
it sees the SQ tail. We mirror that: read the CQ tail, then the entries, then store the head;
write the SQEs and the SQ array, then store the SQ tail. Without SQPOLL the kernel only reads
the SQ inside io_uring_enter, and a syscall is a full barrier on every architecture, so the SQ
side is ordered everywhere. On the CQ side plain loads are enough on x86 (TSO); on weakly
ordered CPUs (aarch64) we rely on the reaper only reading the ring right after io_uring_enter
returned, which again is a syscall boundary.

One idea (one ring, its memory ordering and its completions), which does not split well.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import itertools
import logging
import mmap
import os
import platform
import threading
import time
from typing import Sequence

import torch

from tutti.io.buffers import open_direct
from tutti.io.queue import (
    ALIGN,
    CountedCompletions,
    READ,
    IOFuture,
    IOQueue,
    IORequest,
    QueueCaps,
    check_request,
    register_backend,
)

log = logging.getLogger(__name__)

# -- ABI constants (include/uapi/linux/io_uring.h) ---------------------------------------------
# io_uring got its syscall numbers after the table unification (5.1), so they are the same on
# x86_64, aarch64, arm, riscv, ppc64, s390x...; alpha and the MIPS ABIs are offset.
_SYSCALLS = {
    "alpha": (535, 536, 537),
    "mips": (4425, 4426, 4427),  # o32
    "mips64": (5425, 5426, 5427),  # n64
}
NR_SETUP, NR_ENTER, NR_REGISTER = _SYSCALLS.get(platform.machine(), (425, 426, 427))

IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000

IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_FEAT_NODROP = 1 << 1

IORING_ENTER_GETEVENTS = 1 << 0

IORING_REGISTER_BUFFERS = 0
IORING_UNREGISTER_BUFFERS = 1
IORING_REGISTER_PROBE = 8
IO_URING_OP_SUPPORTED = 1 << 0

IORING_OP_NOP = 0
IORING_OP_READV = 1
IORING_OP_WRITEV = 2
IORING_OP_READ_FIXED = 4
IORING_OP_WRITE_FIXED = 5
IORING_OP_READ = 22
IORING_OP_WRITE = 23

#: The kernel refuses a single registered buffer over 1 GiB (io_buffer_validate); bigger
#: tensors are registered as several 1 GiB pieces.
MAX_FIXED_BUFFER = 1 << 30
#: Default largest single request. The block layer splits an IO at max_sectors_kb anyway, so a
#: bigger request only means fewer SQEs and syscalls, never an oversized device command; 32 MiB
#: keeps Tutti's largest segment in one request while bounding the memory one request pins.
DEFAULT_MAX_IO = 32 << 20

_WAKE = 0  # user_data of the NOP that wakes the reaper at close; real requests start at 1


class _SQOffsets(ctypes.Structure):
    _fields_ = [
        ("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("dropped", ctypes.c_uint32),
        ("array", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64),
    ]


class _CQOffsets(ctypes.Structure):
    _fields_ = [
        ("head", ctypes.c_uint32), ("tail", ctypes.c_uint32), ("ring_mask", ctypes.c_uint32),
        ("ring_entries", ctypes.c_uint32), ("overflow", ctypes.c_uint32), ("cqes", ctypes.c_uint32),
        ("flags", ctypes.c_uint32), ("resv1", ctypes.c_uint32), ("user_addr", ctypes.c_uint64),
    ]


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32), ("cq_entries", ctypes.c_uint32), ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32), ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32), ("wq_fd", ctypes.c_uint32), ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SQOffsets), ("cq_off", _CQOffsets),
    ]


class _SQE(ctypes.Structure):
    _fields_ = [
        ("opcode", ctypes.c_uint8), ("flags", ctypes.c_uint8), ("ioprio", ctypes.c_uint16),
        ("fd", ctypes.c_int32), ("off", ctypes.c_uint64), ("addr", ctypes.c_uint64),
        ("len", ctypes.c_uint32), ("rw_flags", ctypes.c_uint32), ("user_data", ctypes.c_uint64),
        ("buf_index", ctypes.c_uint16), ("personality", ctypes.c_uint16),
        ("splice_fd_in", ctypes.c_int32), ("addr3", ctypes.c_uint64), ("pad2", ctypes.c_uint64),
    ]


class _CQE(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint64), ("res", ctypes.c_int32), ("flags", ctypes.c_uint32)]


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _ProbeOp(ctypes.Structure):
    _fields_ = [("op", ctypes.c_uint8), ("resv", ctypes.c_uint8), ("flags", ctypes.c_uint16), ("resv2", ctypes.c_uint32)]


class _Probe(ctypes.Structure):
    _fields_ = [
        ("last_op", ctypes.c_uint8), ("ops_len", ctypes.c_uint8), ("resv", ctypes.c_uint16),
        ("resv2", ctypes.c_uint32 * 3), ("ops", _ProbeOp * 256),
    ]


assert ctypes.sizeof(_Params) == 120 and ctypes.sizeof(_SQE) == 64 and ctypes.sizeof(_CQE) == 16

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def _enter(fd: int, to_submit: int, min_complete: int, flags: int) -> int:
    """io_uring_enter; returns the count or -errno. The GIL is released for the call."""
    ret = _syscall(ctypes.c_long(NR_ENTER), ctypes.c_long(fd), ctypes.c_long(to_submit),
                   ctypes.c_long(min_complete), ctypes.c_long(flags), None, ctypes.c_long(0))
    return ret if ret >= 0 else -ctypes.get_errno()


def _register(fd: int, opcode: int, arg, nr_args: int) -> int:
    ret = _syscall(ctypes.c_long(NR_REGISTER), ctypes.c_long(fd), ctypes.c_long(opcode), arg, ctypes.c_long(nr_args))
    return ret if ret >= 0 else -ctypes.get_errno()


def _os_error(err: int, what: str) -> OSError:
    return OSError(err, f"{what}: {os.strerror(err)}")


def _block_device_max_io(fd: int) -> int | None:
    """The file's device's max_sectors_kb in bytes, if sysfs shows it (informational)."""
    try:
        dev = os.fstat(fd).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for path in (f"{base}/queue/max_sectors_kb", f"{base}/../queue/max_sectors_kb"):
            if os.path.exists(path):
                with open(path) as f:
                    return int(f.read().strip()) * 1024
    except (OSError, ValueError):
        pass
    return None


@register_backend("uring")
class UringQueue(CountedCompletions, IOQueue):
    """io_uring queue: one ring, one reaper thread, O_DIRECT files, fixed staging buffers.

    `queue_depth` is the SQ size (rounded up to a power of two by the kernel); `max_in_flight`
    bounds outstanding requests (at most the CQ size, so the CQ can never overflow).
    `uring_setup_flags` is passed to io_uring_setup untouched (tests force a refused setup with
    an unknown bit to exercise the "auto" fallback). `uring_reap_divisor` trades latency for CPU:
    the completion thread sleeps until 1/divisor of the outstanding requests are done (at least
    one), so with 64 in flight it wakes every 16 completions; 1 wakes per completion (lowest
    latency for a lone request, most CPU when the device is fast).
    """

    name = "uring"

    def __init__(
        self,
        queue_depth: int = 128,
        max_in_flight: int | None = None,
        max_io_bytes: int = DEFAULT_MAX_IO,
        uring_setup_flags: int = 0,
        uring_reap_divisor: int = 4,
        direct: bool = True,
    ) -> None:
        if not isinstance(direct, bool):
            raise ValueError(f"direct={direct!r}: expected true (O_DIRECT where the file system allows it) or false "
                             "(buffered reads: the page cache may already hold the data)")
        self._prefer_direct = direct
        if not isinstance(queue_depth, int) or not 1 <= queue_depth <= 32768:
            raise ValueError(f"queue_depth={queue_depth!r}: expected an int in [1, 32768]")
        if max_io_bytes <= 0 or max_io_bytes % ALIGN or max_io_bytes > (1 << 30):
            raise ValueError(f"max_io_bytes={max_io_bytes!r}: expected a positive multiple of {ALIGN} up to 1 GiB")
        self._ring_fd = -1
        self._mmaps: list[mmap.mmap] = []
        params = _Params()
        params.flags = uring_setup_flags
        ret = _syscall(ctypes.c_long(NR_SETUP), ctypes.c_long(queue_depth), ctypes.byref(params))
        if ret < 0:
            err = ctypes.get_errno()
            hint = ""
            if err in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                hint = " (io_uring disabled: kernel without it, seccomp, or sysctl kernel.io_uring_disabled)"
            raise _os_error(err, f"io_uring_setup(entries={queue_depth}, flags={uring_setup_flags:#x}){hint}")
        self._ring_fd = fd = int(ret)
        try:
            self._map_rings(params)
        except BaseException:
            self._release_rings()
            raise
        self._sq_entries = params.sq_entries
        self._cq_entries = params.cq_entries
        self._features = params.features
        if max_in_flight is None:
            max_in_flight = self._sq_entries
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            self._release_rings()
            raise ValueError(f"max_in_flight={max_in_flight!r}: expected a positive int")
        # Never more outstanding than CQ slots: completions can then never be dropped or
        # pushed to the overflow list, whatever the kernel's FEAT_NODROP says.
        self._max_in_flight = min(max_in_flight, self._cq_entries)
        self._max_io = max_io_bytes
        if not isinstance(uring_reap_divisor, int) or uring_reap_divisor < 1:
            self._release_rings()
            raise ValueError(f"uring_reap_divisor={uring_reap_divisor!r}: expected a positive int")
        self._reap_divisor = uring_reap_divisor
        self._use_rw = self._probe_rw()
        self._direct: dict[int, bool] = {}
        self._said_buffered = False
        self._device_max_io: dict[int, int | None] = {}

        self._lock = threading.Lock()  # SQ tail, in-flight map, fixed-buffer table
        self._cond = threading.Condition(self._lock)
        self._inflight: dict[int, tuple[IOFuture, object]] = {}
        # Requests not yet finished *including* their future being set: drain() waits on this,
        # so a drained queue never has a future still pending.
        self._outstanding = 0
        self._ids = itertools.count(1)
        self._sq_tail_local = self._sq_tail.value
        self._completed = 0
        self._polled = 0
        self._closing = False
        self._dead: BaseException | None = None
        self._fixed_starts: list[int] = []
        self._fixed: list[tuple[int, int, int]] = []  # (start, end, buf_index), sorted by start
        self._fixed_owners: list[torch.Tensor] = []
        self._ops = {"fixed": 0, "plain": 0, "vectored": 0}  # SQEs issued per kind (caps().extra)
        self._reaper = threading.Thread(target=self._reap_loop, name=f"tutti-uring-reaper-{fd}", daemon=True)
        self._reaper.start()

    # -- setup ----------------------------------------------------------------------------
    def _map_rings(self, p: _Params) -> None:
        fd = self._ring_fd
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        sq_size = p.sq_off.array + p.sq_entries * 4
        cq_size = p.cq_off.cqes + p.cq_entries * ctypes.sizeof(_CQE)
        if p.features & IORING_FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        sq_mm = mmap.mmap(fd, sq_size, flags=flags, prot=prot, offset=IORING_OFF_SQ_RING)
        self._mmaps.append(sq_mm)
        if p.features & IORING_FEAT_SINGLE_MMAP:
            cq_mm = sq_mm
        else:
            cq_mm = mmap.mmap(fd, cq_size, flags=flags, prot=prot, offset=IORING_OFF_CQ_RING)
            self._mmaps.append(cq_mm)
        sqe_mm = mmap.mmap(fd, p.sq_entries * ctypes.sizeof(_SQE), flags=flags, prot=prot, offset=IORING_OFF_SQES)
        self._mmaps.append(sqe_mm)
        u32 = ctypes.c_uint32
        self._sq_head = u32.from_buffer(sq_mm, p.sq_off.head)
        self._sq_tail = u32.from_buffer(sq_mm, p.sq_off.tail)
        self._sq_mask = u32.from_buffer(sq_mm, p.sq_off.ring_mask).value
        self._sq_array = (u32 * p.sq_entries).from_buffer(sq_mm, p.sq_off.array)
        self._sqes = (_SQE * p.sq_entries).from_buffer(sqe_mm)
        self._cq_head = u32.from_buffer(cq_mm, p.cq_off.head)
        self._cq_tail = u32.from_buffer(cq_mm, p.cq_off.tail)
        self._cq_mask = u32.from_buffer(cq_mm, p.cq_off.ring_mask).value
        self._cqes = (_CQE * p.cq_entries).from_buffer(cq_mm, p.cq_off.cqes)

    def _probe_rw(self) -> bool:
        """True if the kernel has IORING_OP_READ/WRITE (5.6+); else we use READV/WRITEV."""
        probe = _Probe()
        ret = _register(self._ring_fd, IORING_REGISTER_PROBE, ctypes.byref(probe), 256)
        if ret < 0:
            return False
        ops = probe.ops
        return all(
            op <= probe.last_op and ops[op].flags & IO_URING_OP_SUPPORTED for op in (IORING_OP_READ, IORING_OP_WRITE)
        )

    def _release_rings(self) -> None:
        for name in ("_sq_head", "_sq_tail", "_sq_array", "_sqes", "_cq_head", "_cq_tail", "_cqes"):
            self.__dict__.pop(name, None)  # ctypes views hold buffer exports; drop them first
        for mm in self._mmaps:
            try:
                mm.close()
            except BufferError:  # a view still alive somewhere; the GC will unmap it later
                pass
        self._mmaps.clear()
        if self._ring_fd >= 0:
            os.close(self._ring_fd)
            self._ring_fd = -1

    # -- public API -----------------------------------------------------------------------
    def caps(self) -> QueueCaps:
        devs = {fd: m for fd, m in self._device_max_io.items() if m is not None}
        return QueueCaps(
            backend=self.name,
            alignment=ALIGN,
            max_io_bytes=self._max_io,
            queue_depth=self._sq_entries,
            max_in_flight=self._max_in_flight,
            direct_io=all(self._direct.values()) if self._direct else True,
            extra={
                "cq_entries": self._cq_entries,
                "features": self._features,
                "op_read_write": self._use_rw,
                "buffered_fds": sorted(fd for fd, d in self._direct.items() if not d),
                "device_max_sectors_bytes": devs,
                "fixed_buffers": len(self._fixed),
                "ops": dict(self._ops),
            },
        )

    def open_file(self, path: str | os.PathLike, write: bool = False, create: bool = False, *,
                  dir_fd: int | None = None) -> int:
        fd, direct = open_direct(path, write=write, create=create, dir_fd=dir_fd, prefer=self._prefer_direct)
        if not direct and self._prefer_direct and not self._said_buffered:
            # once per queue: a RAM root refuses O_DIRECT for every slab (a line each filled the log)
            self._said_buffered = True
            log.info("tutti uring: %s refuses O_DIRECT; using buffered IO for it and any other file that "
                     "refuses it (said once)", path)
        self._direct[fd] = direct
        self._device_max_io[fd] = _block_device_max_io(fd)
        return fd

    def is_direct(self, fd: int) -> bool | None:
        """Whether `fd` (opened by open_file) got O_DIRECT; None if this queue did not open it."""
        return self._direct.get(fd)

    def register_buffers(self, buffers: Sequence[torch.Tensor]) -> None:
        """Register staging buffers as io_uring fixed buffers (pages pinned once, not per IO).

        Replaces any earlier registration; waits for in-flight IO first because the kernel
        refuses to unregister buffers that requests still use.
        """
        pieces: list[tuple[int, int]] = []
        for i, t in enumerate(buffers):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"register_buffers: buffers[{i}] must be a contiguous CPU tensor")
            start, nbytes = t.data_ptr(), t.numel() * t.element_size()
            if nbytes == 0:
                raise ValueError(f"register_buffers: buffers[{i}] is empty")
            for off in range(0, nbytes, MAX_FIXED_BUFFER):
                pieces.append((start + off, min(MAX_FIXED_BUFFER, nbytes - off)))
        if len(pieces) > 16384:
            raise ValueError(f"register_buffers: {len(pieces)} pieces of <= 1 GiB; the kernel takes at most 16384")
        self.drain()
        with self._lock:
            if self._fixed:
                _register(self._ring_fd, IORING_UNREGISTER_BUFFERS, None, 0)
                self._fixed, self._fixed_starts, self._fixed_owners = [], [], []
            if not pieces:
                return
            iovs = (_IOVec * len(pieces))(*[_IOVec(a, n) for a, n in pieces])
            ret = _register(self._ring_fd, IORING_REGISTER_BUFFERS, iovs, len(pieces))
            if ret < 0:
                hint = " (raise RLIMIT_MEMLOCK / ulimit -l)" if -ret in (errno.ENOMEM, errno.EPERM) else ""
                raise _os_error(-ret, f"io_uring_register(BUFFERS, {len(pieces)} buffers){hint}")
            table = sorted((a, a + n, idx) for idx, (a, n) in enumerate(pieces))
            self._fixed = table
            self._fixed_starts = [a for a, _, _ in table]
            self._fixed_owners = list(buffers)  # registered memory must outlive the registration

    def submit(self, requests: Sequence[IORequest]) -> list[IOFuture]:
        requests = list(requests)
        for req in requests:
            check_request(req, ALIGN, self._max_io)
        if not requests:
            return []
        futures: list[IOFuture] = []
        with self._lock:
            if self._closing:
                raise RuntimeError("UringQueue.submit: the queue is closed")
            if self._dead is not None:
                raise RuntimeError("UringQueue.submit: the completion thread died") from self._dead
            tail = self._sq_tail_local
            sq_free = self._sq_entries - ((tail - self._sq_head.value) & 0xFFFFFFFF)
            room = min(len(requests), sq_free, self._max_in_flight - self._outstanding)
            if room <= 0:
                return []
            for req in requests[:room]:
                uid = next(self._ids)
                fut = IOFuture(req)
                keep = self._prep(tail & self._sq_mask, req, uid)
                self._inflight[uid] = (fut, keep)
                self._outstanding += 1
                futures.append(fut)
                tail = (tail + 1) & 0xFFFFFFFF
            self._publish(tail)
        return futures

    def close(self) -> None:
        if self._ring_fd < 0:
            return
        with self._lock:
            if self._closing:
                return
        self.drain()
        with self._lock:
            self._closing = True
            tail = self._sq_tail_local
            sqe = self._sqes[tail & self._sq_mask]
            ctypes.memset(ctypes.addressof(sqe), 0, ctypes.sizeof(_SQE))
            sqe.opcode = IORING_OP_NOP
            sqe.fd = -1
            sqe.user_data = _WAKE
            self._sq_array[tail & self._sq_mask] = tail & self._sq_mask
            self._publish((tail + 1) & 0xFFFFFFFF)
        self._reaper.join()
        self._fixed_owners = []
        self._release_rings()

    def __del__(self) -> None:  # best effort; close() explicitly (or use `with`)
        if getattr(self, "_ring_fd", -1) >= 0 and not getattr(self, "_closing", True):
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass

    # -- internals ------------------------------------------------------------------------
    def _fixed_index(self, addr: int, length: int) -> int | None:
        i = bisect.bisect_right(self._fixed_starts, addr) - 1
        if i >= 0:
            start, end, idx = self._fixed[i]
            if addr + length <= end:
                return idx
        return None

    def _prep(self, idx: int, req: IORequest, uid: int):
        """Fill SQE `idx` for `req`; returns whatever must stay alive until completion."""
        sqe = self._sqes[idx]
        ctypes.memset(ctypes.addressof(sqe), 0, ctypes.sizeof(_SQE))
        addr = req.buffer_address()
        is_read = req.op == READ
        keep = None
        buf_index = self._fixed_index(addr, req.length) if self._fixed else None
        if buf_index is not None:
            sqe.opcode = IORING_OP_READ_FIXED if is_read else IORING_OP_WRITE_FIXED
            sqe.addr = addr
            sqe.len = req.length
            sqe.buf_index = buf_index
            self._ops["fixed"] += 1
        elif self._use_rw:
            sqe.opcode = IORING_OP_READ if is_read else IORING_OP_WRITE
            sqe.addr = addr
            sqe.len = req.length
            self._ops["plain"] += 1
        else:
            keep = _IOVec(addr, req.length)
            sqe.opcode = IORING_OP_READV if is_read else IORING_OP_WRITEV
            sqe.addr = ctypes.addressof(keep)
            sqe.len = 1
            self._ops["vectored"] += 1
        sqe.fd = req.fd
        sqe.off = req.offset
        sqe.user_data = uid
        self._sq_array[idx] = idx
        return keep

    def _publish(self, tail: int) -> None:
        """Store the SQ tail (entries are already written) and submit them with one syscall.

        Called with the lock held. The kernel normally consumes everything in one call; it stops
        early only when an SQE fails to initialise (that one still gets an error CQE), so the
        rest is pushed with further calls.
        """
        self._sq_tail.value = tail
        self._sq_tail_local = tail
        while True:
            pending = (tail - self._sq_head.value) & 0xFFFFFFFF
            if pending == 0:
                return
            ret = _enter(self._ring_fd, pending, 0, 0)
            if ret >= 0 or ret == -errno.EINTR:
                continue
            if ret in (-errno.EAGAIN, -errno.EBUSY):  # kernel short of memory / CQ backlog
                time.sleep(0.0005)
                continue
            raise _os_error(-ret, "io_uring_enter(submit)")

    def _reap_loop(self) -> None:
        try:
            while True:
                self._reap()
                with self._lock:
                    if self._closing and not self._outstanding:
                        return
                    # Wake once per few completions, not once per completion: each wake-up costs
                    # a thread switch and a GIL hand-off. Everything counted here is already in
                    # the kernel, so the wait always ends.
                    want = max(1, self._outstanding // self._reap_divisor)
                ret = _enter(self._ring_fd, 0, want, IORING_ENTER_GETEVENTS)
                if ret < 0 and ret != -errno.EINTR:
                    raise _os_error(-ret, "io_uring_enter(GETEVENTS)")
        except BaseException as exc:  # noqa: BLE001 - fail every waiter rather than hang them
            log.exception("tutti uring: completion thread died")
            with self._cond:
                self._dead = exc
                stuck = list(self._inflight.values())
                self._inflight.clear()
            for fut, _ in stuck:
                fut.set_exception(exc)
            with self._cond:
                self._outstanding -= len(stuck)
                self._cond.notify_all()

    def _reap(self) -> int:
        head = self._cq_head.value
        tail = self._cq_tail.value  # read the tail before the entries it covers
        if head == tail:
            return 0
        got = []
        cqes, mask = self._cqes, self._cq_mask
        while head != tail:
            cqe = cqes[head & mask]
            got.append((cqe.user_data, cqe.res))
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head.value = head  # hand the slots back only after reading them
        done = []
        with self._lock:
            for uid, res in got:
                entry = self._inflight.pop(uid, None)
                if entry is not None:
                    done.append((entry[0], res))
        for fut, res in done:
            try:
                fut.set_result(res)  # negative -> errno error, short -> EIO error, both naming the request
            except Exception:  # noqa: BLE001 - a caller's callback must not kill the reaper
                log.exception("tutti uring: done-callback raised")
        with self._cond:
            self._outstanding -= len(done)
            self._completed += len(done)
            self._cond.notify_all()
        return len(done)
