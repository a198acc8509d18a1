"""Reading a store from the outside: `tutti inspect` and `tutti verify` (and the demo's summary).

Read-only and hostile-input safe: every directory and file is opened relative to a checked
descriptor, never through a link, never blocking on a FIFO; a damaged store is a finding
(exit status 1 in the CLI), a store that cannot be read is a tool error (exit status 2).
Nothing here imports vLLM or the engine.

One idea (a store read as hostile input, to report on it): it opens files its own way, and takes
the store's layout from the store's own pieces (tutti.store.namespace, tutti.store.slabs).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from tutti.store.integrity import CRC_TAG
from tutti.store.namespace import (
    JOURNAL, MANIFEST, NAMESPACE_PREFIX, STORE_VERSION, ManifestMismatchError, parse_manifest,
    scan_namespace, slab_sort_key,
)
from tutti.store.slabs import slab_name

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
_U64 = (1 << 64) - 1  # the journal keeps checksums as unsigned 64-bit values
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_O_FILE = os.O_RDONLY | _O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_MAX_MANIFEST = 1 << 20
_MAX_OFFSET = (1 << 63) - 1
#: Times verify re-reads the journal and a mismatching slot before it gives up on a slot that a
#: live writer keeps rewriting (reported as skipped, never as corrupt).
RECHECKS = 5


class CliError(Exception):
    """A usage problem reported as `tutti: error: ...` with exit status 2."""


class ToolError(Exception):
    """Something the tool could not read (a link, a FIFO, no permission, EMFILE, ...): reported
    apart from bad segments, exit status 2, never counted as corruption."""


class _Damaged(Exception):
    """A namespace whose own files do not describe a valid store (a failed check, exit status 1)."""


# ---- reading a store: read-only, never through a link, never blocking on a FIFO ---------------
def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


def _os_problem(where: str, exc: OSError) -> ToolError:
    hint = {errno.EACCES: "run as the user that runs the server, or fix its permissions",
            errno.EPERM: "run as the user that runs the server, or fix its permissions",
            errno.EMFILE: "raise the open-file limit (ulimit -n) and run again",
            errno.ENFILE: "the system is out of file descriptors; run again later"}.get(exc.errno or 0,
                                                                                    "check the file and run again")
    return ToolError(f"{where}: cannot read it ({exc.strerror or exc} [{_errname(exc)}]); {hint}")


def _describe(st: os.stat_result) -> str:
    m = st.st_mode
    return ("a symbolic link" if stat.S_ISLNK(m) else "a FIFO" if stat.S_ISFIFO(m) else "a socket" if stat.S_ISSOCK(m)
            else "a device" if stat.S_ISCHR(m) or stat.S_ISBLK(m) else "a directory" if stat.S_ISDIR(m)
            else "a regular file" if stat.S_ISREG(m) else "not a regular file")


def _refused(name: str, dir_fd: int, where: str, st: os.stat_result | None, expected: str) -> ToolError:
    what = _describe(st) if st is not None else "not a " + expected
    if st is not None and stat.S_ISLNK(st.st_mode):
        try:
            what += f" (to {os.readlink(name, dir_fd=dir_fd)!r})"
        except OSError:
            pass
        return ToolError(f"{where}: refused, {what}; tutti never follows links out of a store: "
                         "remove the link or move it aside")
    return ToolError(f"{where}: refused, {what} where {expected} should be; move it aside")


def _lstat(name: str, dir_fd: int, where: str) -> os.stat_result:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _os_problem(where, exc) from None


def _open_at(name: str, dir_fd: int, where: str, directory: bool) -> tuple[int, os.stat_result]:
    """A directory or regular file `name` under `dir_fd`: lstat first (anything else, a link, a
    FIFO, a device, is refused before any open: opening a device can have effects), opened
    O_NOFOLLOW (files also O_NONBLOCK), then fstat-ed. FileNotFoundError when missing."""
    expected, is_kind = ("a directory", stat.S_ISDIR) if directory else ("a regular file", stat.S_ISREG)
    st = _lstat(name, dir_fd, where)
    if not is_kind(st.st_mode):
        raise _refused(name, dir_fd, where, st, expected)
    try:
        fd = os.open(name, _O_DIR if directory else _O_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link or another type since the lstat
            raise _refused(name, dir_fd, where, None, expected) from None
        raise _os_problem(where, exc) from None
    try:
        st = os.fstat(fd)
        if not is_kind(st.st_mode):  # swapped since the lstat
            raise _refused(name, dir_fd, where, st, expected)
    except OSError as exc:
        os.close(fd)
        raise _os_problem(where, exc) from None
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _open_dir_at(name: str, dir_fd: int, where: str) -> int:
    """Directory `name` under `dir_fd`, never through a link. FileNotFoundError when missing."""
    return _open_at(name, dir_fd, where, directory=True)[0]


def _open_file_at(name: str, dir_fd: int, where: str) -> tuple[int, os.stat_result]:
    """Regular file `name` under `dir_fd`, opened O_NOFOLLOW|O_NONBLOCK and fstat-ed; anything
    else (link, FIFO, device, directory) is refused. FileNotFoundError when missing."""
    return _open_at(name, dir_fd, where, directory=False)


def _pread_into(fd: int, view: memoryview, pos: int) -> int:
    """Fill `view` from `pos`; fewer bytes only at the end of the file."""
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], pos + got)
        if n <= 0:
            break
        got += n
    return got


def _read_small(fd: int, size: int, limit: int) -> bytes:
    parts, pos = [], 0
    while pos < min(size, limit):
        chunk = os.pread(fd, min(size, limit) - pos, pos)
        if not chunk:
            break
        parts.append(chunk)
        pos += len(chunk)
    return b"".join(parts)


@dataclass
class StoreNamespace:
    """One namespace of a store root, read-only (or the reason it could not be read)."""

    path: str  # the namespace directory in the first root
    digest: str
    roots: tuple[str, ...]
    manifest: dict | None = None
    fingerprint: Any = None  # tutti.store.fingerprint.Fingerprint
    error: str | None = None  # damaged: its files do not describe a valid store (a failed check)
    tool_error: str | None = None  # could not be read (exit status 2)
    dir_fds: list = field(default_factory=list)  # per root: the namespace directory's fd, or None
    namespaces: tuple[str, ...] = ()  # per root: the namespace directory's path
    slots_per_slab: int = 0
    slot_bytes: int = 0
    segment_bytes: int = 0
    num_layers: int = 0
    entries: dict = field(default_factory=dict)  # slot -> tutti.store.journal.Entry
    journal_bytes: int = 0
    journal_live_bytes: int = 0
    _journal_sig: tuple | None = None

    @property
    def usable(self) -> bool:
        return self.error is None and self.tool_error is None and self.manifest is not None

    @property
    def journal_path(self) -> str:
        return os.path.join(self.namespaces[0], JOURNAL)

    def place(self, slot: int) -> tuple[int, int, int]:
        """slot -> (root index, slab index, byte offset in the slab): the store's own layout."""
        from tutti.store.slabs import place

        return place(slot, len(self.roots), self.slots_per_slab, self.slot_bytes)

    def slab_name(self, slot: int) -> tuple[int, int, str]:
        r, slab, _ = self.place(slot)
        return r, slab, slab_name(slab)

    def slab_path(self, slot: int) -> str:
        r, _, name = self.slab_name(slot)
        return os.path.join(self.namespaces[r], name)

    def open_slab(self, r: int, slab: int) -> int | None:
        """A read-only fd of slab `slab` in root `r`; None when it does not exist. ToolError for
        a link, a FIFO, anything but a regular file, or a file that cannot be opened."""
        name = slab_name(slab)
        if self.dir_fds[r] is None:
            return None
        try:
            fd, _ = _open_file_at(name, self.dir_fds[r], f"slab {os.path.join(self.namespaces[r], name)!r}")
        except FileNotFoundError:
            return None
        return fd

    def load_journal(self) -> dict:
        """The journal's state, replayed from the file as it is now (re-read only when its
        inode, size or mtime changed since the last replay). Never writes."""
        from tutti.store.journal import decode_file, encode_put
        where = f"journal {self.journal_path!r}"
        try:
            st = _lstat(JOURNAL, self.dir_fds[0], where)
        except FileNotFoundError:
            self.entries, self.journal_bytes, self.journal_live_bytes, self._journal_sig = {}, 0, 0, None
            return self.entries
        sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
        if sig == self._journal_sig:
            return self.entries
        try:
            fd, st = _open_file_at(JOURNAL, self.dir_fds[0], where)
        except FileNotFoundError:
            self.entries, self.journal_bytes, self.journal_live_bytes, self._journal_sig = {}, 0, 0, None
            return self.entries
        try:
            sig = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)
            state, end = decode_file(fd, st.st_size, repr(self.journal_path))
        except OSError as exc:
            raise _os_problem(where, exc) from None
        finally:
            os.close(fd)
        self.entries = state
        self.journal_bytes = end
        self.journal_live_bytes = sum(_put_bytes(encode_put, s, e) for s, e in state.items())
        self._journal_sig = sig
        return state

    def close(self) -> None:
        for fd in self.dir_fds:
            if fd is not None:
                os.close(fd)
        self.dir_fds = [None] * len(self.dir_fds)


