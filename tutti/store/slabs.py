"""A store's slab files: where each slot lives, the open descriptors, the RAM mappings.

Slots live in large slab files (not one file per chunk: file creation and deletion cost more than
the IO of a small chunk), striped over the roots: slot s lives under root s % len(roots), in slab
(s // len(roots)) // slots_per_slab of it (`place`). Descriptors stay open, least recently used
first, up to `max_open_slabs` unless IO in flight pins more: a descriptor is closed only when no
IO uses it, since its number could otherwise be reused by the next open and the IO hit another
file. On RAM roots the slabs can be mapped and registered for DMA (`tutti.store.rammap`), at a
server's start-up (`map_all`). `tutti.store.chunk_store.ChunkStore` composes these with the namespace
and the journal; `tutti.tools.storetools` places slots with the same `place`.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections import OrderedDict

from tutti.io.safefs import Access
from tutti.store.medium import Medium, has_hole
from tutti.store.namespace import Namespace, free_bytes, log_once, slab_sort_key

DEFAULT_MAX_OPEN_SLABS = 256
_ZERO_BYTES = 1 << 20


def place(slot: int, num_roots: int, slots_per_slab: int, slot_bytes: int) -> tuple[int, int, int]:
    """slot -> (root index, slab index, byte offset of the slot in that slab)."""
    local = slot // num_roots
    return slot % num_roots, local // slots_per_slab, (local % slots_per_slab) * slot_bytes


def slab_name(slab: int) -> str:
    return f"slab-{slab}.bin"


class Slabs:
    """The slab files of one store (its namespace's directories), opened and mapped on demand.
    Every method but `place` expects the caller to hold `mutex` (the store's)."""

    def __init__(self, ns: Namespace, *, writer: bool, access: Access, num_slots: int, slot_bytes: int,
                 slots_per_slab: int, max_open_slabs: int, medium: Medium, map_ram: bool,
                 mutex: threading.RLock) -> None:
        self.ns = ns
        self.writer = writer
        self.access = access
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.slots_per_slab = slots_per_slab
        self.max_open_slabs = max_open_slabs
        self.medium = medium  # tutti.store.medium: how a slab is opened, synced and reserved
        self.mutex = mutex
        self.fds: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.pins: dict[tuple[int, int], int] = {}
        self.slabs_closed = 0  # descriptors closed to stay within max_open_slabs
        self.unsynced: set[tuple[int, int]] = set()  # closed by trim; sync opens them again
        # Loads straight from mapped slabs (RAM file systems; see tutti.store.rammap): private stores only.
        self.maps = None
        if map_ram and not access.shared:
            from tutti.store.rammap import SlabMaps

            self.maps = SlabMaps(writable=writer)
        self.maps_every_slab = False  # map_all mapped the writer's whole capacity: stores copy into the maps
        self._zeros: mmap.mmap | None = None
        self.closed = False

    def place(self, slot: int) -> tuple[int, int, int]:
        return place(slot, len(self.ns.roots), self.slots_per_slab, self.slot_bytes)

    # ---- descriptors ----------------------------------------------------------------------
    def pin(self, k: tuple[int, int]) -> None:
        self.pins[k] = self.pins.get(k, 0) + 1

    def unpin(self, k: tuple[int, int]) -> None:
        n = self.pins.get(k, 0) - 1
        if n > 0:
            self.pins[k] = n
        else:
            self.pins.pop(k, None)
            self.trim()

    def fd(self, r: int, slab: int) -> int:
        """The descriptor of slab `slab` under root r, opened (a writer: created) on first use."""
        fd = self.fds.get((r, slab))
        if fd is not None:
            self.fds.move_to_end((r, slab))
            return fd
        fd = self.open(r, slab)
        self.trim()
        return fd

    def trim(self) -> None:
        """Close least recently used slab descriptors no IO holds, down to max_open_slabs. Caller
        holds the mutex. Data a writer wrote through a closed descriptor is synced by sync(),
        which opens the file again (fdatasync acts on the file, not the descriptor)."""
        if len(self.fds) <= self.max_open_slabs or self.closed:
            return
        for k in list(self.fds):
            if len(self.fds) <= self.max_open_slabs:
                break
            if k in self.pins or k == next(reversed(self.fds)):
                continue
            fd = self.fds.pop(k)
            if self.writer:
                self.unsynced.add(k)
            os.close(fd)
            self.slabs_closed += 1

    def open(self, r: int, slab: int) -> int:
        name = slab_name(slab)
        path = os.path.join(self.ns.paths[r], name)
        ns_fd = self.ns.fd(r)
        if ns_fd is None:
            raise OSError(errno.ENOENT, f"slab file {path!r} is missing (namespace not created yet)", path)
        fd = self.medium.open_slab(name, writer=self.writer, dir_fd=ns_fd, path=path, access=self.access)
        self.fds[(r, slab)] = fd
        if self.maps is not None and self.writer and self.maps.get((r, slab)) is None:
            self.map_slab(r, slab)  # mostly the writer thread's first store there: off the load path
        return fd

    def zero_fill(self, s: int, fd: int, start: int, end: int) -> None:
        if os.fstat(fd).st_size >= end and not has_hole(fd, start, end):
            return
        if self._zeros is None:
            self._zeros = mmap.mmap(-1, _ZERO_BYTES)  # page aligned: also fine for O_DIRECT fds
        pos = start
        while pos < end:
            n = os.pwrite(fd, memoryview(self._zeros)[: min(_ZERO_BYTES, end - pos)], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"zero-fill of slot {s} wrote {n} bytes")
            pos += n

    # ---- RAM mappings ---------------------------------------------------------------------
    def mapped(self, r: int, slab: int, off: int, n: int, sizes: dict | None = None):
        """The mapping's bytes [off, off + n) of slab `slab` under root r, or None (not mapped,
        or the file shorter than that: a slab that shrank under its mapping, a restore, `: >
        slab-0.bin`, is never touched through it, since past the file's end the mapping faults
        (SIGBUS) instead of failing one read; the file path reads it short and fails the chunk).
        `sizes`: the caller's cache of file sizes for one step, so a 127-chunk load makes one
        fstat per slab, not one per chunk (each a GIL release beside vLLM's spinning loop)."""
        t = self.maps.get((r, slab))
        if t is None:
            t = self.map_slab(r, slab)
        if t is None:
            return None
        sizes = {} if sizes is None else sizes
        size = sizes.get((r, slab))
        if size is None:
            size = sizes[(r, slab)] = os.fstat(self.fd(r, slab)).st_size
        return None if size < off + n or off + n > t.numel() else t[off:off + n]

    def length(self, r: int, slab: int) -> int:
        """Bytes of slab `slab` under root r: whole slots of the capacity, never past it."""
        nroots = len(self.ns.roots)
        local_slots = (self.num_slots - r + nroots - 1) // nroots
        return max(0, min(self.slots_per_slab, local_slots - slab * self.slots_per_slab)) * self.slot_bytes

    def map_slab(self, r: int, slab: int):
        """Map one slab; a writer first reserves every byte of its slots (`reserve`)."""
        length = self.length(r, slab)
        try:
            fd = self.fd(r, slab)
            if self.writer:
                self.medium.reserve(fd, length)
            return self.maps.map((r, slab), fd, length)
        except OSError as exc:
            # ENOENT (no chunk stored there yet), ENOSPC (the file system cannot back it),
            # ENOMEM...: the file path still works, and fails a store cleanly where space lacks
            if exc.errno != errno.ENOENT:
                log_once(f"tutti: slab {r}/{slab} cannot be mapped ({exc}); it is read and written through "
                         "the file")
            return None

    def map_all(self) -> int:
        """Map (and register) every slab file at a server's start-up, so that no request, and no
        store while the server serves, pays for pinning pages (cudaHostRegister takes CUDA's
        locks: beside the step it stalls it). A writer first creates every slab of its capacity
        (reserved, as long as its slots: `reserve`): the whole capacity is then pinned RAM, as vLLM
        pins its CPU tier. A slab the file system cannot reserve stays unmapped, and stores keep
        the file path. Returns the bytes mapped."""
        if self.maps is None:
            return 0
        with self.mutex:
            every = self.writer
            for r in range(len(self.ns.paths)):
                ns_fd = self.ns.fd(r)
                if ns_fd is None:
                    continue
                local_slots = (self.num_slots - r + len(self.ns.roots) - 1) // len(self.ns.roots)
                free = free_bytes(ns_fd)
                if free is not None:  # what our slabs already hold (reserved by an earlier start) counts as ours
                    free += _allocated_bytes(ns_fd)
                if self.writer and free is not None and free < local_slots * self.slot_bytes:
                    # pinning the pages of a capacity the file system cannot hold would fault the
                    # server (SIGBUS past a tmpfs's size): map what exists, the rest when created
                    log_once(f"tutti: root {self.ns.roots[r]!r} has {free} B free for a capacity of "
                             f"{local_slots * self.slot_bytes} B: slabs are mapped as they are created, "
                             "which registers them with CUDA while serving; lower capacity_bytes to the "
                             "file system's free space to map them all at start-up")
                if self.writer and (free is None or free >= local_slots * self.slot_bytes):
                    slabs = range(-(-local_slots // self.slots_per_slab))
                else:
                    every = False
                    slabs = sorted({slab_sort_key(name)[0] for name in os.listdir(ns_fd)} - {-1})
                for slab in slabs:
                    if self.length(r, slab) and self.maps.get((r, slab)) is None:
                        if self.writer:
                            self.fd(r, slab)  # creates it (and maps it: open)
                        if self.maps.get((r, slab)) is None:
                            self.map_slab(r, slab)
                    every = every and (not self.length(r, slab) or self.maps.get((r, slab)) is not None)
            self.maps_every_slab = every
            return self.maps.mapped_bytes

    def sync(self, keys) -> None:
        """fdatasync these slabs ((root, slab) pairs) where this writer wrote through them."""
        for k in sorted(keys):
            if k not in self.fds and k not in self.unsynced:
                continue  # never opened by this writer: nothing of ours to sync there
            self.medium.sync(self.fd(*k))  # opens a closed one again
            self.unsynced.discard(k)

    def close(self) -> None:
        self.closed = True
        if self.maps is not None:
            self.maps.close()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        if self._zeros is not None:
            self._zeros.close()
            self._zeros = None

    def close_quietly(self) -> None:
        """From a finalizer: close the descriptors, never raise."""
        self.closed = True
        for fd in list(self.fds.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


def _allocated_bytes(ns_fd: int) -> int:
    """Bytes the file system has allocated to the slab files in a namespace directory."""
    total = 0
    for name in os.listdir(ns_fd):
        if slab_sort_key(name)[0] < 0:
            continue
        try:
            total += os.stat(name, dir_fd=ns_fd, follow_symlinks=False).st_blocks * 512
        except OSError:
            pass
    return total
