"""The store's append-only journal: which slot holds which chunk, durably.

Every record is self-checking (magic, length, type, payload, crc32 over all of it), so a record
cut short by a crash or garbled on disk is recognised and everything from it on is dropped:
the replayed state is always a prefix of what was written, and a put is only appended after its
data is durable, so a prefix never names bytes that are not there.

Records are buffered in memory and written in one go by `sync()`; a failed write or fsync cuts
the file back to its last durable length, so a full disk never leaves half a record that later
appends would hide behind. Compaction rewrites the live state to a temp file, fsyncs it and
renames it over the journal: a crash leaves either the old or the new file, both whole.
"""

from __future__ import annotations

import errno
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from typing import Iterable, Sequence

MAGIC = b"TJR1"
PUT = 1
FREE = 2
MAX_KEY_BYTES = 64
#: A length field larger than this is garbage, not a record (a free of a million slots is 8 MB).
MAX_PAYLOAD = 64 << 20

_HEAD = struct.Struct("<4sIB")  # magic, payload length, type
_CRC = struct.Struct("<I")
_PUT_HEAD = struct.Struct("<QB")  # slot, key length
_COUNT16 = struct.Struct("<H")
_COUNT32 = struct.Struct("<I")
_U64 = 2**64


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


def decode(data: bytes | memoryview, apply: "dict[int, Entry] | None" = None) -> tuple[dict[int, Entry], int]:
    """Replay records from the start of `data`; return (state, end of the last whole record).

    Stops at the first short, unknown or checksum-failing record: what follows a bad record is
    never trusted, so the state is always that of a whole prefix of the journal.
    """
    state: dict[int, Entry] = {} if apply is None else apply
    view = memoryview(data)
    pos, n = 0, len(view)
    while pos + _HEAD.size + _CRC.size <= n:
        magic, length, rtype = _HEAD.unpack_from(view, pos)
        if magic != MAGIC or length > MAX_PAYLOAD:
            break
        end = pos + _HEAD.size + length
        if end + _CRC.size > n:
            break
        (crc,) = _CRC.unpack_from(view, end)
        if zlib.crc32(view[pos:end]) != crc:
            break
        payload = view[pos + _HEAD.size : end]
        if not _apply(state, rtype, payload):
            break
        pos = end + _CRC.size
    return state, pos


def _apply(state: dict[int, Entry], rtype: int, payload: memoryview) -> bool:
    try:
        if rtype == PUT:
            slot, klen = _PUT_HEAD.unpack_from(payload, 0)
            off = _PUT_HEAD.size
            key = bytes(payload[off : off + klen])
            off += klen
            (count,) = _COUNT16.unpack_from(payload, off)
            off += _COUNT16.size
            if off + 8 * count != len(payload) or len(key) != klen or not 0 < klen <= MAX_KEY_BYTES:
                return False
            state[slot] = Entry(key, struct.unpack_from(f"<{count}Q", payload, off))
            return True
        if rtype == FREE:
            (count,) = _COUNT32.unpack_from(payload, 0)
            if _COUNT32.size + 8 * count != len(payload):
                return False
            for s in struct.unpack_from(f"<{count}Q", payload, _COUNT32.size):
                state.pop(s, None)
            return True
    except struct.error:
        return False
    return False


def _check_key(key: object) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise ValueError(f"key={key!r}: expected bytes (e.g. a 32-byte chunk hash)")
    key = bytes(key)
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key: {len(key)} bytes; expected 1..{MAX_KEY_BYTES} bytes (e.g. a 32-byte hash)")
    return key


def _check_slot(slot: object, name: str) -> None:
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < 2**63:
        raise ValueError(f"{name}={slot!r}: expected a non-negative int slot number")


