"""An IO backend that reads at a set rate, as a slow disk or a busy network file system does:
the threads backend whose reads sleep their share of the rate (writes go at full speed).
Chosen with `"io_backend": "throttled_backend:make"` and `"io_options": {"read_bytes_per_s": ...}`."""

import threading
import time

from tutti.io.threads import ThreadQueue


class ThrottledQueue(ThreadQueue):
    name = "throttled"

    def __init__(self, read_bytes_per_s: float = 2e6, **kw) -> None:
        super().__init__(**kw)
        self.rate = float(read_bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0  # one shared device: reads queue behind each other

    def submit(self, requests):
        delay = 0.0
        nbytes = sum(r.length for r in requests if r.op == "read")
        if nbytes:
            with self._lock:
                now = time.monotonic()
                self._free_at = max(self._free_at, now) + nbytes / self.rate
                delay = self._free_at - now
        if delay > 0:
            time.sleep(delay)
        return super().submit(requests)


def make(read_bytes_per_s: float = 2e6, workers: int = 2) -> ThrottledQueue:
    return ThrottledQueue(read_bytes_per_s=read_bytes_per_s, workers=workers)
