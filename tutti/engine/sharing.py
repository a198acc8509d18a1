"""Many servers, one store: reading the chunks other writers of a namespace made durable.

Every server writes only its own directory of the namespace (`w-<writer_id>/`, or the
namespace's top for writer '') and bounds and evicts only its own files. It reads everyone:

- the scheduler's `ForeignIndex` follows the other writers' journals in a background thread
  (reading only what they appended), so a chunk another server made durable becomes a hit
  here within `follow_interval_s`, and is never stored a second time;
- each worker's `ForeignStores` opens another writer's files read-only when a step first
  loads from it, and checks every chunk against that writer's journal as of the step: a chunk
  its owner evicted or rewrote meanwhile fails its key or checksum check and is recomputed,
  never served. Nothing here writes to another writer's files.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from tutti.engine.worker.context import JournalView
from tutti.engine.sched.planner import rebuild_entries

log = logging.getLogger("tutti.engine")

FOREIGN_CAPACITY = 1 << 62  # readers do not know another writer's capacity: never drop its slots


#: Other writers followed at most: each followed writer holds a few descriptors per store rank for
#: good, so a root with thousands of writer directories must not exhaust the server's.
MAX_FOLLOWED_WRITERS = 128
#: Extras lines kept for chunks no writer has journaled yet (see ForeignIndex._follow_extras).
MAX_EXTRAS_PENDING = 65536


class ForeignIndex:
    """key -> (writer id, slot) of the chunks the OTHER writers hold, on every store rank.

    `open_reader(rank_index, writer_id)` opens a read-only ChunkStore of that writer for one
    store rank (or raises FileNotFoundError); `list_writers()` names the writers present.
    """

    def __init__(self, *, own_id: str, num_ranks: int, list_writers: Callable[[], list[str]],
                 open_reader: Callable[[int, str], object], interval_s: float = 0.2,
                 open_extras: Callable[[str], object] | None = None) -> None:
        """`open_extras(writer)`: a tutti.store.extras.ExtrasReader of that writer's extras, to
        announce its chunks (take_events); None: nothing is announced."""
        self.own_id = own_id
        self._open_extras = open_extras
        self._extras_readers: dict[str, object] = {}
        self._extras: dict[bytes, tuple[str, dict, int]] = {}  # key -> (writer, extras, refresh seen)
        self._announced: dict[bytes, dict] = {}  # key -> the extras it was announced with
        self._events: list[tuple[str, bytes, dict]] = []
        # set: announcements go to it from the follow thread as they are found (a publisher of
        # its own: an idle server announces too); unset: they queue for take_events()
        self.on_events: Callable[[list[tuple[str, bytes, dict]]], None] | None = None
        self.num_ranks = num_ranks
        self._list_writers = list_writers
        self._open_reader = open_reader
        self.interval_s = interval_s
        self._readers: dict[str, list] = {}  # writer -> one reader per store rank
        self._capped = False  # more writers than MAX_FOLLOWED_WRITERS were listed (said once)
        self._map: dict[bytes, tuple[str, int]] = {}
        self._bad: set[tuple[str, int, bytes]] = set()  # failed to load: not served again from there
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refreshes = 0
        self.last_refresh_s = 0.0
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="tutti-follow", daemon=True)
        self._thread.start()

    # -- queries (scheduler thread) -----------------------------------------------------------
    def get(self, key: bytes) -> tuple[str, int] | None:
        hit = self._map.get(key)  # the dict is replaced whole, never mutated: no lock needed
        if hit is None or (hit[0], hit[1], key) in self._bad:
            return None
        return hit

    def __contains__(self, key: bytes) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self._map)

    def failed(self, key: bytes, writer: str, slot: int) -> None:
        """A load of `key` from (writer, slot) failed: not served from there again (a new
        record of the key elsewhere, or in another slot, is)."""
        with self._lock:
            self._bad.add((writer, slot, key))

    @property
    def writers(self) -> list[str]:
        return sorted(self._readers)

    # -- following -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Open writers that appeared, catch up with every followed journal, publish the map."""
        t0 = time.perf_counter()
        for w in self._list_writers():
            if w == self.own_id or w in self._readers:
                continue
            if len(self._readers) >= MAX_FOLLOWED_WRITERS:  # each holds descriptors for good
                if not self._capped:
                    self._capped = True
                    log.warning("tutti: the shared store has more than %d other writers; those past them are "
                                "not followed (their chunks are misses here)", MAX_FOLLOWED_WRITERS)
                break
            try:
                self._readers[w] = [self._open_reader(r, w) for r in range(self.num_ranks)]
            except FileNotFoundError:
                continue  # not on every rank yet: next time
            except Exception as exc:  # noqa: BLE001 - a writer whose files are refused is not followed
                log.warning("tutti: not reading writer %r of the shared store: %s", w, exc)
                self._readers[w] = []
        new: dict[bytes, tuple[str, int]] = {}
        for w, readers in sorted(self._readers.items()):
            if not readers:
                continue
            per_rank = []
            for rd in readers:
                try:
                    rd.refresh_if_changed()
                    per_rank.append({s: e.key for s, e in rd.entries().items()})
                except Exception as exc:  # noqa: BLE001 - its chunks stay unknown until it is readable
                    log.debug("tutti: following writer %r: %s", w, exc)
                    per_rank = []
                    break
            for slot, key in rebuild_entries(per_rank).items():  # held by every store rank, same slot
                new.setdefault(key, (w, slot))
        with self._lock:
            self._map = new
            self._bad = {b for b in self._bad if new.get(b[2]) == (b[0], b[1])}
        if self._open_extras is not None:
            self._follow_extras(new)
        self.refreshes += 1
        self.last_refresh_s = time.perf_counter() - t0

    def _follow_extras(self, new: dict[bytes, tuple[str, int]]) -> None:
        """Read what the followed writers appended to their extras, then queue an announcement
        for each chunk now held with its extras known, and a removal for each announced chunk
        no writer holds any more. A writer appends a chunk's extras after its journal record,
        so extras may be read before the record: they wait a few refreshes for it."""
        n = self.refreshes
        for w, readers in self._readers.items():
            if not readers:
                continue
            rd = self._extras_readers.get(w)
            if rd is None:
                try:
                    rd = self._extras_readers[w] = self._open_extras(w)
                except Exception as exc:  # noqa: BLE001 - announcing is advisory: its chunks still load
                    log.debug("tutti: extras of writer %r: %s", w, exc)
                    continue
            try:
                for key, x in rd.poll():
                    held = new.get(key)
                    if held is not None and held[0] == w:
                        self._extras[key] = (w, x, n)
                    elif held is None and len(self._extras) < MAX_EXTRAS_PENDING:
                        # not journaled yet (a writer appends its extras after the record): kept a
                        # few refreshes, but never more than MAX_EXTRAS lines, whatever a file holds
                        self._extras[key] = (w, x, n)
            except Exception as exc:  # noqa: BLE001
                log.debug("tutti: extras of writer %r: %s", w, exc)
        events = []
        for key in new:
            got = self._extras.get(key)
            if key not in self._announced and got is not None:
                self._announced[key] = got[1]
                events.append(("stored", key, got[1]))
        for key in [k for k in self._announced if k not in new]:
            events.append(("removed", key, self._announced.pop(key)))
        self._extras = {k: v for k, v in self._extras.items() if k in new or n - v[2] < 20}
        if self.on_events is not None:  # every refresh, even with nothing new (it may flush its own)
            try:
                self.on_events(events)
            except Exception:  # noqa: BLE001 - announcing is advisory
                log.exception("tutti: announcing other writers' chunks failed")
        elif events:
            with self._lock:
                self._events.extend(events)

    def take_events(self) -> list[tuple[str, bytes, dict]]:
        """("stored" | "removed", key, extras) of other writers' chunks since the last call."""
        with self._lock:
            out, self._events = self._events, []
        return out

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - following must never stop the scheduler
                log.exception("tutti: following the shared store failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for readers in self._readers.values():
            for rd in readers:
                rd.close()
        self._readers = {}


class ForeignStores:
    """A worker's read-only view of the other writers of its namespace, opened on first use."""

    def __init__(self, open_reader: Callable[[str], object]) -> None:
        self._open_reader = open_reader
        self._stores: dict[str, tuple[object, JournalView]] = {}
        self._lock = threading.Lock()  # the step's loads and asynchronous loads open writers concurrently

    def get(self, writer: str) -> tuple[object, JournalView]:
        """(store, journal view) of `writer`; raises OSError when its files cannot be opened."""
        got = self._stores.get(writer)
        if got is None:
            with self._lock:
                got = self._stores.get(writer)
                if got is None:
                    store = self._open_reader(writer)
                    got = self._stores[writer] = (store, JournalView(store, follows_writer=True))
        return got

    def new_step(self, writers: set[str]) -> dict[str, Exception]:
        """A step loads from these writers: catch up with their journals (only what grew).
        Returns the writers whose files failed (refused, gone, damaged): their chunks fail this
        step, never the step itself."""
        bad: dict[str, Exception] = {}
        with self._lock:  # the step's thread and the asynchronous loads' catch up with one view each
            for w in writers:
                if w in self._stores:
                    try:
                        self._stores[w][1].new_step()
                    except Exception as exc:  # noqa: BLE001 - another writer's files are hostile input
                        bad[w] = exc
        return bad

    def close(self) -> None:
        for store, _ in self._stores.values():
            store.close()
        self._stores = {}
