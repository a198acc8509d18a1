"""The store's append-only journal: which slot holds which chunk, durably.

Every record is self-checking (magic, length, type, payload, crc32 over all of it). Replay reads
the file in bounded blocks and never raises on its content:

* a whole record (valid CRC) whose content is not one the writer could have written (malformed,
  a slot >= `max_slot` or >= 2**63, no checksums, or a checksum count other than
  `expected_checksums`) is skipped, counted and logged;
* a damaged record (bad magic, length or CRC) followed by a valid record is skipped the same way:
  replay resynchronises at the next offset where a whole valid record starts, so one flipped bit
  costs one record, not everything after it;
* damaged bytes that no valid record follows are a torn tail (a crash mid-append): dropped, and
  cut away by the next writer. Only such a tail is ever truncated.

A put is only appended after its data is durable, so a replayed put never names bytes that are
not there. Records are buffered in memory and written in one go by `sync()`; a failed write or
fsync cuts the file back to its last durable length, so a full disk never leaves half a record
that later appends would hide behind. Compaction rewrites the live state to a temp file (created
exclusively, never through a link), fsyncs it and renames it over the journal: a crash leaves
either the old or the new file, both whole.

One idea, one module (its length is the record format, its replay and its compaction, which
must agree byte for byte): nothing else reads or writes `journal.bin`.

The file is opened as a storage engine opens its files (`tutti.io.safefs`): relative to a
directory descriptor when given, never following a link, never blocking on a FIFO, and refused
unless it is a regular file of ours with one link and no group or world write bit. A writer checks
before every sync that the path still names its file at the size it wrote, and stops with
`JournalReplacedError` otherwise.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

from tutti.io.safefs import PRIVATE, Access, UnsafeFileError, open_file

__all__ = [
    "Entry",
    "Journal",
    "JournalReplacedError",
    "UnsafeFileError",
    "decode",
    "encode_free",
    "encode_put",
    "fsync_dir",
]

log = logging.getLogger("tutti.io")

MAGIC = b"TJR1"
PUT = 1
FREE = 2
MAX_KEY_BYTES = 64
#: A length field larger than this is garbage, not a record (a free of a million slots is 8 MB).
MAX_PAYLOAD = 64 << 20
#: Replay reads the file this many bytes at a time (its memory does not grow with the file).
BLOCK_BYTES = 1 << 20
#: Skipped records remembered (offset, reason) and logged one by one; the rest are only counted.
MAX_SKIP_DETAILS = 8

_HEAD = struct.Struct("<4sIB")  # magic, payload length, type
_CRC = struct.Struct("<I")
_PUT_HEAD = struct.Struct("<QB")  # slot, key length
_COUNT16 = struct.Struct("<H")
_COUNT32 = struct.Struct("<I")
_U64 = 2**64
_SLOT_LIMIT = 2**63
_FRAME = _HEAD.size + _CRC.size  # bytes of a record besides its payload
#: The largest payload a put can have (64-byte key, 65535 checksums): < BLOCK_BYTES.
_MAX_PUT_PAYLOAD = _PUT_HEAD.size + MAX_KEY_BYTES + _COUNT16.size + 8 * 0xFFFF
_SLOTS_PER_READ = BLOCK_BYTES // 8


class JournalReplacedError(RuntimeError):
    """A writer's journal file was removed, replaced (renamed over) or resized by someone else:
    appending to the descriptor would write into a file nobody replays. Stop recording."""


@dataclass(frozen=True)
class Entry:
    """A slot's content: the chunk key and one checksum per layer segment."""

    key: bytes
    checksums: tuple[int, ...]


def encode_put(key: bytes, slot: int, checksums: Sequence[int]) -> bytes:
    key = _check_key(key)
    _check_slot(slot, "slot")
    sums = _check_checksums(checksums)
    payload = _PUT_HEAD.pack(slot, len(key)) + key + _COUNT16.pack(len(sums)) + struct.pack(f"<{len(sums)}Q", *sums)
    return _frame(PUT, payload)


