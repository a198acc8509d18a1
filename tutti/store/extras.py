"""Per-chunk extras a writer publishes beside its journal, for other servers to announce.

Why: a router credits a server only with blocks it announces under vLLM's own block hashes. A
server that learned a chunk from another writer's journal knows the chunk's key, not those
hashes: they chain from the prompt's first block and depend on vLLM's hash seed. So the writer
of a chunk appends them here once the chunk is durable, and every reader announces them.

Advisory data: nothing read here is ever served as KV (a chunk's bytes are checked against its
own journal and checksums), and a line that does not parse, or is too long, is skipped. The file
is opened as every store file is (tutti.io.safefs: no links, no FIFOs, ours or the sharing
group's, one link, not writable by others).

Format: `extras.jsonl` in the writer's directory, one JSON object per line,
`{"k": "<chunk key, hex>", "x": {...}}`; appended, and rewritten (a temporary, then a rename)
with only the live keys when it holds `COMPACT_FACTOR` times as many lines as there are.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Iterable, Iterator

from tutti.io.safefs import PRIVATE, Access, check_fd, open_dir, open_file, replace_file

EXTRAS = "extras.jsonl"
MAX_LINE = 64 << 10  # bytes; a longer line is neither written nor read
# bytes read per poll: a huge file is followed in steps, never at once, so one refresh parses at
# most this much beside the scheduler (a writer appends a line of ~100 B per chunk it stores)
MAX_READ = 1 << 20
MAX_KEY_HEX = 128
COMPACT_FACTOR = 4


class ExtrasWriter:
    """Appends (key, extras) lines to `extras.jsonl` in `directory` (the writer's own)."""

    def __init__(self, directory: str, access: Access = PRIVATE, live: Iterable[bytes] = ()) -> None:
        """`live`: the chunks this writer holds (its journal): their lines from an earlier run
        are kept (rewritten), every other line is dropped."""
        self.directory = directory
        self.access = access
        self._dir = open_dir(directory, check=True, access=access, where=f"writer directory {directory!r}")
        self._lock = threading.Lock()
        self._lines = 0
        keep = set(live)
        self._live: dict[bytes, str] = {}
        if keep:
            rd = ExtrasReader(directory, access)
            while True:  # the whole file, a step at a time; only the held chunks' lines are kept
                offset = rd.offset
                for key, extras in rd.poll():
                    if key in keep:
                        self._live[key] = _line(key, extras)
                if rd.offset == offset:
                    break
        self._fd = -1
        self.compact()

    def lookup(self, key: bytes) -> dict[str, Any] | None:
        """The extras this writer recorded for `key` (kept from an earlier run, or appended)."""
        line = self._live.get(key)
        return None if line is None else json.loads(line)["x"]

    def items(self) -> list[tuple[bytes, dict[str, Any]]]:
        """(key, extras) of every chunk this writer holds extras for."""
        with self._lock:
            lines = list(self._live.items())
        return [(k, json.loads(line)["x"]) for k, line in lines]

    def append(self, items: Iterable[tuple[bytes, dict[str, Any]]]) -> int:
        """Write these chunks' extras (one write call); returns how many lines were written."""
        out = []
        with self._lock:
            for key, extras in items:
                line = _line(key, extras)
                if len(line) > MAX_LINE:
                    continue
                out.append(line)
                self._live[key] = line
            if out:
                os.write(self._fd, "".join(out).encode())
                self._lines += len(out)
        return len(out)

    def forget(self, keys: Iterable[bytes]) -> None:
        """These chunks were evicted: their lines go at the next compaction."""
        with self._lock:
            for k in keys:
                self._live.pop(k, None)
        if self._lines > COMPACT_FACTOR * max(len(self._live), 256):
            self.compact()

    def compact(self) -> None:
        """Rewrite the file with the live keys only (tutti.io.safefs.replace_file)."""
        with self._lock:
            replace_file(EXTRAS, "".join(self._live.values()).encode(), dir_fd=self._dir, access=self.access,
                         where=f"{self.directory}/{EXTRAS}")
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = open_file(EXTRAS, os.O_WRONLY | os.O_APPEND, dir_fd=self._dir, access=self.access,
                                 where=f"{self.directory}/{EXTRAS}")
            self._lines = len(self._live)

    def close(self) -> None:
        for fd in (self._fd, self._dir):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._fd = self._dir = -1


class ExtrasReader:
    """Follows another writer's `extras.jsonl`: each poll yields the lines appended since the
    last (all of them again after the file was rewritten or replaced). Hostile input: any line
    that is not a {"k": hex, "x": object} of bounded size is skipped."""

    def __init__(self, directory: str, access: Access = PRIVATE) -> None:
        self.directory = directory
        self.access = access
        self._ino: tuple[int, int] | None = None
        self._offset = 0
        self._tail = b""
        self.skipped = 0  # lines refused

    @property
    def offset(self) -> int:
        """Bytes of the current file read so far."""
        return self._offset

    def poll(self) -> Iterator[tuple[bytes, dict[str, Any]]]:
        try:
            d = open_dir(self.directory, check=True, access=self.access, where=f"writer directory {self.directory!r}")
        except OSError:
            return
        try:
            try:
                fd = open_file(EXTRAS, os.O_RDONLY, dir_fd=d, access=self.access, where=f"{self.directory}/{EXTRAS}")
            except OSError:
                return
        finally:
            os.close(d)
        try:
            st = check_fd(fd, f"{self.directory}/{EXTRAS}", access=self.access)
            ino = (st.st_dev, st.st_ino)
            if ino != self._ino or st.st_size < self._offset:  # rewritten, replaced or truncated: from the top
                self._ino, self._offset, self._tail = ino, 0, b""
            if st.st_size <= self._offset:
                return
            data = os.pread(fd, min(MAX_READ, st.st_size - self._offset), self._offset)
        except OSError:
            return
        finally:
            os.close(fd)
        self._offset += len(data)
        data = self._tail + data
        lines = data.split(b"\n")
        self._tail = lines.pop()
        if len(self._tail) > MAX_LINE:  # a line that never ends: dropped
            self._tail, self.skipped = b"", self.skipped + 1
        for raw in lines:
            got = _parse(raw)
            if got is None:
                self.skipped += 1
            else:
                yield got


def _line(key: bytes, extras: dict[str, Any]) -> str:
    return json.dumps({"k": key.hex(), "x": extras}, separators=(",", ":")) + "\n"


def _parse(raw: bytes) -> tuple[bytes, dict[str, Any]] | None:
    if not raw or len(raw) > MAX_LINE:
        return None
    try:
        obj = json.loads(raw)
        k, x = obj["k"], obj["x"]
        if not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_HEX or not isinstance(x, dict):
            return None
        return bytes.fromhex(k), x
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
        return None