def _put_bytes(encode_put: Any, slot: int, e: Any) -> int:
    try:
        return len(encode_put(e.key, slot, e.checksums))
    except ValueError:  # a record the writer would not write (e.g. no checksums): frame + payload
        return 24 + len(e.key) + 8 * len(e.checksums)


def _check_roots(roots: Sequence[str]) -> list[str]:
    out = []
    for r in roots:
        if not os.path.exists(r):
            raise CliError(f"store root {r!r} does not exist; pass the directory given as the connector's 'root'")
        if not os.path.isdir(r):
            raise CliError(f"store root {r!r} is not a directory; pass the directory given as the connector's 'root'")
        out.append(os.path.abspath(r))
    return out


def _open_root(root: str) -> int:
    try:
        return os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CliError(str(_os_problem(f"store root {root!r}", exc))) from None


def _read_manifest(name: str, dir_fd: int, ns_path: str, *, missing_ok: bool = False) -> dict | None:
    path = os.path.join(ns_path, MANIFEST)
    try:
        fd, st = _open_file_at(name, dir_fd, f"manifest {path!r}")
    except FileNotFoundError:
        if missing_ok:
            return None
        raise _Damaged(f"manifest {path!r} is missing; move {ns_path!r} aside") from None
    try:
        if st.st_size > _MAX_MANIFEST:
            raise _Damaged(f"manifest {path!r} is {st.st_size} B, over 1 MiB; move {ns_path!r} aside")
        raw = _read_small(fd, st.st_size, _MAX_MANIFEST)
    except OSError as exc:
        raise _os_problem(f"manifest {path!r}", exc) from None
    finally:
        os.close(fd)
    try:
        return parse_manifest(raw, path, ns_path)
    except ManifestMismatchError as exc:
        raise _Damaged(str(exc)) from None


