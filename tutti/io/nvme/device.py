"""Hardware bring-up: attach to /dev/ssnvme<N> as a libnvm client and build one queue pair.

Order: open the char device and check the ABI handshake ourselves (before libnvm touches
anything), wrap the fd with libnvm, create a queue group, map one page each for the SQ and
CQ rings plus a pool of PRP-list pages, add the user queue pair, then mmap BAR0 for the
doorbells. The doorbell offsets the kernel returns are cross-checked against CAP.DSTRD.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import mmap
import os
import platform
import re
import threading

import torch

from ..queue import IOQueue
from .backend import NvmeQueue
from .fiemap import FiemapResolver
from .libnvm import Libnvm, ctrl_page_size, dma_ioaddrs
from .qpair import QueuePair
from .spec import SQE_SIZE, doorbell_offsets
from .uapi import NvmIoctlAddUserQueue, NvmIoctlDev, get_dev_info

ENV_DEVICE = "TUTTI_SNVME_DEV"
DEVICE_GLOB = "/dev/ssnvme*"


def find_devices() -> list[str]:
    return sorted(glob.glob(DEVICE_GLOB))


def _addr_of(buf) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


class HostDma:
    """Host memory mapped for the controller: data buffers (mapped once each) and PRP lists."""

    def __init__(self, lib: Libnvm, ctrl: int, page_size: int, prp_slots: int) -> None:
        self.lib, self.ctrl, self.page_size = lib, ctrl, page_size
        self._regions: list[tuple[int, int, list[int], int, torch.Tensor | None]] = []  # start, end, iovas, handle, keep
        self._lock = threading.Lock()
        self._prp_mem = mmap.mmap(-1, prp_slots * page_size)
        self._prp_addr = _addr_of(self._prp_mem)
        self._prp_iovas = self._map(self._prp_addr, prp_slots * page_size, None)

    def _map(self, start: int, size: int, keep: torch.Tensor | None) -> list[int]:
        handle = self.lib.map_data_host(self.ctrl, start, size)
        ps, iovas = dma_ioaddrs(handle)
        if ps != self.page_size or len(iovas) != size // self.page_size:
            self.lib.dma_unmap(handle)
            raise OSError(errno.EIO, f"libnvm mapped 0x{start:x}+{size} as {len(iovas)} pages of {ps} B, "
                                     f"expected {size // self.page_size} of {self.page_size} B")
        self._regions.append((start, start + size, iovas, handle, keep))
        return iovas

    def ensure(self, buf: torch.Tensor) -> None:
        addr, n = buf.data_ptr(), buf.numel() * buf.element_size()
        start = addr - addr % self.page_size
        end = -(-(addr + n) // self.page_size) * self.page_size
        with self._lock:
            if self._find(start, end) is None:
                # Keep the tensor alive: the pages stay pinned and mapped until close().
                self._map(start, end - start, buf)

    def _find(self, start: int, end: int):
        for r in self._regions:
            if r[0] <= start and end <= r[1]:
                return r
        return None

    def pages(self, addr: int, length: int) -> list[int]:
        ps = self.page_size
        start = addr - addr % ps
        end = -(-(addr + length) // ps) * ps
        r = self._find(start, end)
        if r is None:
            raise OSError(errno.EFAULT, f"0x{addr:x}+{length} is not in memory mapped for the controller")
        first = (start - r[0]) // ps
        return r[2][first : first + (end - start) // ps]

    def prp_list(self, slot: int) -> tuple[int, int]:
        return self._prp_addr + slot * self.page_size, self._prp_iovas[slot]

    def close(self) -> None:
        for r in self._regions:
            self.lib.dma_unmap(r[3])
        self._regions.clear()


def _missing_hardware(device: str | None, libnvm: str | None) -> list[str]:
    from .libnvm import find_libnvm

    missing = []
    if device is None and not find_devices():
        missing.append(f"no {DEVICE_GLOB} character device (load the snvme module and start tutti_daemon)")
    elif device is not None and not os.path.exists(device):
        missing.append(f"{device} does not exist")
    lib = find_libnvm(libnvm)
    if lib is None or (os.path.sep in lib and not os.path.exists(lib)):
        missing.append(f"libnvm.so not found (pass libnvm= or set TUTTI_LIBNVM; looked for {lib or 'libnvm.so'})")
    return missing


def open_device_queue(device: str | None = None, libnvm: str | None = None, nsid: int | None = None,
                      depth: int | None = None) -> IOQueue:
    """Attach to an snvme controller as a client and return an NvmeQueue on a new queue pair."""
    device = device or os.environ.get(ENV_DEVICE) or None
    missing = _missing_hardware(device, libnvm)
    if missing:
        raise OSError(errno.ENODEV, "tutti nvme backend unavailable: " + "; ".join(missing))
    if device is None:
        devs = find_devices()
        if len(devs) > 1:
            raise ValueError(f"device=None: several snvme devices {devs}; pass device= or set {ENV_DEVICE}")
        device = devs[0]
    if platform.machine() not in ("x86_64", "AMD64"):
        # SQE stores must reach memory before the doorbell store; Python cannot emit a fence,
        # and only x86's store ordering makes the plain sequence correct.
        raise OSError(errno.ENOSYS, f"tutti nvme backend: {platform.machine()} is not supported (needs x86-64 store ordering)")
    return SnvmeClient(device, libnvm, nsid, depth).queue


class SnvmeClient:
    """Owns the libnvm controller handle, the group, the rings and BAR0 of one client."""

    def __init__(self, device: str, libnvm: str | None, nsid: int | None, depth: int | None) -> None:
        self.device = device
        self._undo: list = []
        try:
            self._bring_up(libnvm, nsid, depth)
        except BaseException:
            self.close()
            raise

    def _bring_up(self, libnvm, nsid, depth) -> None:
        fd = os.open(self.device, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._undo.append(lambda: os.close(fd))
        info: NvmIoctlDev = get_dev_info(fd, self.device)  # fail closed before libnvm runs
        self.info = info
        lba = int(info.block_size)
        disk = info.disk_name.decode(errors="replace")
        m = re.search(r"n(\d+)$", disk)
        dev_nsid = int(m.group(1)) if m else None
        if nsid is None:
            if dev_nsid is None:
                raise ValueError(f"nsid=None: cannot read a namespace id from disk name {disk!r}; pass nsid=")
            nsid = dev_nsid
        elif dev_nsid is not None and nsid != dev_nsid:
            raise ValueError(f"nsid={nsid}: the device's namespace is {disk!r} (nsid {dev_nsid})")

        self.lib = lib = Libnvm(libnvm)
        ctrl = lib.ctrl_init(fd)
        self._undo.append(lambda: lib.ctrl_free_client(ctrl))
        ps = ctrl_page_size(ctrl)
        if ps != mmap.PAGESIZE:
            raise OSError(errno.ENOSYS, f"{self.device}: controller page size {ps} B differs from the host page "
                                        f"{mmap.PAGESIZE} B; not supported by this binding")
        q_depth = int(info.q_depth)
        if depth is not None:
            # The kernel creates every user queue with q_depth entries; a smaller `depth` only
            # limits how many we keep outstanding.
            if depth < 2:
                raise ValueError(f"depth={depth}: need at least 2")
        if q_depth < 2 or q_depth * SQE_SIZE > ps:
            raise OSError(errno.ENOSYS, f"{self.device}: q_depth={q_depth} needs a {q_depth * SQE_SIZE} B SQ ring; "
                                        f"this client maps single-page rings ({ps} B): lower the queue depth")

        gid, max_q = lib.create_group(ctrl)
        ring_handles: list[int] = []

        def teardown_group() -> None:
            # Destroying the group deletes the I/O SQ+CQ and purges the ring maps in the
            # kernel; only then are libnvm's ring descriptors released.
            try:
                lib.destroy_group(ctrl, gid)
            finally:
                for h in ring_handles:
                    lib.dma_unmap(h)

        self._undo.append(teardown_group)
        sq_mem, cq_mem = mmap.mmap(-1, ps), mmap.mmap(-1, ps)
        self._keep = [sq_mem, cq_mem]
        sq_addr, cq_addr = _addr_of(sq_mem), _addr_of(cq_mem)
        ring_handles.append(lib.map_ring_host(ctrl, gid, sq_addr, ps, is_cq=False))
        ring_handles.append(lib.map_ring_host(ctrl, gid, cq_addr, ps, is_cq=True))
        dma = HostDma(lib, ctrl, ps, q_depth)
        self._undo.append(dma.close)

        req = NvmIoctlAddUserQueue()
        req.group_id, req.nr_pairs = gid, 1
        req.pairs[0].sq_vaddr, req.pairs[0].cq_vaddr = sq_addr, cq_addr
        lib.add_user_queue(ctrl, req)  # torn down by destroy_group
        out = req.out_pairs[0]
        qid = int(out.qid)
        want_sq, want_cq = doorbell_offsets(qid, int(info.dstrd))
        if (out.sq_doorbell_offset, out.cq_doorbell_offset) != (want_sq, want_cq):
            raise OSError(errno.EIO, f"{self.device}: kernel doorbells 0x{out.sq_doorbell_offset:x}/"
                                     f"0x{out.cq_doorbell_offset:x} for qid {qid} disagree with CAP.DSTRD="
                                     f"{info.dstrd} (0x{want_sq:x}/0x{want_cq:x})")
        if want_cq + 4 > info.bar0_size:
            raise OSError(errno.EIO, f"{self.device}: doorbell 0x{want_cq:x} beyond BAR0 ({info.bar0_size} B)")
        bar0 = mmap.mmap(fd, int(info.bar0_size), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        regs = memoryview(bar0).cast("I")
        self._undo.append(bar0.close)
        self._undo.append(regs.release)

        def sq_db(value: int, i=want_sq // 4) -> None:
            regs[i] = value  # one aligned 32-bit store, no read of the write-only register

        def cq_db(value: int, i=want_cq // 4) -> None:
            regs[i] = value

        cap = None if depth is None else min(depth, q_depth) - 1
        qp = QueuePair(memoryview(sq_mem), memoryview(cq_mem), q_depth, qid, sq_db, cq_db, max_outstanding=cap)
        block_dev = f"/dev/{disk}"
        try:
            expected_dev = os.stat(block_dev).st_rdev
        except OSError as exc:
            raise OSError(exc.errno, f"{block_dev}: the snvme namespace block device is missing: {exc.strerror}")
        resolver = FiemapResolver(expected_dev, block_dev)
        self.queue = NvmeQueue(
            qp, dma, resolver, lba_size=lba, max_transfer=int(info.max_data_size), nsid=nsid,
            on_close=self.close, drop_cache_after_write=True,
            extra={"device": self.device, "disk": disk, "group_id": gid, "max_queues": max_q,
                   "dstrd": int(info.dstrd), "libnvm": lib.path, "q_depth": q_depth},
        )

    def close(self) -> None:
        errors = []
        while self._undo:
            fn = self._undo.pop()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - keep tearing down, report the first
                errors.append(exc)
        if errors:
            raise errors[0]
