"""A store's namespace on disk: its directories, its writer's lock and its manifests.

Each fingerprint gets a namespace directory `<root>/tutti-<digest>/` in every root (one root per
drive); a named writer's files live in its own `w-<writer_id>/` inside it. The manifest of each
root says which fingerprint, geometry and stripe the namespace holds, so a store is never opened
over chunks of another shape. Everything below a root is opened through directory descriptors,
never by path again and never through a link (`tutti.io.safefs`). `tutti.store.chunk_store.ChunkStore`
composes this with its slabs (`tutti.store.slabs`) and journal; `tutti.tools.storetools` reads the same
names and manifests.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

from tutti.store.fingerprint import Fingerprint
from tutti.store.journal import fsync_dir
from tutti.io.safefs import PRIVATE, Access, UnsafeFileError, open_dir, open_file, replace_file

STORE_FORMAT = "tutti-chunk-store"
STORE_VERSION = 1
NAMESPACE_PREFIX = "tutti-"
MANIFEST = "manifest.json"
LOCK = "LOCK"
JOURNAL = "journal.bin"
DEFAULT_SLOTS_PER_SLAB = 64
WRITER_PREFIX = "w-"
WRITER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_MANIFEST = 1 << 20


class StoreRootError(ValueError):
    """A root directory that cannot hold a store (missing parent, not a directory, no access)."""


class StoreLockedError(RuntimeError):
    """Another writer (this process or another) holds the namespace."""


class WriterDirectoryTakenError(StoreRootError):
    """A named writer's directory exists but belongs to another user of the sharing group: a
    member made it (or replaced ours with it); this writer never writes into it."""


class ManifestMismatchError(ValueError):
    """A namespace directory whose manifest does not describe what we were asked to open."""


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
            out.append(NamespaceInfo(path, digest, read_manifest(path)))
        except (OSError, ValueError) as exc:
            out.append(NamespaceInfo(path, digest, None, str(exc)))
    return out


class Namespace:
    """One store's namespace in every root: created (by a writer), locked, its manifests checked.

    `manifest_fields`: what the store's geometry writes into each manifest (digest, fingerprint,
    segment and slot sizes); the namespace adds the format, the stripe and `slots_per_slab`."""

    def __init__(self, roots: tuple[str, ...], digest: str, manifest_fields: dict[str, Any], *, writer: bool,
                 writer_id: str, access: Access, ns_access: Access) -> None:
        self.roots = roots
        self.digest = digest
        self.manifest_fields = manifest_fields
        self.writer = writer
        self.writer_id = writer_id
        self.access = access  # this writer's files
        self.ns_access = ns_access  # the namespace directory (the group's, when servers share it)
        self.paths = tuple(os.path.join(r, NAMESPACE_PREFIX + digest, *([WRITER_PREFIX + writer_id] if writer_id
                                                                           else [])) for r in roots)
        self.lock_fds: list[int] = []
        self.root_fds: list[int | None] = [None] * len(roots)
        self.ns_fds: list[int | None] = [None] * len(roots)  # every store file is opened relative to these

    def prepare(self, i: int) -> bool:
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
            try:  # the group's, like the namespace: a named writer creating a shared root keeps it
                # writable for the other members (their servers write below it too)
                os.mkdir(root, self.ns_access.dir_mode)
                fd = open_dir(root, check=False, where=f"store root {root!r}")
                try:
                    self.ns_access.adopt(fd)
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
        if self.writer and read_only_fs(root):
            raise StoreRootError(f"store root {root!r} is on a read-only filesystem; remount it read-write or pass another directory")
        if self.writer and not os.access(root, os.W_OK) and os.access(root, os.R_OK | os.X_OK):
            raise StoreRootError(f"store root {root!r} is read-only for this process (uid {os.getuid()}): a server "
                                 "writes its store there; make it writable (chmod u+w) or pass another directory")
        if not os.access(root, need):
            mode = "read, write and search" if self.writer else "read and search"
            raise StoreRootError(f"store root {root!r}: this process (uid {os.getuid()}) lacks {mode} permission; fix its permissions or pass another directory")
        # The root may be shared (a sticky scratch directory): it is opened without following a
        # link, and every namespace and file below it through descriptors, never by path again.
        try:
            self.root_fds[i] = open_dir(root, check=False, where=f"store root {root!r}")
        except UnsafeFileError:
            raise StoreRootError(f"store root {root!r} is a symbolic link; pass the directory it points to "
                                 f"({os.path.realpath(root)!r})") from None
        self.ns_fds[i] = self.walk(i, need)
        return self.ns_fds[i] is not None

    def walk(self, i: int, need: int) -> int | None:
        """Root i's namespace directory and, for a named writer, its own directory inside it:
        the descriptor every file of this store is opened relative to (None: not there yet)."""
        fd = self._child_dir(self.root_fds[i], os.path.join(self.roots[i], NAMESPACE_PREFIX + self.digest), need,
                             self.ns_access)
        if fd is None or not self.writer_id:
            return fd
        try:  # this writer's own directory inside the shared namespace
            own = self._child_dir(fd, self.paths[i], need, self.access)
        finally:
            os.close(fd)
        if own is not None and self.writer and self.access.shared:
            uid = os.fstat(own).st_uid
            if uid != os.geteuid():  # planted, or ours renamed away and replaced: never written into
                os.close(own)
                raise WriterDirectoryTakenError(
                    f"writer directory {self.paths[i]!r} belongs to uid {uid}, not to this server's uid "
                    f"{os.geteuid()}: another member of the sharing group made it; use another writer_id (or "
                    "\"auto\"), or have its owner remove it")
        return own

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

    def lock(self, i: int) -> None:
        path = os.path.join(self.paths[i], LOCK)
        # no O_TRUNC: keep the holder's pid; never a link (it would truncate another user's file)
        # A named writer's LOCK is its owner's alone (0600): a group member who could open it
        # could hold its flock and keep the writer from restarting (tests/store/test_store_sharing.py::test_a_member_cannot_lock_replace_or_write_a_named_writers_directory).
        fd = open_file(LOCK, os.O_RDWR | os.O_CREAT, dir_fd=self.ns_fds[i], access=self.access,
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
                f"store root {self.roots[i]!r}: namespace {self.paths[i]!r} already has a writer: "
                f"lock file {path!r} is held by pid {holder}{same}; close that store, or open this one with writer=False"
            ) from None
        self.lock_fds.append(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def expected_manifest(self, i: int, slots_per_slab: int) -> dict[str, Any]:
        return {"format": STORE_FORMAT, "store_version": STORE_VERSION, **self.manifest_fields,
                "slots_per_slab": slots_per_slab, "root_index": i, "num_roots": len(self.roots)}

    def check_manifests(self, present: list[bool], slots_per_slab: int | None) -> int:
        manifests: list[dict | None] = []
        for i, ns in enumerate(self.paths):
            has = present[i] and exists(MANIFEST, self.ns_fds[i])
            manifests.append(read_manifest(ns, self.ns_fds[i]) if has else None)
        for i, m in enumerate(manifests):  # another writer's file: checked before anything divides by it
            v = None if m is None else m.get("slots_per_slab")
            if m is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20):
                raise ManifestMismatchError(
                    f"manifest {os.path.join(self.paths[i], MANIFEST)!r}: slots_per_slab={v!r}, expected an "
                    f"integer in [1, {1 << 20}]; it was edited or damaged: move {self.paths[i]!r} aside")
        stored_sps = {m.get("slots_per_slab") for m in manifests if m is not None}
        if len(stored_sps) > 1:
            raise ManifestMismatchError(f"namespaces {self.paths}: manifests disagree on slots_per_slab ({sorted(map(str, stored_sps))}); they were not written by one store")
        if stored_sps:
            sps = stored_sps.pop()
            if slots_per_slab is not None and slots_per_slab != sps:
                raise ValueError(
                    f"slots_per_slab={slots_per_slab}: the existing namespace {self.paths[0]!r} was created with "
                    f"slots_per_slab={sps}; pass {sps} (or None) or use a fresh root"
                )
        else:
            sps = DEFAULT_SLOTS_PER_SLAB if slots_per_slab is None else slots_per_slab
        for i, m in enumerate(manifests):
            expected = self.expected_manifest(i, sps)
            if m is None:
                if self.writer:
                    write_manifest(self.paths[i], expected, self.ns_fds[i], self.access)
                continue
            self._compare_manifest(i, m, expected)
        return sps

    def _compare_manifest(self, i: int, got: dict, expected: dict) -> None:
        path = os.path.join(self.paths[i], MANIFEST)
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

    def fd(self, r: int) -> int | None:
        """Root r's namespace descriptor; a reader opened before the writer created the
        namespace opens it once it exists (checked like any namespace)."""
        if self.ns_fds[r] is None and self.root_fds[r] is not None:
            self.ns_fds[r] = self.walk(r, os.R_OK | os.X_OK)
        return self.ns_fds[r]

    def check_lock(self) -> None:
        """A writer whose LOCK was unlinked or replaced no longer excludes a second writer: stop."""
        for i, fd in enumerate(self.lock_fds):
            held = os.fstat(fd)
            try:
                now = os.stat(LOCK, dir_fd=self.ns_fds[i], follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_ino, now.st_dev) != (held.st_ino, held.st_dev):
                raise StoreLockedError(
                    f"lock file {os.path.join(self.paths[i], LOCK)!r} was removed or replaced under this writer: "
                    "another writer may have started; stopped recording (restart the server)")

    def close(self) -> None:
        """Release the lock (closing its descriptor drops the flock) and every directory descriptor."""
        for fd in self.lock_fds:
            os.close(fd)
        self.lock_fds.clear()
        for fd in self.ns_fds + self.root_fds:
            if fd is not None:
                os.close(fd)
        self.ns_fds = [None] * len(self.ns_fds)
        self.root_fds = [None] * len(self.root_fds)

    def close_quietly(self) -> None:
        """From a finalizer: close what is open, never raise."""
        for fd in self.lock_fds + self.ns_fds + self.root_fds:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.lock_fds, self.ns_fds, self.root_fds = [], [None] * len(self.ns_fds), [None] * len(self.root_fds)


# ---- helpers ------------------------------------------------------------------------------
_logged: set[str] = set()


def log_once(msg: str) -> None:
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
        files, writer_dirs = scan_namespace(fd)
        # a writer directory counts once its journal is there: an empty `w-*` (made by anyone
        # in the group, thousands of them) is never followed, and so holds no descriptor
        ids = [d[len(WRITER_PREFIX):] for d in writer_dirs
               if WRITER_ID.fullmatch(d[len(WRITER_PREFIX):]) and _is_file(os.path.join(d, JOURNAL), fd)]
    finally:
        os.close(fd)
    return sorted(([""] if files.get(JOURNAL) else []) + ids)


def _is_file(path: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def scan_namespace(fd: int) -> tuple[dict[str, bool], list[str]]:
    """({name: is a regular file} of what else is at a namespace's top, its `w-*` writer
    directories, sorted), never following a link: what the store's followers and `tutti
    inspect` both walk (the tool reports a top-level name that is not a regular file)."""
    files, dirs = {}, []
    for entry in os.scandir(fd):
        if entry.name.startswith(WRITER_PREFIX) and entry.is_dir(follow_symlinks=False):
            dirs.append(entry.name)
        else:
            files[entry.name] = entry.is_file(follow_symlinks=False)
    return files, sorted(dirs)


def exists(name: str, dir_fd: int | None) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        return True
    except FileNotFoundError:
        return False


def free_bytes(dir_fd: int) -> int | None:
    """Bytes an unprivileged writer may still allocate under `dir_fd`'s file system (None: unknown)."""
    try:
        st = os.fstatvfs(dir_fd)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def read_manifest(ns: str, dir_fd: int | None = None) -> dict:
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
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST:
                raise ManifestMismatchError(f"manifest {path!r} is not a regular file under 1 MiB; move {ns!r} aside")
            raw = os.pread(fd, MAX_MANIFEST, 0)
        finally:
            os.close(fd)
    finally:
        if own_fd is not None:
            os.close(own_fd)
    return parse_manifest(raw, path, ns)


def parse_manifest(raw: bytes, path: str, ns: str) -> dict:
    """A manifest's bytes as its dict: JSON, of this store format (the store and `tutti.tools.storetools`
    read manifests through different opens; both parse them here)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ManifestMismatchError(f"manifest {path!r} is not valid JSON ({exc}); it was edited or damaged: "
                                    f"move {ns!r} aside") from exc
    if not isinstance(data, dict) or data.get("format") != STORE_FORMAT:
        raise ManifestMismatchError(f"manifest {path!r} is not a {STORE_FORMAT} manifest; move {ns!r} aside")
    return data


def write_manifest(ns: str, manifest: dict, dir_fd: int, access: Access = PRIVATE) -> None:
    # Atomic: a crash leaves either no manifest (created again on the next open) or a whole one.
    replace_file(MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode("utf-8"), dir_fd=dir_fd,
                 access=access, where=f"manifest {os.path.join(ns, MANIFEST)!r}", durable=True)


def read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def slab_sort_key(name: str) -> tuple[int, str]:
    digits = name[5:-4] if name.startswith("slab-") and name.endswith(".bin") else ""
    return (int(digits) if digits.isdigit() else -1, name)