def _load_namespace(ns: StoreNamespace, root_fds: list[int], name: str) -> None:
    from tutti.store.fingerprint import Fingerprint

    ns.dir_fds = [None] * len(root_fds)
    ns.dir_fds[0] = _open_dir_at(name, root_fds[0], f"namespace {ns.path!r}")
    m = _read_manifest(MANIFEST, ns.dir_fds[0], ns.path)
    assert m is not None
    ns.manifest = m
    try:
        fp = Fingerprint.from_dict(m["fingerprint"])
        sps, slot_bytes = m["slots_per_slab"], m["slot_bytes"]
    except (KeyError, TypeError, ValueError) as exc:
        raise _Damaged(f"manifest {os.path.join(ns.path, MANIFEST)!r}: {type(exc).__name__}: {exc}; "
                       f"move {ns.path!r} aside") from None
    if m.get("digest") != ns.digest or fp.digest() != ns.digest:
        raise _Damaged(f"manifest {os.path.join(ns.path, MANIFEST)!r}: digest {m.get('digest')!r}, fingerprint "
                       f"digest {fp.digest()!r}, directory digest {ns.digest!r}: they must agree; the manifest was "
                       f"edited or moved: its chunks cannot be trusted; move {ns.path!r} aside")
    expected = {"store_version": STORE_VERSION, "segment_bytes": fp.segment_bytes, "num_layers": fp.num_layers,
                "slot_bytes": fp.num_layers * fp.segment_bytes}
    for key, want in expected.items():
        if m.get(key) != want:
            raise _Damaged(f"manifest {os.path.join(ns.path, MANIFEST)!r}: {key}={m.get(key)!r}, expected {want!r}; "
                           f"it was edited or written by another store version: move {ns.path!r} aside")
    if not isinstance(sps, int) or isinstance(sps, bool) or sps < 1:
        raise _Damaged(f"manifest {os.path.join(ns.path, MANIFEST)!r}: slots_per_slab={sps!r}, expected a positive "
                       f"int; move {ns.path!r} aside")
    if m.get("num_roots", 1) != len(ns.roots):
        raise ToolError(f"namespace {ns.path!r} is striped over {m.get('num_roots')} roots; pass all of them, "
                        f"in the server's order (got {len(ns.roots)})")
    if m.get("root_index", 0) != 0:
        raise ToolError(f"namespace {ns.path!r} is stripe {m.get('root_index')} of its store; pass the store's "
                        "roots in the server's order")
    ns.fingerprint, ns.slots_per_slab, ns.slot_bytes = fp, sps, slot_bytes
    ns.segment_bytes, ns.num_layers = fp.segment_bytes, fp.num_layers
    for i in range(1, len(root_fds)):  # the other stripes: a namespace not created there yet is empty
        where = f"namespace {ns.namespaces[i]!r}"
        if root_fds[i] is None:
            continue
        try:
            ns.dir_fds[i] = _open_dir_at(name, root_fds[i], where)
        except FileNotFoundError:
            continue
        other = _read_manifest(MANIFEST, ns.dir_fds[i], ns.namespaces[i], missing_ok=True)
        if other is None:
            continue
        if other.get("digest") != ns.digest or other.get("root_index") != i:
            raise ToolError(f"{where}: its manifest says stripe {other.get('root_index')} of namespace "
                            f"{other.get('digest')}, but it is given as stripe {i} of {ns.digest}; pass the "
                            "store's roots in the server's order")
    ns.load_journal()