def encode_free(slots: Sequence[int]) -> bytes:
    slots = list(slots)
    for s in slots:
        _check_slot(s, "slots[]")
    payload = _COUNT32.pack(len(slots)) + struct.pack(f"<{len(slots)}Q", *slots)
    return _frame(FREE, payload)


def _frame(rtype: int, payload: bytes) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"journal record of {len(payload)} B exceeds {MAX_PAYLOAD} B; free fewer slots per record")
    body = _HEAD.pack(MAGIC, len(payload), rtype) + payload
    return body + _CRC.pack(zlib.crc32(body))


# ---- replay ------------------------------------------------------------------------------
class _Window:
    """Random access to `size` bytes through `read(offset, n)`, holding one block at a time."""

    def __init__(self, read: Callable[[int, int], bytes], size: int,
                 next_data: Callable[[int], int | None] | None = None) -> None:
        self._read = read
        self._next_data = next_data  # the first offset >= off that is not in a hole (None: none)
        self.size = size
        self._base = 0
        self._buf = b""

    def _cover(self, off: int, n: int) -> int:
        """Make [off, off+n) (n <= BLOCK_BYTES) the buffered range if it is not; return off's index."""
        rel = off - self._base
        if rel < 0 or rel + n > len(self._buf):
            self._buf = b""  # drop the old block before reading the next one
            want = min(max(n, BLOCK_BYTES), self.size - off)
            self._buf = self._read(off, want) if want > 0 else b""
            self._base = off
            if len(self._buf) < want:  # the file shrank while being replayed: it ends here
                self.size = off + len(self._buf)
            rel = 0
        return rel

    def get(self, off: int, n: int) -> memoryview:
        """Up to n (<= BLOCK_BYTES) bytes at off: fewer only at the end of the data."""
        rel = self._cover(off, n)
        return memoryview(self._buf)[rel : rel + n]

    def find(self, needle: bytes, off: int) -> int:
        """Offset of the first `needle` at or after off, or -1; scans block by block."""
        k = len(needle)
        while off + k <= self.size:
            if self._next_data is not None:
                # a hole reads as zeros, which hold no needle: skip it without reading it (a
                # sparse file of GiBs is scanned in a few calls, and fills no page cache)
                data = self._next_data(off)
                if data is None:
                    return -1
                off = max(off, data)
                if off + k > self.size:
                    return -1
            n = min(BLOCK_BYTES, self.size - off)
            rel = self._cover(off, n)
            hit = self._buf.find(needle, rel, rel + n)
            if hit >= 0:
                return self._base + hit
            if off + n >= self.size:
                return -1
            off += n - (k - 1)  # blocks overlap by k-1 bytes: a needle across a boundary is found
        return -1

    def crc(self, off: int, n: int) -> int | None:
        """crc32 of [off, off+n), read in blocks; None if the data ends first."""
        value = 0
        end = off + n
        while off < end:
            piece = self.get(off, min(BLOCK_BYTES, end - off))
            if not piece:
                return None
            value = zlib.crc32(piece, value)
            off += len(piece)
        return value


