"""A storage medium that keeps slabs in memory (memfd): the worked example of tutti.store.medium.

Each slab is an anonymous in-memory file (`os.memfd_create`), found again by its namespace
directory and name for as long as this process lives; the IO backends read and write it like any
file. Volatile: after a restart the journal (still on the root) names chunks whose bytes are gone,
and every such load fails its checksum and is recomputed, never served."""

from __future__ import annotations

import errno
import os

from tutti.io.safefs import Access

_SLABS: dict[tuple[int, int, str], int] = {}  # (dir device, dir inode, name) -> the memfd every open dups


class MemoryMedium:
    name = "memory"

    def __init__(self, open_hook=None) -> None:  # noqa: ARG002 - no file to open through the IO backend
        pass

    def open_slab(self, name: str, *, writer: bool, dir_fd: int, path: str, access: Access) -> int:
        st = os.fstat(dir_fd)
        key = (st.st_dev, st.st_ino, name)
        fd = _SLABS.get(key)
        if fd is None:
            if not writer:
                raise OSError(errno.ENOENT, f"slab {path!r} is not in memory (no chunk stored there)", path)
            fd = _SLABS[key] = os.memfd_create(f"tutti-{name}")
        return os.dup(fd)  # the store closes its descriptors; the memory stays with ours

    def sync(self, fd: int) -> None:
        pass  # memory: nothing to make durable (the medium is volatile by design)

    def reserve(self, fd: int, length: int) -> None:
        if os.fstat(fd).st_size < length:
            os.posix_fallocate(fd, 0, length)