def open_namespaces(roots: Sequence[str], capacity_bytes: int | None = None) -> list[StoreNamespace]:
    """Every namespace under roots[0], opened read-only. Raises CliError when there is none, or
    when a root cannot be read; a namespace that cannot be read carries its reason instead
    (`error`: damaged, `tool_error`: unreadable). `capacity_bytes` is not needed to read."""

    roots = _check_roots(roots)
    root_fds: list[int] = []
    out: list[StoreNamespace] = []
    try:
        for r in roots:
            root_fds.append(_open_root(r))
        try:
            names = sorted(os.listdir(root_fds[0]))
        except OSError as exc:
            raise CliError(str(_os_problem(f"store root {roots[0]!r}", exc))) from None
        for name in names:
            if not name.startswith(NAMESPACE_PREFIX):
                continue
            path = os.path.join(roots[0], name)
            ns = StoreNamespace(path, name[len(NAMESPACE_PREFIX):], tuple(roots),
                                namespaces=tuple(os.path.join(r, name) for r in roots))
            try:
                st = _lstat(name, root_fds[0], f"namespace {path!r}")
            except FileNotFoundError:
                continue  # removed since the listing
            except ToolError as exc:
                ns.tool_error = str(exc)
                out.append(ns)
                continue
            if stat.S_ISREG(st.st_mode):
                continue  # a file named like a namespace: not ours, not a namespace
            writers = _writer_dirs(name, root_fds[0], path)
            if writers is None or writers[0] or not writers[1]:  # the top holds a writer's files, or no writer dir
                out.append(ns)
                _try_load(ns, root_fds, name, path)
            for wdir in (writers or (False, []))[1]:
                wpath = os.path.join(path, wdir)
                wns = StoreNamespace(wpath, ns.digest, tuple(roots), namespaces=tuple(
                    os.path.join(r, name, wdir) for r in roots))
                out.append(wns)
                top_fds = []
                try:
                    for i, rfd in enumerate(root_fds):
                        try:
                            top_fds.append(_open_dir_at(name, rfd, f"namespace {ns.namespaces[i]!r}"))
                        except FileNotFoundError:
                            top_fds.append(None)
                    _try_load(wns, top_fds, wdir, wpath)
                except ToolError as exc:
                    wns.tool_error = str(exc)
                finally:
                    for fd in top_fds:
                        if fd is not None:
                            os.close(fd)
        if not out:
            raise CliError(
                f"{roots[0]!r} is not a tutti store root: it holds no '{NAMESPACE_PREFIX}<digest>' namespace directory "
                "(pass the directory given as the connector's 'root', after a server stored something)")
    except BaseException:
        _close_all(out)
        raise
    finally:
        for fd in root_fds:
            os.close(fd)
    return out


def _writer_dirs(name: str, root_fd: int, path: str) -> tuple[bool, list[str]] | None:
    """(whether the namespace's top holds a writer's files, its `w-<id>` writer directories), or
    None when the namespace cannot be listed (loading it then says why)."""

    try:
        fd = _open_dir_at(name, root_fd, f"namespace {path!r}")
    except (OSError, ToolError):
        return None
    try:
        files, dirs = scan_namespace(fd)
        return MANIFEST in files, dirs
    except OSError:
        return None
    finally:
        os.close(fd)


def _try_load(ns: StoreNamespace, parent_fds: list, name: str, path: str) -> None:
    """_load_namespace, with what goes wrong recorded on `ns` (damaged or unreadable)."""
    try:
        if parent_fds[0] is None:
            raise FileNotFoundError(path)
        _load_namespace(ns, parent_fds, name)
    except FileNotFoundError:
        ns.error = f"namespace {path!r} disappeared while reading it"
    except _Damaged as exc:
        ns.error = str(exc)
    except ToolError as exc:
        ns.tool_error = str(exc)
    except OSError as exc:
        ns.tool_error = str(_os_problem(f"namespace {path!r}", exc))


def _close_all(nss: Sequence[StoreNamespace]) -> None:
    for ns in nss:
        ns.close()


def _size(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _size_or_raw(n: Any) -> str:
    return _size(n) if isinstance(n, int) and not isinstance(n, bool) else repr(n)


# ---- inspect -----------------------------------------------------------------------------------
def _slab_stats(ns: StoreNamespace) -> tuple[list[dict[str, Any]], list[str]]:
    """Every slab file of the namespace (lstat only: nothing is opened or followed) and the
    files refused on the way (a link, a FIFO, ...)."""
    slabs: list[dict[str, Any]] = []
    problems: list[str] = []
    for r, dfd in enumerate(ns.dir_fds):
        if dfd is None:
            continue
        try:
            names = os.listdir(dfd)
        except OSError as exc:
            problems.append(str(_os_problem(f"namespace {ns.namespaces[r]!r}", exc)))
            continue
        for name in sorted(names, key=slab_sort_key):
            if not (name.startswith("slab-") and name.endswith(".bin")):
                continue
            path = os.path.join(ns.namespaces[r], name)
            try:
                st = _lstat(name, dfd, f"slab {path!r}")
            except FileNotFoundError:
                continue
            except ToolError as exc:
                problems.append(str(exc))
                continue
            if not stat.S_ISREG(st.st_mode):
                problems.append(str(_refused(name, dfd, f"slab {path!r}", st, "a regular file")))
                continue
            slabs.append({"path": path, "size_bytes": st.st_size, "allocated_bytes": st.st_blocks * 512})
    return slabs, problems


def inspect_data(roots: Sequence[str], capacity_bytes: int | None = None) -> list[dict[str, Any]]:
    """What `tutti inspect --json` prints: one dict per namespace. `error` says why a namespace
    could not be read; `tool_errors` lists every file the tool refused or could not read."""
    nss = open_namespaces(roots, capacity_bytes)
    try:
        out = []
        for ns in nss:
            d: dict[str, Any] = {"path": ns.path, "digest": ns.digest, "error": ns.error or ns.tool_error,
                                 "tool_errors": [ns.tool_error] if ns.tool_error else []}
            if ns.manifest is not None:
                d["fingerprint"] = ns.manifest.get("fingerprint")
                d["slots_per_slab"] = ns.manifest.get("slots_per_slab")
            if ns.fingerprint is not None:  # how segments are stored (tutti.codec); segment_bytes is then its stride
                d["codec"] = ns.fingerprint.codec
            if ns.usable:
                slabs, problems = _slab_stats(ns)
                d["tool_errors"].extend(problems)
                per_slab: dict[str, int] = {}
                for slot in ns.entries:
                    p = ns.slab_path(slot)
                    per_slab[p] = per_slab.get(p, 0) + 1
                for s in slabs:
                    s["slots_used"] = per_slab.get(s["path"], 0)
                d.update(chunks=len(ns.entries), slot_bytes=ns.slot_bytes, bytes_used=len(ns.entries) * ns.slot_bytes,
                         capacity_bytes=capacity_bytes, journal_path=ns.journal_path, journal_bytes=ns.journal_bytes,
                         journal_live_bytes=ns.journal_live_bytes, slabs=slabs)
            out.append(d)
        return out
    finally:
        _close_all(nss)


def _inspect_text(roots: Sequence[str], data: Sequence[dict[str, Any]]) -> list[str]:
    lines = [f"store {', '.join(os.path.abspath(r) for r in roots)}:"]
    for d in data:
        lines.append(f"  namespace {d['digest']} ({d['path']})")
        fp = d.get("fingerprint")
        if isinstance(fp, dict):
            lines.append(
                f"    model {fp.get('model')}  dtype {fp.get('cache_dtype')}  format v{fp.get('format_version')}  "
                f"chunk {fp.get('chunk_tokens')} tokens  layers {fp.get('num_layers')}  H {fp.get('num_heads')}  "
                f"C {fp.get('content_bytes')} B  segment {_size_or_raw(fp.get('segment_bytes'))}")
            lines.append(f"    ranks: tp {fp.get('tp_rank')}/{fp.get('tp_size')}  pp {fp.get('pp_rank')}/{fp.get('pp_size')}")
        if d.get("codec") not in (None, "identity"):
            lines.append(f"    codec {d['codec']}: segments stored encoded (segment is the stored stride); "
                         "verify decodes them with --codec")
        if d.get("error"):
            lines.append(f"    ERROR: {d['error']}")
            continue
        for problem in d.get("tool_errors", []):
            lines.append(f"    ERROR: {problem}")
        cap = d.get("capacity_bytes")
        used = d["bytes_used"]
        if cap:
            fill = f" of {_size(cap)} capacity ({100.0 * used / cap:.1f}%)"
        else:
            fill = " (capacity is the server's capacity_bytes, not kept on disk: pass --capacity to see the fill)"
        lines.append(f"    chunks {d['chunks']} x {_size(d['slot_bytes'])} = {_size(used)}{fill}")
        slabs = d["slabs"]
        sps = d.get("slots_per_slab") or 0
        lines.append(f"    slab files {len(slabs)} ({sps} slots each): "
                     f"{_size(sum(s['size_bytes'] for s in slabs))} long, "
                     f"{_size(sum(s['allocated_bytes'] for s in slabs))} on disk")
        for s in slabs:
            lines.append(f"      {os.path.basename(s['path'])}: {s['slots_used']}/{sps} slots used, "
                         f"{_size(s['size_bytes'])} long, {_size(s['allocated_bytes'])} on disk")
        lines.append(f"    journal {_size(d['journal_bytes'])} ({_size(d['journal_live_bytes'])} live records)")
    return lines


def inspect_lines(roots: Sequence[str], capacity_bytes: int | None = None) -> list[str]:
    """Human-readable store summary (used by `tutti inspect` and the demo)."""
    return _inspect_text(roots, inspect_data(roots, capacity_bytes))


# ---- verify ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mismatch:
    digest: str
    slot: int
    layer: int | None
    detail: str

    def __str__(self) -> str:
        where = f"slot {self.slot}" + (f" layer {self.layer}" if self.layer is not None else "")
        return f"namespace {self.digest} {where}: {self.detail}"


@dataclass
class VerifyResult:
    namespaces: int = 0
    slots: int = 0  # chunks checked to the end
    segments: int = 0
    bytes_read: int = 0
    mismatches: list = field(default_factory=list)  # bad segments and damaged namespaces: exit 1
    errors: list = field(default_factory=list)  # what the tool could not read: exit 2, not corruption
    skipped: list = field(default_factory=list)  # (digest, slot, why): freed or rewritten by a live writer


class _SegmentReader:
    """Reads one segment at a time into one reusable buffer (memory: one segment, whatever the
    slot or store size) and checksums it; a namespace written with a codec: decoded first into a
    second buffer of one raw segment (checksums cover the raw bytes)."""

    def __init__(self, segment_bytes: int, crc_bytes: int | None = None, hybrid: bool = False,
                 codec: Any = None, raw_bytes: int = 0) -> None:
        import torch

        from tutti.kernels import segment_checksum

        self._buf = bytearray(segment_bytes)  # a layer's stride as stored
        self.view = memoryview(self._buf)
        self.codec = codec
        self._raw = bytearray(raw_bytes) if codec is not None else self._buf
        self._encoded = codec.max_encoded_bytes(raw_bytes) if codec is not None else segment_bytes
        self._tensor = torch.frombuffer(self._raw, dtype=torch.uint8).view(1, len(self._raw))
        self._checksum = segment_checksum
        self.crc_bytes = crc_bytes  # a tier namespace: the CRC tag of the chunk's content bytes
        self.hybrid = hybrid  # several KV cache groups: a segment journaled 0 was not written

    def read(self, fd: int, pos: int) -> int:
        return _pread_into(fd, self.view, pos)

    def checksum(self) -> int:
        """The checksum of the segment read last; ValueError where a codec's stored bytes do not
        decode (hostile or damaged bytes: the codec's contract)."""
        if self.codec is not None:
            try:
                self.codec.decode(self.view[:self._encoded], memoryview(self._raw))
            except ValueError:
                raise
            except Exception as exc:  # noqa: BLE001 - the codec's own bug: not the store's damage
                raise ToolError(f"codec {self.codec.name!r} failed while decoding ({type(exc).__name__}: {exc}); "
                                "check the codec given with --codec") from None
        if self.crc_bytes is not None:
            from tutti.store.integrity import crc_tag

            return crc_tag(memoryview(self._raw)[:self.crc_bytes])
        return int(self._checksum(self._tensor).reshape(-1)[0]) & _U64


def _check_slot(ns: StoreNamespace, fd: int, slot: int, entry: Any, seg: _SegmentReader,
                res: VerifyResult) -> list[Mismatch]:
    """Every segment of `slot` against `entry`, read one segment at a time. Bad segments are
    returned; a read the tool could not do (anything but EIO) raises ToolError."""
    _, _, off = ns.place(slot)
    S, path = ns.segment_bytes, ns.slab_path(slot)
    bad = []
    for layer in range(ns.num_layers):
        pos = off + layer * S
        if seg.hybrid and layer < len(entry.checksums) and int(entry.checksums[layer]) & _U64 == 0:
            continue  # a hybrid entry's segment its writer did not write (no blocks of that layer): never loaded
        if pos + S > _MAX_OFFSET:  # a journaled slot no file can reach
            bad.append(Mismatch(ns.digest, slot, layer, f"offset {pos} is past the largest file offset"))
            continue
        try:
            n = seg.read(fd, pos)
        except OSError as exc:
            if exc.errno == errno.EIO:  # the medium cannot return these bytes: what verify looks for
                bad.append(Mismatch(ns.digest, slot, layer, f"read error ({exc.strerror}) at {path} offset {pos}"))
                continue
            raise _os_problem(f"slab {path!r}", exc) from None
        res.bytes_read += n
        if n < (S if seg.crc_bytes is None else seg.crc_bytes):  # a tier chunk is not padded on disk
            bad.append(Mismatch(ns.digest, slot, layer,
                                f"short read: {path} ends before this segment (offset {pos})"))
            continue
        if layer >= len(entry.checksums):
            bad.append(Mismatch(ns.digest, slot, layer, "no checksum journaled for this layer"))
            continue
        try:
            want, got = int(entry.checksums[layer]) & _U64, seg.checksum()
        except ValueError as exc:
            bad.append(Mismatch(ns.digest, slot, layer,
                                f"does not decode with codec {seg.codec.name!r}: {exc} ({path} offset {pos})"))
            continue
        if want != got:
            bad.append(Mismatch(ns.digest, slot, layer,
                                f"checksum mismatch: journal {want:#018x}, data {got:#018x} ({path} offset {pos})"))
    return bad


def _missing_slab(ns: StoreNamespace, slot: int) -> list[Mismatch]:
    return [Mismatch(ns.digest, slot, None, f"slab file {ns.slab_path(slot)} is missing; the journal says it holds "
                                            "this chunk")]


def _verify_namespace(ns: StoreNamespace, res: VerifyResult, bar: Any, codec: Any = None) -> None:
    from tutti.format import segment_bytes

    fp = ns.fingerprint
    extra = dict(fp.extra)
    seg = _SegmentReader(ns.segment_bytes, fp.content_bytes if extra.get("integrity") == CRC_TAG else None,
                         hybrid=bool(extra.get("groups")), codec=codec,
                         raw_bytes=segment_bytes(fp.chunk_tokens, fp.num_heads * fp.content_bytes))
    fds: dict[tuple[int, int], int | None] = {}  # the slab being read (one open at a time)
    failed: dict[tuple[int, int], list] = {}  # slab -> [message, chunks not checked]

    def slab_fd(r: int, slab: int, reopen: bool) -> int | None:
        if (r, slab) not in fds or reopen:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)
            fds.clear()
            fds[(r, slab)] = ns.open_slab(r, slab)
        return fds[(r, slab)]

    def check(slot: int, entry: Any, reopen: bool = False) -> list[Mismatch]:
        r, slab, _ = ns.place(slot)
        fd = slab_fd(r, slab, reopen)
        return _missing_slab(ns, slot) if fd is None else _check_slot(ns, fd, slot, entry, seg, res)

    try:
        for slot, entry in sorted(ns.entries.items(), key=lambda kv: ns.place(kv[0])):
            bar.update(1)
            key = ns.place(slot)[:2]
            if key in failed:
                failed[key][1] += 1
                continue
            skipped = None
            try:
                bad = check(slot, entry)
                # A mismatch is reported only once confirmed: a live writer frees a slot, rewrites
                # it and then journals the new chunk, so the journal read at the start may be
                # stale. Re-read the journal and the slot until the slot is gone (freed), matches
                # its fresh record, or still differs from a record that did not move across the
                # re-read (journal read before and after it).
                attempts, confirmed = 0, False
                while bad and not confirmed:
                    if attempts == RECHECKS:
                        skipped = f"rewritten by a live writer {attempts} times while verifying; not checked"
                        break
                    attempts += 1
                    fresh = ns.load_journal().get(slot)
                    if fresh is None:
                        skipped = "freed by a live writer while verifying"
                        break
                    unchanged, entry = fresh == entry, fresh
                    bad = check(slot, entry, reopen=True)
                    if bad and unchanged:
                        confirmed = ns.load_journal().get(slot) == entry
            except ToolError as exc:
                failed[key] = [str(exc), 1]
                continue
            if skipped is not None:
                res.skipped.append((ns.digest, slot, skipped))
                continue
            res.slots += 1
            res.segments += ns.num_layers
            res.mismatches.extend(bad)
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)
    for msg, count in failed.values():
        res.errors.append(f"{msg} ({count} chunk(s) not checked)")