class _Replay:
    """One pass over a journal's bytes: state, where whole records end, what was skipped."""

    def __init__(self, window: _Window, *, expected_checksums: int | None, max_slot: int | None,
                 warn: Callable[[int, str], None], state: dict[int, Entry] | None = None) -> None:
        self.w = window
        self.expected = expected_checksums
        self.max_slot = max_slot
        self.warn = warn
        self.state: dict[int, Entry] = {} if state is None else state
        self.live: dict[int, int] = {}  # slot -> encoded size of its put record
        self.end = 0  # end of the last whole record (valid CRC), or of a damaged region before one
        self.skipped = 0
        self.details: list[tuple[int, str]] = []
        self.tail = 0

    # a frame: (None, end, rtype, length) when whole, else (reason, ...)
    def _frame_at(self, pos: int) -> tuple[str | None, int, int, int]:
        head = self.w.get(pos, _HEAD.size)
        if len(head) < _HEAD.size:
            return "incomplete record header", 0, 0, 0
        magic, length, rtype = _HEAD.unpack_from(head, 0)
        if magic != MAGIC:
            return "bad magic", 0, 0, 0
        limit = _MAX_PUT_PAYLOAD if rtype == PUT else MAX_PAYLOAD
        if length > limit:
            return f"length field {length} exceeds {limit}", 0, 0, 0
        body_end = pos + _HEAD.size + length
        if body_end + _CRC.size > self.w.size:
            return f"record of {length + _FRAME} B runs past the end of the file", 0, 0, 0
        crc = self.w.crc(pos, _HEAD.size + length)
        stored = self.w.get(body_end, _CRC.size)
        if crc is None or len(stored) < _CRC.size:
            return f"record of {length + _FRAME} B runs past the end of the file", 0, 0, 0
        if _CRC.unpack_from(stored, 0)[0] != crc:
            return "CRC mismatch", 0, 0, 0
        return None, body_end + _CRC.size, rtype, length

    def _next_valid(self, start: int) -> int | None:
        off = start
        while True:
            hit = self.w.find(MAGIC, off)
            if hit < 0:
                return None
            if self._frame_at(hit)[0] is None:
                return hit
            off = hit + 1

    def run(self, start: int = 0) -> "_Replay":
        pos = self.end = start
        while pos < self.w.size:
            reason, end, rtype, length = self._frame_at(pos)
            if reason is None:
                self._apply(pos, rtype, length)
                pos = self.end = end
                continue
            nxt = self._next_valid(pos + 1)
            if nxt is None:  # nothing valid follows: a torn tail
                break
            self._skip(pos, f"{reason}; {nxt - pos} damaged bytes skipped up to the next valid record at offset {nxt}")
            pos = self.end = nxt
        self.tail = self.w.size - self.end
        return self

    def _skip(self, pos: int, reason: str) -> None:
        self.skipped += 1
        if len(self.details) < MAX_SKIP_DETAILS:
            self.details.append((pos, reason))
            self.warn(pos, reason)

    def _apply(self, pos: int, rtype: int, length: int) -> None:
        payload_off = pos + _HEAD.size
        try:
            if rtype == PUT:
                reason = self._apply_put(self.w.get(payload_off, length), length + _FRAME)
            elif rtype == FREE:
                reason = self._apply_free(payload_off, length)
            else:
                reason = f"unknown record type {rtype}"
        except struct.error as exc:  # only if the file shrank under the replay: never raise on content
            reason = f"record cut short while being read ({exc})"
        if reason is not None:
            self._skip(pos, reason)

    def _apply_put(self, payload: memoryview, size: int) -> str | None:
        n = len(payload)
        if n < _PUT_HEAD.size + 1 + _COUNT16.size:
            return f"malformed put: payload of {n} B"
        slot, klen = _PUT_HEAD.unpack_from(payload, 0)
        in_range = slot < _SLOT_LIMIT and (self.max_slot is None or slot < self.max_slot)
        reason = None
        if not 0 < klen <= MAX_KEY_BYTES or _PUT_HEAD.size + klen + _COUNT16.size > n:
            reason = f"malformed put: key length {klen}"
        else:
            off = _PUT_HEAD.size + klen
            (count,) = _COUNT16.unpack_from(payload, off)
            off += _COUNT16.size
            if off + 8 * count != n:
                reason = f"malformed put: {count} checksums do not fill a payload of {n} B"
            elif slot >= _SLOT_LIMIT:
                reason = f"put of slot {slot} >= 2**63"
            elif self.max_slot is not None and slot >= self.max_slot:
                reason = f"put of slot {slot} >= max_slot {self.max_slot}"
            elif count == 0:
                reason = f"put of slot {slot} has no checksums"
            elif self.expected is not None and count != self.expected:
                reason = f"put of slot {slot} has {count} checksums, expected {self.expected}"
            else:
                key = bytes(payload[_PUT_HEAD.size : _PUT_HEAD.size + klen])
                self.state[slot] = Entry(key, struct.unpack_from(f"<{count}Q", payload, off))
                self.live[slot] = size
                return None
        if in_range:
            # The record says this slot was rewritten: what it held before can no longer be trusted.
            self.state.pop(slot, None)
            self.live.pop(slot, None)
        return reason

    def _slots(self, off: int, count: int) -> Iterator[tuple[int, ...]]:
        done = 0
        while done < count:
            k = min(_SLOTS_PER_READ, count - done)
            yield struct.unpack_from(f"<{k}Q", self.w.get(off + 8 * done, 8 * k), 0)
            done += k

    def _apply_free(self, off: int, n: int) -> str | None:
        if n < _COUNT32.size:
            return f"malformed free: payload of {n} B"
        (count,) = _COUNT32.unpack_from(self.w.get(off, _COUNT32.size), 0)
        if _COUNT32.size + 8 * count != n:
            return f"malformed free: {count} slots do not fill a payload of {n} B"
        first = off + _COUNT32.size
        for group in self._slots(first, count):
            if max(group, default=0) >= _SLOT_LIMIT:
                return "free of a slot >= 2**63"
        # Slots >= max_slot are legitimate history (a store reopened smaller frees them): they
        # hold nothing here (puts of them are skipped), so they are simply ignored.
        for group in self._slots(first, count):
            for s in group:
                self.state.pop(s, None)
                self.live.pop(s, None)
        return None


