"""The writer thread: everything that waits on the disk runs here, never on the thread that
launches the forward pass.

Jobs are plain callables run in order (write a run of chunks, journal a slot free); a job that
raises is logged and the thread goes on. `pending` counts jobs queued and not yet finished, so
`flush` knows when the disk has caught up.
"""

from __future__ import annotations

import logging
import queue as _queue
import threading
import time
from typing import Callable

log = logging.getLogger("tutti.engine")


class Writer:
    def __init__(self, name: str = "tutti-writer") -> None:
        self._jobs: _queue.Queue[Callable[[], None] | None] = _queue.Queue()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # noqa: BLE001 - a writer must never die silently
                log.exception("tutti: writer job failed")
            finally:
                with self._lock:
                    self._pending -= 1

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued job has run; False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self.pending

    def close(self, timeout: float = 30.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=timeout)