def _given_codecs(specs: Sequence[Any]) -> list[Any]:
    """The codecs named with --codec ("package.module:attr" or a registered name), made."""
    from tutti.codec import get_codec

    out = []
    for spec in specs:
        try:
            out.append(get_codec(spec))
        except ValueError as exc:
            raise CliError(f"--codec {spec!r}: {exc}") from None
    return out


def _namespace_codec(ns: StoreNamespace, given: Sequence[Any]) -> tuple[Any, str | None]:
    """(the codec that decodes `ns`'s segments, None for "identity"; why it cannot be checked,
    or None): one given with --codec, else one this process has registered, of the name its
    fingerprint records and the stride its manifest says."""
    from tutti.codec import available_codecs, encoded_stride, get_codec
    from tutti.format import segment_bytes

    name = ns.fingerprint.codec
    if name == "identity":
        return None, None
    found = [c for c in given if c.name == name]
    if not found:
        for registered in available_codecs():
            try:
                codec = get_codec(registered)
            except ValueError:
                continue
            if codec.name == name:
                found.append(codec)
                break
    if not found:
        return None, (f"namespace {ns.path!r}: written with codec {name!r}: pass --codec package.module:attr "
                      "(the codec of that name) to check it")
    raw = segment_bytes(ns.fingerprint.chunk_tokens, ns.fingerprint.num_heads * ns.fingerprint.content_bytes)
    try:
        stride = encoded_stride(found[0], raw)
    except ValueError as exc:
        return None, f"namespace {ns.path!r}: written with codec {name!r}: {exc}"
    if stride != ns.segment_bytes:
        return None, (f"namespace {ns.path!r}: written with codec {name!r} at a stride of {ns.segment_bytes} B; "
                      f"the codec of that name given here encodes into {stride} B: pass the codec it was "
                      "written with (--codec) to check it")
    return found[0], None