def decode(
    data: bytes | memoryview,
    apply: "dict[int, Entry] | None" = None,
    *,
    expected_checksums: int | None = None,
    max_slot: int | None = None,
) -> tuple[dict[int, Entry], int]:
    """Replay records from `data`; return (state, end of the last whole record).

    Invalid records are skipped (see the module docstring); damaged bytes at the end that no
    valid record follows (a torn tail) are not part of `end`.
    """
    view = memoryview(data)
    window = _Window(lambda off, n: bytes(view[off : off + n]), len(view))
    r = _Replay(window, expected_checksums=expected_checksums, max_slot=max_slot, state=apply,
                warn=lambda pos, reason: _warn_skip("<data>", pos, reason)).run()
    return r.state, r.end


def decode_file(fd: int, size: int, where: str) -> tuple[dict[int, Entry], int]:
    """decode() of the first `size` bytes of an open journal, read a block at a time and over
    its holes (a sparse 3 GiB journal is never allocated whole): what the read-only tools use."""
    r = _Replay(_Window(_pread_reader(fd), size, _next_data(fd)), expected_checksums=None, max_slot=None,
                warn=lambda pos, reason: _warn_skip(where, pos, reason)).run()
    return r.state, r.end


def _warn_skip(where: str, pos: int, reason: str) -> None:
    log.warning("tutti journal %s: skipped the record at byte offset %d: %s", where, pos, reason)


def _next_data(fd: int) -> Callable[[int], int | None]:
    seek_data = getattr(os, "SEEK_DATA", None)

    def next_data(off: int) -> int | None:
        if seek_data is None:
            return off
        try:
            return os.lseek(fd, off, seek_data)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data at or after off
                return None
            return off  # not supported here: read everything

    return next_data


