"""The on-disk chunk store: where each chunk's bytes live, and which of them are durable.

A chunk is the KV of `chunk_tokens` tokens for all layers of one rank; layer L of a chunk is
one segment of `segment_bytes` at `L * segment_bytes` inside the chunk's slot. Slots live in
large slab files (not one file per chunk: file creation and deletion cost more than the IO of a
small chunk), striped over the roots (one per drive): slot s lives under root s % len(roots).

Each fingerprint gets its own namespace directory `<root>/tutti-<digest>/` with a manifest; a
journal (in the first root) says which slot holds which chunk. The store moves no KV itself:
the engine asks `location()` for (fd, offset) pairs and does the IO through its queue, then
tells the store what became durable. The protocol that keeps a killed process from ever showing
a torn chunk is:

    record_free(slots); sync_journal()     # old contents invalid before they are overwritten
    ... write the segments ...; sync_data(slots)
    record_put(key, slot, checksums); sync_journal()   # visible only once the bytes are durable

One writer per namespace (an flock on `<ns>/LOCK` in every root). Readers take no lock and
never write: the scheduler replays the journal at start-up to learn what is stored.

The store composes three pieces, each in its own module: the namespace (directories, lock,
manifests: `tutti.store.namespace`), the slab files (placement, descriptors, RAM mappings:
`tutti.store.slabs`) and the journal (`tutti.store.journal`); it holds the durability order and the
slot checks.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from tutti.format import segment_offset, slot_bytes
from tutti.store.fingerprint import Fingerprint
from tutti.store.journal import Entry, Journal
from tutti.store.namespace import (  # noqa: F401 - the store's names, importable from here as before
    DEFAULT_SLOTS_PER_SLAB, JOURNAL, LOCK, MANIFEST, NAMESPACE_PREFIX, STORE_FORMAT, STORE_VERSION, WRITER_ID,
    WRITER_PREFIX, ManifestMismatchError, Namespace, NamespaceInfo, StoreLockedError, StoreRootError,
    WriterDirectoryTakenError, list_namespaces,
    list_writers, log_once, namespace_dir, slab_sort_key,
)
from tutti.io.safefs import PRIVATE, Access
from tutti.store.medium import FileMedium, Medium
from tutti.store.slabs import DEFAULT_MAX_OPEN_SLABS, Slabs, slab_name

__all__ = [
    "DEFAULT_MAX_OPEN_SLABS",
    "DEFAULT_SLOTS_PER_SLAB",
    "JOURNAL",
    "LOCK",
    "MANIFEST",
    "NAMESPACE_PREFIX",
    "STORE_FORMAT",
    "STORE_VERSION",
    "WRITER_PREFIX",
    "ChunkStore",
    "Entry",
    "ManifestMismatchError",
    "NamespaceInfo",
    "SlabInfo",
    "StoreLockedError",
    "StoreRootError",
    "StoreStats",
    "list_namespaces",
    "list_writers",
    "namespace_dir",
]


@dataclass(frozen=True)
class SlabInfo:
    path: str
    size_bytes: int  # file length
    allocated_bytes: int  # blocks actually backed on disk


@dataclass(frozen=True)
class StoreStats:
    """What `tutti inspect` shows about a store."""

    digest: str
    namespaces: tuple[str, ...]  # one namespace directory per root
    slot_bytes: int
    slots_used: int
    slots_total: int
    bytes_used: int
    capacity_bytes: int  # slots_total * slot_bytes (the requested capacity rounded down)
    slabs: tuple[SlabInfo, ...]
    journal_path: str
    journal_bytes: int
    journal_live_bytes: int


class ChunkStore:
    """Slots of `num_layers * segment_bytes` in slab files, plus the journal of what they hold."""

    def __init__(
        self,
        roots: str | os.PathLike | Sequence[str | os.PathLike],
        fingerprint: Fingerprint,
        *,
        capacity_bytes: int,
        writer: bool,
        slots_per_slab: int | None = None,
        open_file: Callable[[str, bool, int], int] | None = None,
        journal_compact_ratio: float = 4.0,
        journal_compact_min_bytes: int = 1 << 20,
        access: Access = PRIVATE,
        max_open_slabs: int = DEFAULT_MAX_OPEN_SLABS,
        map_ram: bool = False,
        writer_id: str = "",
        medium: "Medium | None" = None,
    ) -> None:
        # ---- argument checks, before any IO ----
        if not isinstance(access, Access):
            raise ValueError(f"access={access!r}: expected a tutti.io.safefs.Access (PRIVATE, or Access(gid) to share)")
        if not isinstance(fingerprint, Fingerprint):
            raise ValueError(f"fingerprint: expected a tutti.store.fingerprint.Fingerprint, got {type(fingerprint).__name__}")
        if isinstance(roots, (str, os.PathLike)):
            roots = [roots]
        roots = [os.path.abspath(os.fspath(r)) for r in roots]
        if not roots:
            raise ValueError("roots=[]: expected one directory, or a list with one directory per drive")
        if len({os.path.realpath(r) for r in roots}) != len(roots):
            raise ValueError(f"roots={roots}: a directory appears twice; give each drive's directory once")
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes={capacity_bytes!r}: expected a non-negative int byte count")
        if isinstance(max_open_slabs, bool) or not isinstance(max_open_slabs, int) or max_open_slabs < 1:
            raise ValueError(f"max_open_slabs={max_open_slabs!r}: expected a positive int (default {DEFAULT_MAX_OPEN_SLABS})")
        if slots_per_slab is not None and (not isinstance(slots_per_slab, int) or slots_per_slab < 1):
            raise ValueError(f"slots_per_slab={slots_per_slab!r}: expected a positive int (default {DEFAULT_SLOTS_PER_SLAB})")
        self.fingerprint = fingerprint
        self.digest = fingerprint.digest()
        self.roots: tuple[str, ...] = tuple(roots)
        self.writer = bool(writer)
        self.segment_bytes = fingerprint.segment_bytes
        self.num_layers = fingerprint.num_layers
        self.slot_bytes = slot_bytes(self.num_layers, self.segment_bytes)
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots == 0:
            raise ValueError(
                f"capacity_bytes={capacity_bytes}: holds no slot; one chunk needs slot_bytes={self.slot_bytes} "
                f"(num_layers={self.num_layers} x segment_bytes={self.segment_bytes}); pass at least {self.slot_bytes}"
            )
        self.access = access
        if not isinstance(writer_id, str) or (writer_id and not WRITER_ID.fullmatch(writer_id)):
            raise ValueError(f"writer_id={writer_id!r}: expected '' (the namespace's only writer) or 1-64 of "
                             "A-Z a-z 0-9 . _ - (one per server sharing the store, stable across its restarts)")
        self.writer_id = writer_id
        # The namespace directory stays the group's to write (other members add their writer
        # directories to it); a named writer's own directory and files are its owner's to write.
        self._ns_access = access
        if writer_id:
            self.access = access.owner_writes()
        # A writer's files live in its own directory of the namespace: `w-<writer_id>/` when
        # servers share it, the namespace directory itself for the only writer (writer_id '').
        self.ns = Namespace(self.roots, self.digest, {
            "digest": self.digest, "fingerprint": fingerprint.to_dict(), "segment_bytes": self.segment_bytes,
            "num_layers": self.num_layers, "slot_bytes": self.slot_bytes,
        }, writer=self.writer, writer_id=writer_id, access=self.access, ns_access=self._ns_access)
        self.namespaces = self.ns.paths
        self.max_open_slabs = max_open_slabs
        self.slabs: Slabs | None = None  # once the manifests gave slots_per_slab
        self._closed = False
        # IO threads may ask for locations while the engine thread records: guard the fd cache and journal.
        self._mutex = threading.RLock()
        self.journal: Journal | None = None
        try:
            present = [self.ns.prepare(i) for i in range(len(roots))]
            if self.writer:
                for i in range(len(roots)):
                    self.ns.lock(i)
            self.slots_per_slab = self.ns.check_manifests(present, slots_per_slab)
            self.slabs = Slabs(self.ns, writer=self.writer, access=self.access, num_slots=self.num_slots,
                               slot_bytes=self.slot_bytes, slots_per_slab=self.slots_per_slab,
                               max_open_slabs=max_open_slabs, medium=medium or FileMedium(open_file), map_ram=map_ram,
                               mutex=self._mutex)
            journal_path = os.path.join(self.namespaces[0], JOURNAL)
            # Records are checked against the geometry (a put with another number of checksums is
            # skipped and counted); slots past the capacity are dropped by _drop_out_of_range.
            self.journal = Journal(
                journal_path,
                writer=self.writer,
                compact_ratio=journal_compact_ratio,
                compact_min_bytes=journal_compact_min_bytes,
                dir_fd=self.ns.ns_fds[0],
                access=self.access,
                expected_checksums=self.num_layers,
            )
            self._drop_out_of_range()
        except BaseException:
            self.close()
            raise

    def _drop_out_of_range(self) -> None:
        # capacity is not part of the namespace: a store reopened smaller forgets the slots it no longer has.
        assert self.journal is not None
        stale = sorted(s for s in self.journal.entries if s >= self.num_slots)
        if not stale:
            return
        if self.writer:
            self.journal.append_free(stale)
            self.journal.sync()
        else:
            for s in stale:
                self.journal.entries.pop(s, None)

    # ---- geometry -----------------------------------------------------------------------
    # ---- geometry -----------------------------------------------------------------------
    def _check_slot(self, slot: object, name: str = "slot") -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise ValueError(
                f"{name}={slot!r}: expected an int in [0, {self.num_slots}) (num_slots = capacity_bytes // slot_bytes)"
            )
        return slot

    def place(self, slot: int) -> tuple[int, int, int]:
        """slot -> (root index, slab index, byte offset of the slot in that slab)."""
        return self.slabs.place(slot)

    def slab_path(self, slot: int) -> str:
        r, slab, _ = self.place(self._check_slot(slot))
        return os.path.join(self.namespaces[r], slab_name(slab))

    def location(self, slot: int, layer: int = 0) -> tuple[int, int]:
        """(fd, byte offset) of layer `layer` of `slot`. A writer creates the slab file on first use.

        The descriptor may be closed by a later open once more than max_open_slabs slabs are
        open: IO that outlives other store calls takes it with acquire() and gives it back with
        release()."""
        self._check_open()
        self._check_slot(slot)
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers}) (num_layers of the fingerprint)")
        r, slab, off = self.place(slot)
        with self._mutex:
            return self.slabs.fd(r, slab), off + segment_offset(layer, self.segment_bytes)

    def acquire(self, slot: int, layer: int = 0) -> tuple[int, int]:
        """location(), with the descriptor kept open until release(slot): what IO in flight holds."""
        with self._mutex:
            fd, off = self.location(slot, layer)
            self.slabs.pin(self.place(slot)[:2])
            return fd, off

    @contextlib.contextmanager
    def held(self, slot: int, layer: int = 0):
        """``with store.held(slot) as (fd, offset):`` acquire() for the duration of synchronous IO."""
        loc = self.acquire(slot, layer)
        try:
            yield loc
        finally:
            self.release(slot)

    def release(self, slot: int) -> None:
        """The IO of one acquire(slot) is done (completed, failed or abandoned)."""
        with self._mutex:
            self.slabs.unpin(self.place(self._check_slot(slot))[:2])

    # ---- mapped slabs (RAM roots) -----------------------------------------------------------
    @property
    def maps_ram(self) -> bool:
        return self.slabs is not None and self.slabs.maps is not None

    @property
    def maps_every_slab(self) -> bool:
        """map_all mapped the writer's whole capacity: stores copy into the maps."""
        return self.slabs is not None and self.slabs.maps_every_slab

    def mapped(self, slot: int, layer: int = 0, nbytes: int | None = None, sizes: dict | None = None):
        """A uint8 CPU tensor over layer `layer` of `slot` (and `nbytes` past it, default one
        segment) in the slab's mapping, registered for DMA where CUDA is; None when this store
        maps nothing or the slab file is shorter than its slots (then use location()). `sizes`:
        a per-step cache of slab sizes (tutti.store.slabs.Slabs.mapped)."""
        if not self.maps_ram:
            return None
        self._check_open()
        self._check_slot(slot)
        r, slab, off = self.place(slot)
        off += segment_offset(layer, self.segment_bytes)
        with self._mutex:
            return self.slabs.mapped(r, slab, off, self.segment_bytes if nbytes is None else nbytes, sizes)

    def map_all(self) -> int:
        """Map (and register) every slab at a server's start-up (tutti.store.slabs.Slabs.map_all);
        returns the bytes mapped."""
        self._check_open()
        return self.slabs.map_all()

    def mapped_slot(self, slot: int):
        """A writable uint8 tensor over the whole of `slot` in the writer's mapping (its stores
        copy into it), or None: not a writer that mapped every slab, or the slab file is shorter
        than its slots (shrunk under us: the write fails that chunk)."""
        if not (self.maps_every_slab and self.writer):
            return None
        return self.mapped(slot, 0, self.slot_bytes)

    @property
    def open_slabs(self) -> int:
        return len(self.slabs.fds) if self.slabs is not None else 0

    @property
    def slabs_closed(self) -> int:
        """Descriptors closed to stay within max_open_slabs."""
        return self.slabs.slabs_closed if self.slabs is not None else 0

    def allocate(self, slots: Sequence[int]) -> None:
        """Back every byte of these (free) slots with written blocks, growing slab files by writing zeros.

        File IO does not need it (writes past the end grow the file), but a path that addresses
        the drive through FIEMAP extents needs real ones: holes and fallocated (unwritten)
        extents cannot be addressed. Call it before writing the slots, never on a live slot.
        """
        self._require_writer()
        for s in slots:
            self._check_slot(s, "slots[]")
            assert self.journal is not None
            if s in self.journal.entries:
                raise ValueError(f"slots[]={s}: holds a chunk; record_free() it before allocate() would zero it")
        for s in sorted(set(slots)):
            fd, start = self.acquire(s)
            try:
                self.slabs.zero_fill(s, fd, start, start + self.slot_bytes)
            finally:
                self.release(s)

    # ---- durability ---------------------------------------------------------------------
    def record_free(self, slots: Sequence[int]) -> None:
        """These slots' old contents stop being valid. Append (and sync) before overwriting them."""
        self._require_writer()
        slots = [self._check_slot(s, "slots[]") for s in slots]
        assert self.journal is not None
        with self._mutex:
            self.journal.append_free(slots)

    def record_put(self, key: bytes, slot: int, checksums: Sequence[int]) -> None:
        """`slot` now holds chunk `key`. Append only after sync_data() made its bytes durable."""
        self._require_writer()
        self._check_slot(slot)
        checksums = list(checksums)
        if len(checksums) != self.num_layers:
            raise ValueError(
                f"checksums: {len(checksums)} values for slot {slot}; expected one per layer segment (num_layers={self.num_layers})"
            )
        assert self.journal is not None
        with self._mutex:
            self.journal.append_put(key, slot, checksums)

    def sync_data(self, slots: Sequence[int] | None = None) -> None:
        """fdatasync the slab files holding `slots` (all open slab files when None)."""
        self._require_writer()
        with self._mutex:
            if slots is None:
                keys = set(self.slabs.fds) | self.slabs.unsynced
            else:
                keys = {self.place(self._check_slot(s, "slots[]"))[:2] for s in slots}
            self.slabs.sync(keys)

    def sync_journal(self) -> None:
        """Write and fsync every record appended since the last call (one fsync for the batch)."""
        self._require_writer()
        assert self.journal is not None
        with self._mutex:
            self.ns.check_lock()
            self.journal.sync()

    # -- the durability order, in one place: every writer of chunks goes through these two --
    def commit(self, puts: Sequence[tuple[bytes, int, Sequence[int]]]) -> None:
        """Chunks written to their slots become durable and visible: their slab data is synced,
        then their journal records are appended and synced (a crash in between loses them,
        never serves them half-written). `puts`: (key, slot, per-layer checksums or tags)."""
        puts = list(puts)
        if not puts:
            return
        self.sync_data([slot for _, slot, _ in puts])
        for key, slot, sums in puts:
            self.record_put(key, slot, sums)
        self.sync_journal()

    def free(self, slots: Sequence[int]) -> None:
        """These slots' old contents stop being valid, durably, before anything overwrites them."""
        if slots:
            self.record_free(slots)
            self.sync_journal()

    # ---- state --------------------------------------------------------------------------
    def entries(self) -> dict[int, Entry]:
        """slot -> Entry(key, checksums): the replayed state plus records appended since."""
        self._check_open()
        assert self.journal is not None
        with self._mutex:
            return dict(self.journal.entries)

    def get(self, slot: int) -> Entry | None:
        self._check_open()
        assert self.journal is not None
        return self.journal.entries.get(self._check_slot(slot))

    def refresh(self) -> None:
        """Reader only: replay the journal again to see what the writer has made durable since."""
        self._check_open()
        if self.writer:
            raise RuntimeError("ChunkStore.refresh: a writer's state is always current")
        assert self.journal is not None
        self.journal.reload()
        self._drop_out_of_range()

    def refresh_if_changed(self) -> bool:
        """Reader only: catch up with the writer's journal if it changed since the last replay,
        reading only what was appended when it only grew (Journal.follow)."""
        self._check_open()
        assert self.journal is not None
        if self.writer or not self.journal.follow():
            return False
        self._drop_out_of_range()
        return True

    def stats(self) -> StoreStats:
        self._check_open()
        assert self.journal is not None
        slabs: list[SlabInfo] = []
        for ns in self.namespaces:
            if not os.path.isdir(ns):
                continue
            for name in sorted(os.listdir(ns), key=slab_sort_key):
                if name.startswith("slab-") and name.endswith(".bin"):
                    st = os.stat(os.path.join(ns, name))
                    slabs.append(SlabInfo(os.path.join(ns, name), st.st_size, st.st_blocks * 512))
        used = len(self.journal.entries)
        return StoreStats(
            digest=self.digest,
            namespaces=self.namespaces,
            slot_bytes=self.slot_bytes,
            slots_used=used,
            slots_total=self.num_slots,
            bytes_used=used * self.slot_bytes,
            capacity_bytes=self.num_slots * self.slot_bytes,
            slabs=tuple(slabs),
            journal_path=self.journal.path,
            journal_bytes=self.journal.size_bytes,
            journal_live_bytes=self.journal.live_bytes,
        )

    # ---- lifetime -----------------------------------------------------------------------
    # ---- lifetime -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"ChunkStore at {self.namespaces[0]!r} is closed")

    def _require_writer(self) -> None:
        self._check_open()
        if not self.writer:
            raise RuntimeError(
                f"ChunkStore at {self.namespaces[0]!r} was opened with writer=False; only the writer records or syncs"
            )

    def close(self) -> None:
        """Sync pending journal records, then release files and the lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:  # pending records are made durable on a clean close; a crash would drop them
            if self.journal is not None and self.writer and self.journal.pending_records:
                self.journal.sync()
        except OSError as exc:  # a full disk: the records not written are chunks not journaled (misses)
            log_once(f"tutti: closing the store at {self.namespaces[0]!r} could not journal its last "
                     f"{self.journal.pending_records} records ({exc}); those chunks are not kept")
        finally:  # each part released even when another's close fails (a dead network client)
            for what, close in (("journal", self.journal.close if self.journal is not None else None),
                                ("slabs", self.slabs.close if self.slabs is not None else None),
                                ("lock", self.ns.close)):  # the namespace's close releases the flock
                if close is None:
                    continue
                try:
                    close()
                except OSError as exc:
                    log_once(f"tutti: closing the store at {self.namespaces[0]!r}: its {what} reported {exc}")

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                # Do not sync from a finalizer: drop pending records as a crash would.
                if self.journal is not None:
                    self.journal.close()
                self._closed = True
                if self.slabs is not None:
                    self.slabs.close_quietly()
                self.ns.close_quietly()
        except Exception:
            pass