def verify_store(roots: Sequence[str], *, progress: bool | None = None, codecs: Sequence[Any] = ()) -> VerifyResult:
    """Read every stored segment (one at a time), recompute its checksum, compare with the journal;
    a mismatch is re-checked against the journal read again (a live writer may have rewritten
    the slot) before it is reported. What the tool cannot read goes to `errors`, never to
    `mismatches`. A namespace written with a codec is decoded first (checksums cover the raw
    bytes) with the codec of its name from `codecs` ("package.module:attr", a registered name
    or a codec object) or this process's registry; without one it is not checked (an error that
    says to pass --codec), never reported corrupt."""
    given = _given_codecs(codecs)
    try:
        from tqdm import tqdm
    except ImportError:  # no progress bar, same result
        progress = False

        class tqdm:  # type: ignore[no-redef]
            def __init__(self, **kw): ...
            def update(self, n): ...
            def close(self): ...

    res = VerifyResult()
    nss = open_namespaces(roots)
    try:
        total = sum(len(ns.entries) for ns in nss if ns.usable)
        bar = tqdm(total=total, unit="chunk", desc="verify", disable=(None if progress is None else not progress),
                   file=sys.stderr)
        for ns in nss:
            res.namespaces += 1
            if ns.tool_error is not None:
                res.errors.append(ns.tool_error)
                continue
            if not ns.usable:
                res.mismatches.append(Mismatch(ns.digest, -1, None, f"namespace cannot be opened: {ns.error}"))
                continue
            integrity = dict(ns.fingerprint.extra).get("integrity")
            if integrity and integrity != CRC_TAG:
                res.errors.append(f"namespace {ns.path!r}: its segments carry keyed tags ({integrity}), not "
                                  "checksums; verify cannot check them without the server's secret")
                bar.update(len(ns.entries))
                continue
            codec, unchecked = _namespace_codec(ns, given)
            if unchecked is not None:
                res.errors.append(unchecked)
                bar.update(len(ns.entries))
                continue
            _verify_namespace(ns, res, bar, codec)
        bar.close()
    finally:
        _close_all(nss)
    return res