def _pread_reader(fd: int) -> Callable[[int, int], bytes]:
    def read(off: int, n: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        while got < n:
            chunk = os.pread(fd, n - got, off + got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    return read


# ---- argument checks ---------------------------------------------------------------------
def _check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ValueError(f"key={key!r}: expected bytes (e.g. a 32-byte chunk hash)")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key: {len(key)} bytes; expected 1..{MAX_KEY_BYTES} bytes (e.g. a 32-byte hash)")
    return key


def _check_slot(slot: object, name: str) -> None:
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < _SLOT_LIMIT:
        raise ValueError(f"{name}={slot!r}: expected a non-negative int slot number")


def _check_checksums(checksums: Iterable[int]) -> list[int]:
    sums = list(checksums)
    if not 0 < len(sums) < 2**16:
        raise ValueError(f"checksums: {len(sums)} values; expected one per layer segment (1..65535)")
    for c in sums:
        if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < _U64:
            raise ValueError(f"checksums: {c!r} is not an unsigned 64-bit int")
    return sums


def _optional_positive(value: object, name: str, top: int) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= top:
        raise ValueError(f"{name}={value!r}: expected None or an int in [1, {top}]")
    return value


def fsync_dir(path: str) -> None:
    """Make a rename or file creation in `path` durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    # os.pwrite may write less than asked (signals, a nearly full disk): loop until done.
    view = memoryview(data)
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        done += n


class Journal:
    """The replayed state of a journal file, and (when `writer`) the way to extend it.

    `dir_fd`: a descriptor of the journal's directory; `path`'s basename is then opened (and the
    compaction temp created, renamed and removed) relative to it, `path` naming it in messages.
    `access`: whose files are accepted and how created ones are shared (tutti.io.safefs.Access);
    `file_mode`: mode of a journal or temp file this creates (default: `access.file_mode`; group
    write only when the access is shared, world write never).
    `expected_checksums`, `max_slot`: when given, a put with another checksum count or a slot
    >= max_slot is skipped at replay (counted in `skipped_records`) and refused by append_put.
    """

    def __init__(
        self,
        path: str,
        *,
        writer: bool,
        compact_ratio: float = 4.0,
        compact_min_bytes: int = 1 << 20,
        dir_fd: int | None = None,
        file_mode: int | None = None,
        access: Access = PRIVATE,
        expected_checksums: int | None = None,
        max_slot: int | None = None,
    ) -> None:
        if compact_ratio <= 1.0:
            raise ValueError(f"compact_ratio={compact_ratio}: expected > 1 (e.g. 4.0)")
        if compact_min_bytes < 0:
            raise ValueError(f"compact_min_bytes={compact_min_bytes}: expected >= 0")
        if file_mode is None:
            file_mode = access.file_mode
        forbidden = 0o002 if access.shared else 0o022
        if not isinstance(file_mode, int) or isinstance(file_mode, bool) or file_mode & ~0o777 or file_mode & forbidden:
            raise ValueError(f"file_mode={file_mode!r}: expected permission bits without "
                             f"{'world' if access.shared else 'group/world'} write (e.g. {access.file_mode:#o})")
        if dir_fd is not None and (not isinstance(dir_fd, int) or isinstance(dir_fd, bool) or dir_fd < 0):
            raise ValueError(f"dir_fd={dir_fd!r}: expected None or an open directory descriptor")
        self.expected_checksums = _optional_positive(expected_checksums, "expected_checksums", 0xFFFF)
        self.max_slot = _optional_positive(max_slot, "max_slot", _SLOT_LIMIT)
        self.path = path
        self.tmp_path = path + ".compact"
        self.dir_fd = dir_fd
        self.file_mode = file_mode
        self.access = access
        self._name = os.path.basename(path) if dir_fd is not None else path
        self._tmp_name = self._name + ".compact"
        if dir_fd is not None and not self._name:
            raise ValueError(f"path={path!r}: names a directory; expected the journal file's path")
        self.writer = writer
        self.compact_ratio = compact_ratio
        self.compact_min_bytes = compact_min_bytes
        self.entries: dict[int, Entry] = {}
        self._live: dict[int, int] = {}  # slot -> encoded size of its put record
        self.live_bytes = 0
        self._pending: list[bytes] = []
        self._durable = 0  # bytes of whole, fsynced records in the file
        self._compact_floor = 0  # after a compaction that hit ENOSPC, wait for this size
        self.compactions = 0
        self._fd: int | None = None
        self._ident: tuple[int, int] | None = None  # (device, inode) of the writer's file
        self._ragged = False  # a failed write could not be cut back: the size may exceed _durable
        self._replaced: str | None = None  # why this writer stopped (JournalReplacedError)
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) last replayed, readers
        self.dropped_tail_bytes = 0  # torn/garbled bytes ignored at the last replay
        self.skipped_records = 0  # invalid or damaged records skipped at the last replay
        self.skipped_details: list[tuple[int, str]] = []  # (byte offset, reason) of the first few of them
        self.followed_bytes = 0  # bytes the last follow() read
        self._missing = 0  # follows in a row that found no file
        self._warned: set[tuple[int | None, int]] = set()  # (inode, offset) of skipped records logged
        if writer:
            self._open_writer()
        else:
            self.reload()

    # -- opening ---------------------------------------------------------------------------
    def _where(self, tmp: bool = False) -> str:
        return f"journal {(self.tmp_path if tmp else self.path)!r}"

    def _open(self, flags: int, *, tmp: bool = False) -> int:
        return open_file(self._tmp_name if tmp else self._name, flags, dir_fd=self.dir_fd, mode=self.file_mode,
                         access=self.access,
                         where=self._where(tmp))

    def _lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _sync_dir(self) -> None:
        if self.dir_fd is None:
            fsync_dir(os.path.dirname(self.path) or ".")
        else:
            os.fsync(self.dir_fd)

    def _remove_tmp(self) -> None:
        try:
            os.unlink(self._tmp_name, dir_fd=self.dir_fd)  # unlink never follows a link
        except FileNotFoundError:
            pass

    def _open_writer(self) -> None:
        self._remove_tmp()  # a compaction killed before its rename: the old file is whole
        created = False
        try:
            fd = self._open(os.O_RDWR)
        except FileNotFoundError:
            fd = self._open(os.O_RDWR | os.O_CREAT | os.O_EXCL)
            created = True
        try:
            if created:
                self._sync_dir()
            st = os.fstat(fd)
            self._replay(fd, st.st_size)
            if self._durable < st.st_size:  # only a torn tail: no valid record follows it
                os.ftruncate(fd, self._durable)
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._ident = (st.st_dev, st.st_ino)

    def reload(self) -> None:
        """Replay the file again (a reader following a live writer). Never writes."""
        if self.writer:
            raise RuntimeError("Journal.reload: a writer's state is already current")
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            self._seen = None
            self._replay(None, 0)
            return
        try:
            st = os.fstat(fd)
            self._seen = _signature(st)
            self._replay(fd, st.st_size)
        finally:
            os.close(fd)

    def follow(self) -> bool:
        """Reader: catch up with a live writer reading only what it appended since the last
        replay (from the end of the last whole record: a torn tail is read again), when the file
        is the same one and did not shrink below that; anything else (compacted, replaced) is a
        full replay. Returns whether anything changed; `followed_bytes` says what was read."""
        if self.writer:
            raise RuntimeError("Journal.follow: a writer's state is already current")
        try:
            fd = self._open(os.O_RDONLY)
        except FileNotFoundError:
            self.followed_bytes = 0
            # A file missing once is kept for one more follow: on a distributed file system an
            # open racing the writer's rename (compaction) can find no file for an instant, and
            # dropping every entry then failed the loads in flight and struck that writer's chunks
            # for good (tests/distributed). Missing again: the writer's journal is gone.
            self._missing += 1
            if self._missing >= 2 and (self._seen is not None or self.entries):
                self._seen = None
                self._replay(None, 0)
                return True
            return False
        self._missing = 0
        try:
            st = os.fstat(fd)
            sig = _signature(st)
            self.followed_bytes = 0
            if sig == self._seen:
                return False
            if self._seen is None or st.st_ino != self._seen[0] or st.st_size < self._durable:
                self._seen = sig
                self._replay(fd, st.st_size)
                self.followed_bytes = st.st_size
                return True
            start = self._durable
            self._replay(fd, st.st_size, start=start)
            self._seen = sig
            self.followed_bytes = st.st_size - start
            return True
        finally:
            os.close(fd)

    def changed(self) -> bool:
        """Reader: whether the file differs (size, mtime, inode) from the one last replayed:
        one stat, so a reader can follow a live writer every step for microseconds."""
        st = self._lstat(self._name)
        return (st is not None) if self._seen is None else (st is None or _signature(st) != self._seen)

    def _replay(self, fd: int | None, size: int, *, start: int = 0) -> None:
        """Replay the file's records: all of them, or (start > 0, a follower catching up) those
        from `start` on top of the state already replayed."""
        if fd is None:
            window = _Window(lambda off, n: b"", 0)
        else:
            window = _Window(_pread_reader(fd), size, _next_data(fd))
        ident = os.fstat(fd).st_ino if fd is not None else None

        def warn(pos: int, reason: str) -> None:
            # a reader replays after every change of the file: each bad record is logged once
            if (ident, pos) not in self._warned and len(self._warned) < 64 * MAX_SKIP_DETAILS:
                self._warned.add((ident, pos))
                _warn_skip(repr(self.path), pos, reason)

        r = _Replay(window, expected_checksums=self.expected_checksums, max_slot=self.max_slot, warn=warn,
                    state=self.entries if start else None)
        if start:
            r.live = self._live
        r.run(start)
        self.entries = r.state
        self._live = r.live
        self.live_bytes = sum(r.live.values())
        self._durable = r.end
        self.dropped_tail_bytes = r.tail
        if start:  # a follower: a torn tail is the writer's append in progress, not news
            self.skipped_records += r.skipped
            return
        if r.skipped > len(r.details) and r.skipped != self.skipped_records:
            log.warning("tutti journal %r: %d invalid or damaged records skipped in all (the first %d logged)",
                        self.path, r.skipped, len(r.details))
        if r.tail:
            log.info("tutti journal %r: dropped a torn tail of %d B at byte offset %d", self.path, r.tail, r.end)
        self.skipped_records = r.skipped
        self.skipped_details = r.details

    # -- appending -------------------------------------------------------------------------
    def append_put(self, key: bytes, slot: int, checksums: Sequence[int]) -> None:
        rec = encode_put(key, slot, checksums)  # validates before any state changes
        if self.max_slot is not None and slot >= self.max_slot:
            raise ValueError(f"slot={slot}: expected < max_slot={self.max_slot}")
        if self.expected_checksums is not None and len(checksums) != self.expected_checksums:
            raise ValueError(f"checksums: {len(checksums)} values; expected {self.expected_checksums} (one per layer segment)")
        self._require_writer()
        self._pending.append(rec)
        self.entries[slot] = Entry(bytes(key), tuple(checksums))
        self.live_bytes += len(rec) - self._live.get(slot, 0)
        self._live[slot] = len(rec)

    def append_free(self, slots: Sequence[int]) -> None:
        slots = list(slots)
        if not slots:
            return
        rec = encode_free(slots)
        self._require_writer()
        self._pending.append(rec)
        for s in slots:
            self.entries.pop(s, None)
            self.live_bytes -= self._live.pop(s, 0)

    def sync(self) -> None:
        """Write the buffered records and fsync; on any failure cut back to the durable end.
        Raises JournalReplacedError if the file was replaced, removed or resized under this writer."""
        self._flush()
        self._maybe_compact()

    def _check_same_file(self) -> None:
        """The path must still name the file this writer holds, at the size it wrote."""
        assert self._fd is not None
        if self._replaced is None:
            held = os.fstat(self._fd)
            now = self._lstat(self._name)
            if now is None or (now.st_dev, now.st_ino) != self._ident:
                what = "removed" if now is None else "replaced by another file"
                self._replaced = f"was {what} under this writer"
            elif held.st_size != self._durable:
                if self._ragged and held.st_size > self._durable:
                    try:  # our own failed write left bytes past the durable end: cut them now
                        os.ftruncate(self._fd, self._durable)
                        self._ragged = False
                        return
                    except OSError:
                        return  # still our own garbage; the write below overwrites it
                self._replaced = (f"was truncated or extended under this writer: {held.st_size} B, "
                                  f"expected the {self._durable} B it wrote")
        if self._replaced is not None:
            raise JournalReplacedError(
                f"{self._where()} {self._replaced}; stopped recording (another process may be writing the store; "
                "restart the server)")

    def _flush(self) -> None:
        self._require_writer()
        assert self._fd is not None
        self._check_same_file()
        if self._pending:
            data = b"".join(self._pending)
            try:
                _write_all(self._fd, data, self._durable)
                os.fsync(self._fd)
            except OSError:
                self._cut_back()
                raise
            self._durable += len(data)
            self._pending.clear()

    def _cut_back(self) -> None:
        # Drop whatever part of the failed write landed; if even that fails, the garbage is a
        # tail that replay ignores and that the retried write (at the same offset) overwrites.
        try:
            os.ftruncate(self._fd, self._durable)  # type: ignore[arg-type]
        except OSError:
            self._ragged = True

    @property
    def size_bytes(self) -> int:
        """Durable bytes in the file (whole records)."""
        return self._durable

    @property
    def pending_records(self) -> int:
        return len(self._pending)

    # -- compaction ------------------------------------------------------------------------
    def _maybe_compact(self) -> None:
        threshold = max(self.compact_ratio * self.live_bytes, self.compact_min_bytes, self._compact_floor)
        if self._durable > threshold:
            self.compact()

    def compact(self) -> bool:
        """Rewrite the file as the live state only. Returns False if the disk was full."""
        self._flush()  # the live state below includes the buffered records: write those first
        # in the order the chunks were stored (entries keep it: a slot is freed before it is put
        # again), so a replay after compaction rebuilds the same recency (ChunkIndex.rebuild)
        data = b"".join(encode_put(e.key, s, e.checksums) for s, e in self.entries.items())
        self._remove_tmp()
        # exclusive and never through a link: a planted temp (or link) is removed above, not written
        fd = self._open(os.O_RDWR | os.O_CREAT | os.O_EXCL, tmp=True)
        try:
            _write_all(fd, data, 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            try:
                self._remove_tmp()
            except OSError:
                pass
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # Keep the old journal (it is whole) and retry only once it has grown further.
                self._compact_floor = self._durable + max(self.compact_min_bytes, len(data))
                warnings.warn(f"tutti store: journal compaction of {self.path} postponed: disk full", stacklevel=2)
                return False
            raise
        try:
            st = os.fstat(fd)
            if self.dir_fd is None:
                os.rename(self.tmp_path, self.path)
            else:
                os.rename(self._tmp_name, self._name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except BaseException:
            os.close(fd)
            raise
        # the temp's descriptor is now the journal's: no reopen by name, which could meet another file
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        self._ident = (st.st_dev, st.st_ino)
        self._durable = len(data)
        self._ragged = False
        self._compact_floor = 0
        self.compactions += 1
        self._sync_dir()  # (if this fails, the rename may not survive a crash; either file is whole)
        return True

    def _require_writer(self) -> None:
        if not self.writer:
            raise RuntimeError(f"journal {self.path} is open read-only (writer=False); open a writer store to record")
        if self._fd is None:
            raise RuntimeError(f"journal {self.path} is closed")

    def close(self) -> None:
        """Close the file. Records not yet synced are dropped, as a crash would drop them. The
        descriptor is released whatever close reports (a FUSE client that died reports ENOTCONN):
        never closed twice, never raised to a caller closing everything else."""
        fd, self._fd = self._fd, None
        self._pending.clear()
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns
