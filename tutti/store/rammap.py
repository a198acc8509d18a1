"""Slab files on a RAM file system, mapped once and registered for DMA.

Why: on tmpfs a "read" is a memcpy from the page cache into a staging buffer, and then a second
copy to the GPU; the file's pages already are host memory. Mapped shared and registered with
CUDA (cudaHostRegister), a segment goes to the device in one DMA straight from the page cache,
with no system call and no host copy. The store format does not change: the same slab files,
the same journal, so a root moved between a disk and tmpfs stays readable.

Only where the files are ours alone: a mapping of a file that someone else truncates faults
(SIGBUS) instead of failing one read, so shared stores (Access with a group) keep the file path.
A writer maps its slabs writable: its stores copy a chunk from the device straight into the
slot (one DMA, no write system call, no host staging), and only after the journal's free
record for the slot is durable (the store pipeline's writer thread orders the two).
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from typing import Callable

import torch

from tutti.io.cudahost import host_register, host_unregister

log = logging.getLogger("tutti.io")

RAM_FILESYSTEMS = ("tmpfs", "ramfs")
_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the mapping is PROT_READ


def fs_type(path: str) -> str:
    """The file system type of `path` (its nearest existing ancestor), from /proc/mounts."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    p = os.path.realpath(p)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def register_host(addr: int, nbytes: int, read_only: bool = True) -> Callable[[], None] | None:
    """Page-lock [addr, addr + nbytes) for DMA; returns the undo, or None without CUDA or when
    the driver refuses (the copy then goes through CUDA's own staging: slower, still correct)."""
    if not torch.cuda.is_available():
        return None
    err = host_register(addr, nbytes, _REGISTER_READ_ONLY if read_only else 0)  # a refusal leaves no error
    if err != 0:
        log.warning("tutti: cudaHostRegister of a %d B slab mapping failed (error %d); loads from it are "
                    "copied through CUDA's staging instead of one DMA", nbytes, err)
        return None
    return lambda: host_unregister(addr)


class SlabMaps:
    """One shared mapping per slab file, with a uint8 tensor over it: read-only for a reader,
    writable for the store's own writer (its stores copy into it)."""

    def __init__(self, register: bool = True, writable: bool = False) -> None:
        self.register = register
        self.writable = writable
        self._maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor, Callable[[], None] | None]] = {}
        self.registered_bytes = 0
        self.mapped_bytes = 0

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        entry = self._maps.get(key)
        return None if entry is None else entry[1]

    def map(self, key: tuple[int, int], fd: int, nbytes: int) -> torch.Tensor | None:
        """Map `nbytes` of slab `key` from `fd` if the file is that long; None otherwise (file path)."""
        if key in self._maps:
            return self._maps[key][1]
        if os.fstat(fd).st_size < nbytes:
            return None
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
        with warnings.catch_warnings():  # a reader's is read-only on purpose: nothing may write through it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(mm, dtype=torch.uint8)
        undo = register_host(tensor.data_ptr(), nbytes, read_only=not self.writable) if self.register else None
        if undo is not None:
            self.registered_bytes += nbytes
        self._maps[key] = (mm, tensor, undo)
        self.mapped_bytes += nbytes
        return tensor

    def close(self) -> None:
        """Unregister and unmap (after every load from the maps is done)."""
        maps, self._maps = self._maps, {}
        for _, _, undo in maps.values():
            if undo is not None:
                undo()
        mms = [mm for mm, _, _ in maps.values()]
        maps.clear()  # drops the tensors, and with them the buffer exports
        for mm in mms:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes with it
                pass
        self.registered_bytes = self.mapped_bytes = 0

    def __len__(self) -> int:
        return len(self._maps)
