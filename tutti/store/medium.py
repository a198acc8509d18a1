"""Where a store's slab bytes live: the medium. The store keeps its namespace, manifests, lock and
journal on the root's file system whatever the medium; a medium says how a slab is opened (a
descriptor the IO queue reads and writes), made durable and reserved.

`FileMedium` ("file", the default) is slab files in the namespace directory, opened through the IO
backend (O_DIRECT where it asks for it) and checked as every store file is (tutti.io.safefs: no
links, ours or the sharing group's). Another medium registers a name (`register_medium`) or is
named as "package.module:attr" by the `medium` key; tests/store/memory_medium.py keeps slabs in
memory (memfd) as a worked example.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable, Protocol

from tutti.io.safefs import Access, check_fd, open_file
from tutti.store.namespace import exists
from tutti.plugins import Registry

OpenHook = Callable[[str, bool, int], int]  # (name, writer, dir_fd) -> fd: the IO backend's open


class Medium(Protocol):
    name: str

    def open_slab(self, name: str, *, writer: bool, dir_fd: int, path: str, access: Access) -> int:
        """A descriptor of slab `name` (a writer creates it); OSError(ENOENT) for a reader when
        no chunk was ever stored there."""

    def sync(self, fd: int) -> None:
        """Make what was written through `fd` durable (before its journal record is)."""

    def reserve(self, fd: int, length: int) -> None:
        """Back [0, length) with real storage before it is mapped writable (see FileMedium.reserve)."""


class FileMedium:
    """Slab files on the root's file system (the store's format, docs/format.md)."""

    name = "file"

    def __init__(self, open_hook: OpenHook | None = None) -> None:
        self.open_hook = open_hook  # the IO backend's open (its flags: O_DIRECT, registered files)

    def open_slab(self, name: str, *, writer: bool, dir_fd: int, path: str, access: Access) -> int:
        if writer:
            try:
                os.close(open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd, access=access,
                                   where=f"slab {path!r}"))
                os.fsync(dir_fd)  # the new name must survive a crash with the data under it
            except FileExistsError:
                pass
        elif not exists(name, dir_fd):
            raise OSError(errno.ENOENT, f"slab file {path!r} is missing (no chunk was ever stored there)", path)
        if self.open_hook is not None:
            fd = self.open_hook(name, writer, dir_fd)
        else:
            fd = open_file(name, os.O_RDWR if writer else os.O_RDONLY, dir_fd=dir_fd, check=False)
        try:
            check_fd(fd, f"slab {path!r}", access=access)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def sync(self, fd: int) -> None:
        os.fdatasync(fd)

    def reserve(self, fd: int, length: int) -> None:
        """Back [0, length) of a writer's slab with real blocks (pages, on tmpfs) before it is mapped
        writable. A sparse slab is a promise the file system may break: once /dev/shm or the disk
        fills (another server, NCCL, torch), the first copy into an unbacked page of the mapping
        gets SIGBUS, which kills the server, where a write() would have failed one store with
        ENOSPC. posix_fallocate raises ENOSPC now instead, and leaves the file as it was (tmpfs and
        ext4 undo a partial allocation), so the slab stays on the file path."""
        if os.fstat(fd).st_size >= length and not has_hole(fd, 0, length):
            return
        os.posix_fallocate(fd, 0, length)


def has_hole(fd: int, start: int, end: int) -> bool:
    try:
        return os.lseek(fd, start, os.SEEK_HOLE) < end
    except OSError:
        return True  # no SEEK_HOLE support: assume the worst and write the zeros


_REGISTRY = Registry("medium", "register_medium", {"file": FileMedium}, ("open_slab", "sync", "reserve"),
                     fresh=True, doc="tutti.store.medium.Medium")
#: (name, class or factory taking the IO backend's open): choosable as the `medium` key's value
register_medium = _REGISTRY.register
available_media = _REGISTRY.names


def get_medium(spec: Any, open_hook: OpenHook | None = None) -> Medium:
    """The medium `spec` names (a registered name or "package.module:attr"), built over the IO
    backend's open; ValueError naming the `medium` key otherwise."""
    return _REGISTRY.get(spec, open_hook)


def check_medium(spec: Any) -> None:
    """`spec` names a medium (checked before any IO; ValueError naming the key otherwise)."""
    _REGISTRY.resolve(spec)
