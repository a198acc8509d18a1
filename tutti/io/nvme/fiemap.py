"""File offsets to device byte offsets through FIEMAP, resolved once per file and cached.

The store's slab files live on the ext4 that tutti_daemon mounts on the snvme namespace, so
a slab's extents say where its bytes are on the namespace. Slabs are written (never
fallocated), so an unwritten extent or a hole inside a requested range means the file is not
what the store wrote: it is refused rather than read as garbage.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import os
import threading
from dataclasses import dataclass

from .uapi import _IOWR

FIEMAP_FLAG_SYNC = 0x1  # flush the file's dirty pages before mapping (no delalloc extents)
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNKNOWN = 0x2
FIEMAP_EXTENT_DELALLOC = 0x4
FIEMAP_EXTENT_ENCODED = 0x8
FIEMAP_EXTENT_DATA_ENCRYPTED = 0x80
FIEMAP_EXTENT_NOT_ALIGNED = 0x100
FIEMAP_EXTENT_DATA_INLINE = 0x200
FIEMAP_EXTENT_DATA_TAIL = 0x400
FIEMAP_EXTENT_UNWRITTEN = 0x800
FIEMAP_EXTENT_MERGED = 0x1000
FIEMAP_EXTENT_SHARED = 0x2000

#: Extents whose bytes are not simply "file data at fe_physical on the device".
_UNREADABLE = {
    FIEMAP_EXTENT_UNWRITTEN: "unwritten (fallocated, never written: the filesystem reads it as zeros)",
    FIEMAP_EXTENT_UNKNOWN: "location unknown",
    FIEMAP_EXTENT_DELALLOC: "delayed allocation (not on disk yet)",
    FIEMAP_EXTENT_ENCODED: "encoded (compressed)",
    FIEMAP_EXTENT_DATA_ENCRYPTED: "encrypted",
    FIEMAP_EXTENT_NOT_ALIGNED: "not block aligned",
    FIEMAP_EXTENT_DATA_INLINE: "inline in metadata",
    FIEMAP_EXTENT_DATA_TAIL: "packed tail",
}


class _Fiemap(ctypes.Structure):
    _fields_ = [
        ("fm_start", ctypes.c_uint64),
        ("fm_length", ctypes.c_uint64),
        ("fm_flags", ctypes.c_uint32),
        ("fm_mapped_extents", ctypes.c_uint32),
        ("fm_extent_count", ctypes.c_uint32),
        ("fm_reserved", ctypes.c_uint32),
    ]


class _FiemapExtent(ctypes.Structure):
    _fields_ = [
        ("fe_logical", ctypes.c_uint64),
        ("fe_physical", ctypes.c_uint64),
        ("fe_length", ctypes.c_uint64),
        ("fe_reserved64", ctypes.c_uint64 * 2),
        ("fe_flags", ctypes.c_uint32),
        ("fe_reserved", ctypes.c_uint32 * 3),
    ]


assert ctypes.sizeof(_Fiemap) == 32 and ctypes.sizeof(_FiemapExtent) == 56
FS_IOC_FIEMAP = _IOWR(ord("f"), 11, ctypes.sizeof(_Fiemap))

_BATCH = 256


@dataclass(frozen=True)
class Extent:
    logical: int  # byte offset in the file
    physical: int  # byte offset on the block device
    length: int
    flags: int = 0

    @property
    def end(self) -> int:
        return self.logical + self.length


@dataclass(frozen=True)
class Segment:
    """A piece of a request that is contiguous both in the file and on the device."""

    file_offset: int
    device_offset: int
    length: int


class ExtentError(OSError):
    """The requested file range has no plain on-disk location (hole, unwritten, ...)."""


def fiemap(fd: int, sync: bool = True) -> list[Extent]:
    """Every extent of the file open at `fd`, in file order (FS_IOC_FIEMAP, batched)."""
    buf = bytearray(ctypes.sizeof(_Fiemap) + _BATCH * ctypes.sizeof(_FiemapExtent))
    head = _Fiemap.from_buffer(buf)
    extents: list[Extent] = []
    start = 0
    while True:
        ctypes.memset(ctypes.addressof(head), 0, len(buf))
        head.fm_start = start
        head.fm_length = (1 << 64) - 1 - start
        head.fm_flags = FIEMAP_FLAG_SYNC if sync else 0
        head.fm_extent_count = _BATCH
        try:
            fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
        except OSError as exc:
            raise OSError(exc.errno, f"FS_IOC_FIEMAP on fd {fd} failed: {os.strerror(exc.errno or 0)} "
                                     "(the filesystem must support FIEMAP, e.g. ext4)") from exc
        n = head.fm_mapped_extents
        if n == 0:
            return extents
        arr = (_FiemapExtent * n).from_buffer(buf, ctypes.sizeof(_Fiemap))
        last = False
        for e in arr:
            extents.append(Extent(e.fe_logical, e.fe_physical, e.fe_length, e.fe_flags))
            last = last or bool(e.fe_flags & FIEMAP_EXTENT_LAST)
        if last:
            return extents
        start = extents[-1].end


class FileExtents:
    """A file's extents, sorted, with range translation."""

    def __init__(self, extents: list[Extent], name: str = "file") -> None:
        self.extents = sorted(extents, key=lambda e: e.logical)
        self.name = name
        self._starts = [e.logical for e in self.extents]
        for a, b in zip(self.extents, self.extents[1:]):
            if b.logical < a.end:
                raise ExtentError(errno.EIO, f"{name}: FIEMAP returned overlapping extents {a} and {b}")

    def translate(self, offset: int, length: int, align: int = 1) -> list[Segment]:
        """Device segments for file bytes [offset, offset+length); adjacent pieces of one
        physically contiguous run are merged, a range crossing extents is split."""
        out: list[Segment] = []
        pos, end = offset, offset + length
        i = bisect.bisect_right(self._starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(self.extents) or not (self.extents[i].logical <= pos < self.extents[i].end):
                nxt = self.extents[i + 1].logical if i + 1 < len(self.extents) else None
                gap_end = end if nxt is None else min(end, nxt)
                raise ExtentError(
                    errno.ENXIO,
                    f"{self.name}: bytes [{pos}, {gap_end}) have no extent (a hole or past the end of the "
                    "file); only written slab data can be read/written through the nvme backend",
                )
            e = self.extents[i]
            bad = [why for flag, why in _UNREADABLE.items() if e.flags & flag]
            if bad:
                raise ExtentError(
                    errno.EINVAL,
                    f"{self.name}: bytes [{e.logical}, {e.end}) are {', '.join(bad)}; the nvme backend only "
                    "addresses plainly written extents (write slabs, do not fallocate them)",
                )
            n = min(end, e.end) - pos
            dev = e.physical + (pos - e.logical)
            if align > 1 and dev % align:
                raise ExtentError(errno.EINVAL, f"{self.name}: device offset {dev} is not a multiple of the "
                                                f"{align} B logical block")
            if out and out[-1].device_offset + out[-1].length == dev:
                prev = out[-1]
                out[-1] = Segment(prev.file_offset, prev.device_offset, prev.length + n)
            else:
                out.append(Segment(pos, dev, n))
            pos += n
            i += 1
        return out


class FiemapResolver:
    """fd -> FileExtents, cached per (device, inode, size, mtime) so a rewritten file is re-mapped."""

    def __init__(self, expected_dev: int | None = None, device_name: str = "", max_entries: int = 4096) -> None:
        self.expected_dev = expected_dev
        self.device_name = device_name
        self.max_entries = max_entries
        self._cache: dict[tuple, FileExtents] = {}
        self._lock = threading.Lock()

    def resolve(self, fd: int) -> FileExtents:
        st = os.fstat(fd)
        if self.expected_dev is not None and st.st_dev != self.expected_dev:
            raise ExtentError(
                errno.EXDEV,
                f"fd {fd} (inode {st.st_ino}) is on device {os.major(st.st_dev)}:{os.minor(st.st_dev)}, not on "
                f"the snvme namespace {self.device_name or ''} "
                f"({os.major(self.expected_dev)}:{os.minor(self.expected_dev)}); "
                "put the store's slab directory on the tutti_daemon ext4 mount",
            )
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        fe = FileExtents(fiemap(fd), name=f"fd {fd} (inode {st.st_ino})")
        with self._lock:
            if len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = fe
        return fe

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()
