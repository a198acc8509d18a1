"""Page-aligned, optionally pinned staging buffers for direct IO.

`torch.empty` only guarantees 64-byte alignment, but O_DIRECT (and io_uring fixed buffers) need
the buffer address to be a multiple of the device's logical block size; Tutti asks for 4 KiB
everywhere. An anonymous mmap is page aligned by construction, costs no copy, and its pages can
be pinned for the GPU with cudaHostRegister.
"""

from __future__ import annotations

import mmap
import weakref

import numpy as np
import torch

from tutti.io.cudahost import host_register, host_unregister
from tutti.io.queue import ALIGN

_HUGE_PAGE = 2 << 20


def aligned_buffer(nbytes: int, *, pin: bool = True, huge: bool = True) -> torch.Tensor:
    """Return a zero-filled, 4 KiB-aligned uint8 CPU tensor of `nbytes` bytes backed by an anonymous mmap.

    Ownership: the tensor holds a numpy array (``torch.from_numpy`` keeps it as the storage's
    owner) and the array holds a buffer export on the mmap. We deliberately keep *no* reference
    to the mmap object itself: while an export exists ``mmap.close()`` raises BufferError, so no
    one can unmap the memory under a live tensor, and the mapping is released exactly when the
    last tensor view of it dies. Holding the mmap object on the side would let anyone close it
    (leaving the tensor pointing at unmapped memory: a segfault or, worse, silently wrong data
    once the address is reused), and would tie the memory's life to that side reference instead
    of to the tensor.

    `pin=True` page-locks the memory with cudaHostRegister when CUDA is available so that
    host<->device copies are DMA-able and asynchronous; it is a no-op on CPU-only machines. The
    registration is undone when the memory is released. `huge=True` asks for transparent huge
    pages on mappings of 2 MiB or more.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ValueError(f"aligned_buffer(nbytes={nbytes!r}): expected a positive int byte count")
    # Round the mapping up to whole 4 KiB units so every buffer can hold padded segments.
    mapped = -(-nbytes // ALIGN) * ALIGN
    mm = mmap.mmap(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if huge and mapped >= _HUGE_PAGE and hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # Transparent huge pages (where THP is in "madvise" mode): 512x fewer pages to pin for
        # io_uring fixed buffers and to map for DMA, which in a VM is most of the per-byte cost.
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP off: plain pages are just as correct
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
    del mm  # the array's buffer export keeps the mapping alive (see docstring)
    tensor = torch.from_numpy(arr)
    addr = tensor.data_ptr()
    if addr % ALIGN:  # an anonymous mmap is always page aligned; say so loudly if not
        raise RuntimeError(f"aligned_buffer: mmap returned address {addr:#x}, not {ALIGN}-aligned")
    if pin:
        _pin(arr, addr, mapped)
    return tensor


def is_aligned(obj: torch.Tensor | int, align: int = ALIGN) -> bool:
    """True if a tensor's data pointer (or a plain address/offset) is a multiple of `align`."""
    value = obj.data_ptr() if isinstance(obj, torch.Tensor) else int(obj)
    return value % align == 0


def _pin(owner: np.ndarray, addr: int, nbytes: int) -> bool:
    """cudaHostRegister the range and unregister it when `owner` (the memory's holder) dies."""
    if not torch.cuda.is_available():
        return False
    err = host_register(addr, nbytes, 0)
    if err != 0:
        raise RuntimeError(f"aligned_buffer: cudaHostRegister of {nbytes} B at {addr:#x} failed with error {int(err)}")
    # numpy clears weakrefs before it drops its buffer export, so this runs before the unmap.
    weakref.finalize(owner, host_unregister, addr)
    return True


def open_direct(path, write: bool = False, create: bool = False, *, dir_fd: int | None = None,
                mode: int = 0o600, prefer: bool = True) -> tuple[int, bool]:
    """Open `path` (relative to `dir_fd` when given; never through a symbolic link, never
    blocking on a FIFO) with O_DIRECT when the file system allows it; returns ``(fd, direct)``.

    Direct IO keeps the page cache out of the way (no double buffering of KV segments and
    honest device throughput). Some file systems refuse it with EINVAL (tmpfs before 6.6,
    some FUSE mounts); then the file is opened buffered and ``direct`` is False so the caller
    can record it — data stays correct either way, only the caching differs.
    """
    import errno
    import os

    from tutti.io.safefs import open_file

    flags = os.O_RDWR if write else os.O_RDONLY
    if create:
        flags |= os.O_CREAT
    o_direct = getattr(os, "O_DIRECT", 0) if prefer else 0  # prefer=False: the page cache on purpose
    if o_direct:
        try:
            return open_file(os.fspath(path), flags | o_direct, dir_fd=dir_fd, mode=mode, check=False), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return open_file(os.fspath(path), flags, dir_fd=dir_fd, mode=mode, check=False), False