def _check_checksums(checksums: Iterable[int]) -> list[int]:
    sums = list(checksums)
    if not 0 < len(sums) < 2**16:
        raise ValueError(f"checksums: {len(sums)} values; expected one per layer segment (1..65535)")
    for c in sums:
        if not isinstance(c, int) or isinstance(c, bool) or not 0 <= c < _U64:
            raise ValueError(f"checksums: {c!r} is not an unsigned 64-bit int")
    return sums


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
    """The replayed state of a journal file, and (when `writer`) the way to extend it."""

    def __init__(
        self,
        path: str,
        *,
        writer: bool,
        compact_ratio: float = 4.0,
        compact_min_bytes: int = 1 << 20,
    ) -> None:
        if compact_ratio <= 1.0:
            raise ValueError(f"compact_ratio={compact_ratio}: expected > 1 (e.g. 4.0)")
        if compact_min_bytes < 0:
            raise ValueError(f"compact_min_bytes={compact_min_bytes}: expected >= 0")
        self.path = path
        self.tmp_path = path + ".compact"
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
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) last replayed, readers
        self.dropped_tail_bytes = 0  # torn/garbled bytes ignored at the last replay
        if writer:
            self._open_writer()
        else:
            self.reload()

    # -- opening ---------------------------------------------------------------------------
    def _open_writer(self) -> None:
        directory = os.path.dirname(self.path) or "."
        if os.path.exists(self.tmp_path):
            os.unlink(self.tmp_path)  # a compaction killed before its rename: the old file is whole
        created = not os.path.exists(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if created:
            fsync_dir(directory)
        data = _read_all(self._fd)
        self._load(data)
        if self._durable < len(data):
            os.ftruncate(self._fd, self._durable)
            os.fsync(self._fd)

    def reload(self) -> None:
        """Replay the file again (a reader following a live writer). Never writes."""
        if self.writer:
            raise RuntimeError("Journal.reload: a writer's state is already current")
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._seen = None
            self._load(b"")
            return
        try:
            self._seen = _signature(os.fstat(fd))
            self._load(_read_all(fd))
        finally:
            os.close(fd)

    def changed(self) -> bool:
        """Reader: whether the file differs (size, mtime, inode) from the one last replayed:
        one stat, so a reader can follow a live writer every step for microseconds."""
        try:
            return _signature(os.stat(self.path)) != self._seen
        except FileNotFoundError:
            return self._seen is not None

    def _load(self, data: bytes) -> None:
        state, end = decode(data)
        self.entries = state
        self._live = {s: len(encode_put(e.key, s, e.checksums)) for s, e in state.items()}
        self.live_bytes = sum(self._live.values())
        self._durable = end
        self.dropped_tail_bytes = len(data) - end

    # -- appending -------------------------------------------------------------------------
    def append_put(self, key: bytes, slot: int, checksums: Sequence[int]) -> None:
        rec = encode_put(key, slot, checksums)  # validates before any state changes
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
        """Write the buffered records and fsync; on any failure cut back to the durable end."""
        self._flush()
        self._maybe_compact()

    def _flush(self) -> None:
        self._require_writer()
        assert self._fd is not None
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
            pass

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
        data = b"".join(encode_put(e.key, s, e.checksums) for s, e in sorted(self.entries.items()))
        directory = os.path.dirname(self.path) or "."
        fd = os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            _write_all(fd, data, 0)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            _unlink_quiet(self.tmp_path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # Keep the old journal (it is whole) and retry only once it has grown further.
                self._compact_floor = self._durable + max(self.compact_min_bytes, len(data))
                warnings.warn(f"tutti store: journal compaction of {self.path} postponed: disk full", stacklevel=2)
                return False
            raise
        os.close(fd)
        os.rename(self.tmp_path, self.path)
        fsync_dir(directory)
        old, self._fd = self._fd, os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        if old is not None:
            os.close(old)
        self._durable = len(data)
        self._compact_floor = 0
        self.compactions += 1
        return True

    def _require_writer(self) -> None:
        if not self.writer:
            raise RuntimeError(f"journal {self.path} is open read-only (writer=False); open a writer store to record")
        if self._fd is None:
            raise RuntimeError(f"journal {self.path} is closed")

    def close(self) -> None:
        """Close the file. Records not yet synced are dropped, as a crash would drop them."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._pending.clear()


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    parts: list[bytes] = []
    pos = 0
    while pos < size:
        chunk = os.pread(fd, min(size - pos, 16 << 20), pos)
        if not chunk:
            break
        parts.append(chunk)
        pos += len(chunk)
    return b"".join(parts)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns
