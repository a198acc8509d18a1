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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import re
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from tutti.format import segment_offset, slot_bytes
from tutti.io.fingerprint import Fingerprint
from tutti.io.journal import Entry, Journal, fsync_dir
from tutti.io.safefs import PRIVATE, Access, UnsafeFileError, check_fd, open_dir, open_file

__all__ = [
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

STORE_FORMAT = "tutti-chunk-store"
STORE_VERSION = 1
NAMESPACE_PREFIX = "tutti-"
MANIFEST = "manifest.json"
LOCK = "LOCK"
JOURNAL = "journal.bin"
DEFAULT_SLOTS_PER_SLAB = 64
DEFAULT_MAX_OPEN_SLABS = 256
WRITER_PREFIX = "w-"
_WRITER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ZERO_BYTES = 1 << 20


class StoreRootError(ValueError):
    """A root directory that cannot hold a store (missing parent, not a directory, no access)."""


class StoreLockedError(RuntimeError):
    """Another writer (this process or another) holds the namespace."""


class ManifestMismatchError(ValueError):
    """A namespace directory whose manifest does not describe what we were asked to open."""


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


@dataclass(frozen=True)
class NamespaceInfo:
    path: str
    digest: str
    manifest: dict | None  # None when the manifest is missing or unreadable (see error)
    error: str | None = None


def namespace_dir(root: str, fingerprint: Fingerprint) -> str:
    return os.path.join(root, NAMESPACE_PREFIX + fingerprint.digest())


def list_namespaces(root: str) -> list[NamespaceInfo]:
    """Every namespace under `root` with its manifest. Reads only."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise StoreRootError(f"store root {root!r} is not a directory; pass the directory given as the store's root")
    out: list[NamespaceInfo] = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not name.startswith(NAMESPACE_PREFIX) or not os.path.isdir(path):
            continue
        digest = name[len(NAMESPACE_PREFIX):]
        try:
            out.append(NamespaceInfo(path, digest, _read_manifest(path)))
        except (OSError, ValueError) as exc:
            out.append(NamespaceInfo(path, digest, None, str(exc)))
    return out


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
    ) -> None:
        # ---- argument checks, before any IO ----
        if not isinstance(access, Access):
            raise ValueError(f"access={access!r}: expected a tutti.io.safefs.Access (PRIVATE, or Access(gid) to share)")
        if not isinstance(fingerprint, Fingerprint):
            raise ValueError(f"fingerprint: expected a tutti.io.fingerprint.Fingerprint, got {type(fingerprint).__name__}")
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
        self._open_file = open_file
        self.access = access
        if not isinstance(writer_id, str) or (writer_id and not _WRITER_ID.fullmatch(writer_id)):
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
        self.namespaces = tuple(os.path.join(r, NAMESPACE_PREFIX + self.digest, *([WRITER_PREFIX + writer_id]
                                                                                 if writer_id else []))
                                for r in roots)
        self._lock_fds: list[int] = []
        self._root_fds: list[int | None] = [None] * len(roots)
        self._ns_fds: list[int | None] = [None] * len(roots)  # every store file is opened relative to these
        # Open slab descriptors, least recently used first, at most max_open_slabs of them unless
        # IO in flight pins more (acquire/release): a descriptor is closed only when no IO uses it,
        # since its number could otherwise be reused by the next open and the IO hit another file.
        self._slab_fds: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._pins: dict[tuple[int, int], int] = {}
        self.max_open_slabs = max_open_slabs
        self.slabs_closed = 0  # descriptors closed to stay within max_open_slabs
        self._unsynced: set[tuple[int, int]] = set()  # closed by _trim; sync_data opens them again
        # Loads straight from mapped slabs (RAM file systems; see tutti.io.rammap): private stores only.
        self._maps = None
        if map_ram and not access.shared:
            from tutti.io.rammap import SlabMaps

            self._maps = SlabMaps(writable=self.writer)
        self.maps_every_slab = False  # map_all mapped the writer's whole capacity: stores copy into the maps
        self._zeros: mmap.mmap | None = None
        self._closed = False
        # IO threads may ask for locations while the engine thread records: guard the fd cache and journal.
        self._mutex = threading.RLock()
        self.journal: Journal | None = None
        try:
            present = [self._prepare_root(i) for i in range(len(roots))]
            if self.writer:
                for i in range(len(roots)):
                    self._lock(i)
            self.slots_per_slab = self._check_manifests(present, slots_per_slab)
            journal_path = os.path.join(self.namespaces[0], JOURNAL)
            # Records are checked against the geometry (a put with another number of checksums is
            # skipped and counted); slots past the capacity are dropped by _drop_out_of_range.
            self.journal = Journal(
                journal_path,
                writer=self.writer,
                compact_ratio=journal_compact_ratio,
                compact_min_bytes=journal_compact_min_bytes,
                dir_fd=self._ns_fds[0],
                access=self.access,
                expected_checksums=self.num_layers,
            )
            self._drop_out_of_range()
        except BaseException:
            self.close()
            raise

    # ---- opening ------------------------------------------------------------------------
    def _prepare_root(self, i: int) -> bool:
        """Check (and for a writer create) root i and its namespace dir. True if the namespace exists."""
        root = self.roots[i]
        parent = os.path.dirname(root)
        if not os.path.exists(root):
            if os.path.exists(parent) and not os.path.isdir(parent):
                raise StoreRootError(
                    f"store root {root!r}: its parent {parent!r} is a file, not a directory; "
                    "pass a directory path (remove or rename that file)"
                )
            if not os.path.isdir(parent):
                raise StoreRootError(
                    f"store root {root!r}: its parent directory {parent!r} does not exist; "
                    "create it (e.g. mount the drive) or pass an existing directory"
                )
            if not self.writer:
                return False  # nothing stored yet; a reader creates nothing
            try:
                os.mkdir(root, self.access.dir_mode)
                fd = open_dir(root, check=False, where=f"store root {root!r}")
                try:
                    self.access.adopt(fd)
                finally:
                    os.close(fd)
                fsync_dir(parent)
            except FileExistsError:
                pass
            except OSError as exc:
                raise StoreRootError(f"store root {root!r}: cannot create it ({exc.strerror}); create it or fix permissions of {parent!r}") from exc
        if not os.path.isdir(root):
            raise StoreRootError(f"store root {root!r}: exists but is not a directory; remove that file or pass a directory")
        need = os.R_OK | os.X_OK | (os.W_OK if self.writer else 0)
        if self.writer and _read_only_fs(root):
            raise StoreRootError(f"store root {root!r} is on a read-only filesystem; remount it read-write or pass another directory")
        if not os.access(root, need):
            mode = "read, write and search" if self.writer else "read and search"
            raise StoreRootError(f"store root {root!r}: this process (uid {os.getuid()}) lacks {mode} permission; fix its permissions or pass another directory")
        # The root may be shared (a sticky scratch directory): it is opened without following a
        # link, and every namespace and file below it through descriptors, never by path again.
        try:
            self._root_fds[i] = open_dir(root, check=False, where=f"store root {root!r}")
        except UnsafeFileError:
            raise StoreRootError(f"store root {root!r} is a symbolic link; pass the directory it points to "
                                 f"({os.path.realpath(root)!r})") from None
        self._ns_fds[i] = self._walk_namespace(i, need)
        return self._ns_fds[i] is not None

    def _walk_namespace(self, i: int, need: int) -> int | None:
        """Root i's namespace directory and, for a named writer, its own directory inside it:
        the descriptor every file of this store is opened relative to (None: not there yet)."""
        fd = self._child_dir(self._root_fds[i], os.path.join(self.roots[i], NAMESPACE_PREFIX + self.digest), need,
                             self._ns_access)
        if fd is None or not self.writer_id:
            return fd
        try:  # this writer's own directory inside the shared namespace
            return self._child_dir(fd, self.namespaces[i], need, self.access)
        finally:
            os.close(fd)

    def _child_dir(self, parent_fd: int, path: str, need: int, access) -> int | None:
        """Open directory `path` (its basename under `parent_fd`), creating it for a writer;
        None for a reader when it does not exist yet. Never through a link; checked like any
        store directory."""
        name = os.path.basename(path)
        try:
            st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None and not self.writer:
            return None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise UnsafeFileError(errno.ELOOP, f"namespace {path!r}: refused, a symbolic link (to "
                                  f"{os.readlink(name, dir_fd=parent_fd)!r}); tutti never follows links "
                                  "inside a store; remove it", path)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise StoreRootError(f"namespace {path!r}: exists but is not a directory; remove that file")
        try:
            fd = open_dir(name, dir_fd=parent_fd, create=st is None, access=access, where=f"namespace {path!r}")
        except UnsafeFileError:
            raise
        except OSError as exc:
            raise StoreRootError(f"cannot create or open namespace {path!r} ({exc.strerror}); "
                                 "check free space and permissions") from exc
        if st is None:
            os.fsync(parent_fd)  # the new name must survive a crash
        elif not os.access(path, need):
            os.close(fd)
            raise StoreRootError(f"namespace {path!r}: no access for uid {os.getuid()}; fix its permissions")
        return fd

    def _lock(self, i: int) -> None:
        path = os.path.join(self.namespaces[i], LOCK)
        # no O_TRUNC: keep the holder's pid; never a link (it would truncate another user's file)
        # A named writer's LOCK is its owner's alone (0600): a group member who could open it
        # could hold its flock and keep the writer from restarting (round two, item 2b).
        fd = open_file(LOCK, os.O_RDWR | os.O_CREAT, dir_fd=self._ns_fds[i], access=self.access,
                       mode=0o600 if self.writer_id and self.access.shared else None, where=f"lock file {path!r}")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            same = " (this process)" if holder == str(os.getpid()) else ""
            raise StoreLockedError(
                f"store root {self.roots[i]!r}: namespace {self.namespaces[i]!r} already has a writer: "
                f"lock file {path!r} is held by pid {holder}{same}; close that store, or open this one with writer=False"
            ) from None
        self._lock_fds.append(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def _expected_manifest(self, i: int, slots_per_slab: int) -> dict[str, Any]:
        return {
            "format": STORE_FORMAT,
            "store_version": STORE_VERSION,
            "digest": self.digest,
            "fingerprint": self.fingerprint.to_dict(),
            "segment_bytes": self.segment_bytes,
            "num_layers": self.num_layers,
            "slot_bytes": self.slot_bytes,
            "slots_per_slab": slots_per_slab,
            "root_index": i,
            "num_roots": len(self.roots),
        }

    def _check_manifests(self, present: list[bool], slots_per_slab: int | None) -> int:
        manifests: list[dict | None] = []
        for i, ns in enumerate(self.namespaces):
            has = present[i] and _exists(MANIFEST, self._ns_fds[i])
            manifests.append(_read_manifest(ns, self._ns_fds[i]) if has else None)
        for i, m in enumerate(manifests):  # another writer's file: checked before anything divides by it
            v = None if m is None else m.get("slots_per_slab")
            if m is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20):
                raise ManifestMismatchError(
                    f"manifest {os.path.join(self.namespaces[i], MANIFEST)!r}: slots_per_slab={v!r}, expected an "
                    f"integer in [1, {1 << 20}]; it was edited or damaged: move {self.namespaces[i]!r} aside")
        stored_sps = {m.get("slots_per_slab") for m in manifests if m is not None}
        if len(stored_sps) > 1:
            raise ManifestMismatchError(f"namespaces {self.namespaces}: manifests disagree on slots_per_slab ({sorted(map(str, stored_sps))}); they were not written by one store")
        if stored_sps:
            sps = stored_sps.pop()
            if slots_per_slab is not None and slots_per_slab != sps:
                raise ValueError(
                    f"slots_per_slab={slots_per_slab}: the existing namespace {self.namespaces[0]!r} was created with "
                    f"slots_per_slab={sps}; pass {sps} (or None) or use a fresh root"
                )
        else:
            sps = DEFAULT_SLOTS_PER_SLAB if slots_per_slab is None else slots_per_slab
        for i, m in enumerate(manifests):
            expected = self._expected_manifest(i, sps)
            if m is None:
                if self.writer:
                    _write_manifest(self.namespaces[i], expected, self._ns_fds[i], self.access)
                continue
            self._compare_manifest(i, m, expected)
        return sps

    def _compare_manifest(self, i: int, got: dict, expected: dict) -> None:
        path = os.path.join(self.namespaces[i], MANIFEST)
        if got.get("fingerprint") != expected["fingerprint"] or got.get("digest") != expected["digest"]:
            theirs = got.get("fingerprint") if isinstance(got.get("fingerprint"), dict) else {}
            ours = expected["fingerprint"]
            diff = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            raise ManifestMismatchError(
                f"manifest {path!r} does not match the fingerprint being opened (digest {self.digest}); fields that "
                f"differ: {diff or ['digest']}. The manifest was edited or two fingerprints collide on their digest: "
                "its chunks cannot be trusted; move that namespace directory aside"
            )
        if got.get("root_index") != i or got.get("num_roots") != len(self.roots):
            raise ManifestMismatchError(
                f"manifest {path!r}: this root was stripe {got.get('root_index')} of {got.get('num_roots')} roots, but it "
                f"is given as {i} of {len(self.roots)}; pass the same roots, in the same order, as when the store was created"
            )
        for key, value in expected.items():
            if got.get(key) != value:
                raise ManifestMismatchError(
                    f"manifest {path!r}: {key}={got.get(key)!r}, expected {value!r}; the manifest was edited or written "
                    "by another store version; move that namespace directory aside"
                )

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
    def _check_slot(self, slot: object, name: str = "slot") -> int:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.num_slots:
            raise ValueError(
                f"{name}={slot!r}: expected an int in [0, {self.num_slots}) (num_slots = capacity_bytes // slot_bytes)"
            )
        return slot

    def _place(self, slot: int) -> tuple[int, int, int]:
        """slot -> (root index, slab index, byte offset of the slot in that slab)."""
        nroots = len(self.roots)
        local = slot // nroots
        return slot % nroots, local // self.slots_per_slab, (local % self.slots_per_slab) * self.slot_bytes

    def slab_path(self, slot: int) -> str:
        r, slab, _ = self._place(self._check_slot(slot))
        return os.path.join(self.namespaces[r], f"slab-{slab}.bin")

    def location(self, slot: int, layer: int = 0) -> tuple[int, int]:
        """(fd, byte offset) of layer `layer` of `slot`. A writer creates the slab file on first use.

        The descriptor may be closed by a later open once more than max_open_slabs slabs are
        open: IO that outlives other store calls takes it with acquire() and gives it back with
        release()."""
        self._check_open()
        self._check_slot(slot)
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer!r}: expected an int in [0, {self.num_layers}) (num_layers of the fingerprint)")
        r, slab, off = self._place(slot)
        with self._mutex:
            return self._slab_fd(r, slab), off + segment_offset(layer, self.segment_bytes)

    def acquire(self, slot: int, layer: int = 0) -> tuple[int, int]:
        """location(), with the descriptor kept open until release(slot): what IO in flight holds."""
        with self._mutex:
            fd, off = self.location(slot, layer)
            k = self._place(slot)[:2]
            self._pins[k] = self._pins.get(k, 0) + 1
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
            k = self._place(self._check_slot(slot))[:2]
            n = self._pins.get(k, 0) - 1
            if n > 0:
                self._pins[k] = n
            else:
                self._pins.pop(k, None)
                self._trim()

    # ---- mapped slabs (RAM roots) -----------------------------------------------------------
    @property
    def maps_ram(self) -> bool:
        return self._maps is not None

    def _slab_length(self, r: int, slab: int) -> int:
        """Bytes of slab `slab` under root r: whole slots of the capacity, never past it."""
        nroots = len(self.roots)
        local_slots = (self.num_slots - r + nroots - 1) // nroots
        return max(0, min(self.slots_per_slab, local_slots - slab * self.slots_per_slab)) * self.slot_bytes

    def mapped(self, slot: int, layer: int = 0, nbytes: int | None = None):
        """A uint8 CPU tensor over layer `layer` of `slot` (and `nbytes` past it, default one
        segment) in the slab's mapping, registered for DMA where CUDA is; None when this store
        maps nothing or the slab file is shorter than its slots (then use location())."""
        if self._maps is None:
            return None
        self._check_open()
        self._check_slot(slot)
        r, slab, off = self._place(slot)
        off += segment_offset(layer, self.segment_bytes)
        n = self.segment_bytes if nbytes is None else nbytes
        with self._mutex:
            t = self._maps.get((r, slab))
            if t is None:
                t = self._map_slab(r, slab)
            # a slab file that shrank under its mapping (a restore, `: > slab-0.bin`) is never
            # touched through it: past the file's end the mapping faults (SIGBUS) instead of
            # failing one read; the file path reads it short and fails the chunk
            if t is not None and os.fstat(self._slab_fd(r, slab)).st_size < off + n:
                return None
        return None if t is None or off + n > t.numel() else t[off:off + n]

    def _map_slab(self, r: int, slab: int):
        """Caller holds the mutex. A writer first makes the file as long as its slots (sparse)."""
        length = self._slab_length(r, slab)
        try:
            fd = self._slab_fd(r, slab)
            if self.writer and os.fstat(fd).st_size < length:
                os.ftruncate(fd, length)
            return self._maps.map((r, slab), fd, length)
        except OSError as exc:
            # ENOENT (no chunk stored there yet), ENOMEM...: the file path still works
            if exc.errno != errno.ENOENT:
                log_once(f"tutti: slab {r}/{slab} cannot be mapped ({exc}); loads read it through the file")
            return None

    def map_all(self) -> int:
        """Map (and register) every slab file at a server's start-up, so that no request, and no
        store while the server serves, pays for pinning pages (cudaHostRegister takes CUDA's
        locks: beside the step it stalls it). A writer first creates every slab of its capacity
        (sparse, as long as its slots): the whole capacity is then pinned RAM, as vLLM pins its CPU
        tier. Returns the bytes mapped."""
        if self._maps is None:
            return 0
        with self._mutex:
            every = self.writer
            for r, ns in enumerate(self.namespaces):
                ns_fd = self._namespace_fd(r)
                if ns_fd is None:
                    continue
                local_slots = (self.num_slots - r + len(self.roots) - 1) // len(self.roots)
                free = _free_bytes(ns_fd)
                if self.writer and free is not None and free < local_slots * self.slot_bytes:
                    # pinning the pages of a capacity the file system cannot hold would fault the
                    # server (SIGBUS past a tmpfs's size): map what exists, the rest when created
                    log_once(f"tutti: root {self.roots[r]!r} has {free} B free for a capacity of "
                             f"{local_slots * self.slot_bytes} B: slabs are mapped as they are created, "
                             "which registers them with CUDA while serving; lower capacity_bytes to the "
                             "file system's free space to map them all at start-up")
                if self.writer and (free is None or free >= local_slots * self.slot_bytes):
                    slabs = range(-(-local_slots // self.slots_per_slab))
                else:
                    every = False
                    slabs = sorted({_slab_sort_key(name)[0] for name in os.listdir(ns_fd)} - {-1})
                for slab in slabs:
                    if self._slab_length(r, slab) and self._maps.get((r, slab)) is None:
                        if self.writer:
                            self._slab_fd(r, slab)  # creates it (and maps it: _open_slab)
                        if self._maps.get((r, slab)) is None:
                            self._map_slab(r, slab)
                    every = every and (not self._slab_length(r, slab) or self._maps.get((r, slab)) is not None)
            self.maps_every_slab = every
            return self._maps.mapped_bytes

    def mapped_slot(self, slot: int):
        """A writable uint8 tensor over the whole of `slot` in the writer's mapping (its stores
        copy into it), or None: not a writer that mapped every slab, or the slab file is shorter
        than its slots (shrunk under us: the write fails that chunk)."""
        if not (self.maps_every_slab and self.writer):
            return None
        return self.mapped(slot, 0, self.slot_bytes)

    @property
    def open_slabs(self) -> int:
        return len(self._slab_fds)

    def _slab_fd(self, r: int, slab: int) -> int:
        """Caller holds the mutex."""
        fd = self._slab_fds.get((r, slab))
        if fd is not None:
            self._slab_fds.move_to_end((r, slab))
            return fd
        fd = self._open_slab(r, slab)
        self._trim()
        return fd

    def _trim(self) -> None:
        """Close least recently used slab descriptors no IO holds, down to max_open_slabs. Caller
        holds the mutex. Data a writer wrote through a closed descriptor is synced by sync_data,
        which opens the file again (fdatasync acts on the file, not the descriptor)."""
        if len(self._slab_fds) <= self.max_open_slabs or self._closed:
            return
        for k in list(self._slab_fds):
            if len(self._slab_fds) <= self.max_open_slabs:
                break
            if k in self._pins or k == next(reversed(self._slab_fds)):
                continue
            fd = self._slab_fds.pop(k)
            if self.writer:
                self._unsynced.add(k)
            os.close(fd)
            self.slabs_closed += 1

    def _namespace_fd(self, r: int) -> int | None:
        """Root r's namespace descriptor; a reader opened before the writer created the
        namespace opens it once it exists (checked like any namespace)."""
        if self._ns_fds[r] is None and self._root_fds[r] is not None:
            self._ns_fds[r] = self._walk_namespace(r, os.R_OK | os.X_OK)
        return self._ns_fds[r]

    def _open_slab(self, r: int, slab: int) -> int:
        name = f"slab-{slab}.bin"
        path = os.path.join(self.namespaces[r], name)
        ns_fd = self._namespace_fd(r)
        if ns_fd is None:
            raise OSError(errno.ENOENT, f"slab file {path!r} is missing (namespace not created yet)", path)
        if self.writer:
            try:
                os.close(open_file(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=ns_fd, access=self.access,
                                   where=f"slab {path!r}"))
                os.fsync(ns_fd)  # the new name must survive a crash with the data under it
            except FileExistsError:
                pass
        elif not _exists(name, ns_fd):
            raise OSError(errno.ENOENT, f"slab file {path!r} is missing (no chunk was ever stored there)", path)
        if self._open_file is not None:
            fd = self._open_file(name, self.writer, ns_fd)
        else:
            fd = open_file(name, os.O_RDWR if self.writer else os.O_RDONLY, dir_fd=ns_fd, check=False)
        try:
            check_fd(fd, f"slab {path!r}", access=self.access)
        except BaseException:
            os.close(fd)
            raise
        self._slab_fds[(r, slab)] = fd
        if self._maps is not None and self.writer and self._maps.get((r, slab)) is None:
            self._map_slab(r, slab)  # mostly the writer thread's first store there: off the load path
        return fd

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
                self._zero_fill(s, fd, start, start + self.slot_bytes)
            finally:
                self.release(s)

    def _zero_fill(self, s: int, fd: int, start: int, end: int) -> None:
        if os.fstat(fd).st_size >= end and not _has_hole(fd, start, end):
            return
        if self._zeros is None:
            self._zeros = mmap.mmap(-1, _ZERO_BYTES)  # page aligned: also fine for O_DIRECT fds
        pos = start
        while pos < end:
            n = os.pwrite(fd, memoryview(self._zeros)[: min(_ZERO_BYTES, end - pos)], pos)
            if n <= 0:
                raise OSError(errno.EIO, f"zero-fill of slot {s} wrote {n} bytes")
            pos += n

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
                keys = set(self._slab_fds) | self._unsynced
            else:
                keys = {self._place(self._check_slot(s, "slots[]"))[:2] for s in slots}
            for k in sorted(keys):
                if k not in self._slab_fds and k not in self._unsynced:
                    continue  # never opened by this writer: nothing of ours to sync there
                fd = self._slab_fd(*k)  # opens a closed one again
                os.fdatasync(fd)
                self._unsynced.discard(k)

    def sync_journal(self) -> None:
        """Write and fsync every record appended since the last call (one fsync for the batch)."""
        self._require_writer()
        assert self.journal is not None
        with self._mutex:
            self._check_lock()
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

    def _check_lock(self) -> None:
        """A writer whose LOCK was unlinked or replaced no longer excludes a second writer: stop."""
        for i, fd in enumerate(self._lock_fds):
            held = os.fstat(fd)
            try:
                now = os.stat(LOCK, dir_fd=self._ns_fds[i], follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev):
                raise StoreLockedError(
                    f"lock file {os.path.join(self.namespaces[i], LOCK)!r} was removed or replaced under this writer: "
                    "another writer may have started; stopped recording (restart the server)")

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
            for name in sorted(os.listdir(ns), key=_slab_sort_key):
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
        finally:
            if self.journal is not None:
                self.journal.close()
            if self._maps is not None:
                self._maps.close()
            for fd in self._slab_fds.values():
                os.close(fd)
            self._slab_fds.clear()
            for fd in self._lock_fds:
                os.close(fd)  # releases the flock
            self._lock_fds.clear()
            for fd in self._ns_fds + self._root_fds:
                if fd is not None:
                    os.close(fd)
            self._ns_fds = [None] * len(self._ns_fds)
            self._root_fds = [None] * len(self._root_fds)
            if self._zeros is not None:
                self._zeros.close()
                self._zeros = None

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
                for fd in list(self._slab_fds.values()) + self._lock_fds + self._ns_fds + self._root_fds:
                    if fd is not None:
                        os.close(fd)
        except Exception:
            pass


# ---- helpers ------------------------------------------------------------------------------
_logged: set[str] = set()


def log_once(msg: str) -> None:
    import logging

    if msg not in _logged:
        _logged.add(msg)
        logging.getLogger("tutti.io").warning(msg)


def list_writers(root: str, fingerprint: Fingerprint) -> list[str]:
    """Writer ids with a journal in `fingerprint`'s namespace under `root`: '' for the files at
    the namespace's top (its only writer, before servers shared it), then each `w-<id>/`.
    Reads only; never follows a link."""
    top = namespace_dir(os.fspath(root), fingerprint)
    try:
        fd = open_dir(top, check=False, where=f"namespace {top!r}")
    except (FileNotFoundError, NotADirectoryError, UnsafeFileError):
        return []
    try:
        out = []
        for entry in os.scandir(fd):
            name = entry.name
            if name == JOURNAL and entry.is_file(follow_symlinks=False):
                out.append("")
            elif (name.startswith(WRITER_PREFIX) and _WRITER_ID.fullmatch(name[len(WRITER_PREFIX):])
                  and entry.is_dir(follow_symlinks=False)):
                out.append(name[len(WRITER_PREFIX):])
        return sorted(out)
    finally:
        os.close(fd)


def _exists(name: str, dir_fd: int | None) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


_MAX_MANIFEST = 1 << 20


def _free_bytes(dir_fd: int) -> int | None:
    """Bytes an unprivileged writer may still allocate under `dir_fd`'s file system (None: unknown)."""
    try:
        st = os.fstatvfs(dir_fd)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _read_manifest(ns: str, dir_fd: int | None = None) -> dict:
    """The manifest of namespace `ns` (read through `dir_fd` when given), never through a link,
    never blocking on a FIFO, bounded in size."""
    path = os.path.join(ns, MANIFEST)
    own_fd = None
    if dir_fd is None:
        own_fd = dir_fd = open_dir(ns, check=False, where=f"namespace {ns!r}")
    try:
        fd = open_file(MANIFEST, os.O_RDONLY, dir_fd=dir_fd, where=f"manifest {path!r}", check=False)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MANIFEST:
                raise ManifestMismatchError(f"manifest {path!r} is not a regular file under 1 MiB; move {ns!r} aside")
            raw = os.pread(fd, _MAX_MANIFEST, 0)
        finally:
            os.close(fd)
    finally:
        if own_fd is not None:
            os.close(own_fd)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestMismatchError(f"manifest {path!r} is not valid JSON ({exc}); it was edited or damaged: move {ns!r} aside") from exc
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
        raise ManifestMismatchError(f"manifest {path!r} is not a {STORE_FORMAT} manifest; move {ns!r} aside")
    return data


def _write_manifest(ns: str, manifest: dict, dir_fd: int, access: Access = PRIVATE) -> None:
    # Atomic: a crash leaves either no manifest (created again on the next open) or a whole one.
    # The temporary is created exclusively (a planted file or link there is removed, never followed).
    tmp = MANIFEST + ".tmp"
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8")
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, dir_fd=dir_fd, access=access,
                   where=f"manifest {os.path.join(ns, tmp)!r}")
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, MANIFEST, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _has_hole(fd: int, start: int, end: int) -> bool:
    try:
        return os.lseek(fd, start, os.SEEK_HOLE) < end
    except OSError:
        return True  # no SEEK_HOLE support: assume the worst and write the zeros


def _slab_sort_key(name: str) -> tuple[int, str]:
    digits = name[5:-4] if name.startswith("slab-") and name.endswith(".bin") else ""
    return (int(digits) if digits.isdigit() else -1, name)
