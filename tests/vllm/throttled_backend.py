"""An IO backend that reads at a set rate, as a slow disk or a busy network file system does:
the threads backend whose reads complete only when a device of `read_bytes_per_s` would have
served them, one after another (submission returns at once, as it does on a real drive).
Writes go at full speed. Chosen with `"io_backend": "throttled_backend:make"` and
`"io_options": {"read_bytes_per_s": ...}`."""

import threading
import time

from tutti.io.queue import IOFuture
from tutti.io.threads import ThreadQueue


class ThrottledQueue(ThreadQueue):
    name = "throttled"

    def __init__(self, read_bytes_per_s: float = 2e6, **kw) -> None:
        super().__init__(**kw)
        self.rate = float(read_bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0  # one shared device: reads queue behind each other

    def submit(self, requests):
        requests = list(requests)
        nbytes = sum(r.length for r in requests if r.op == "read")
        if not nbytes:
            return super().submit(requests)
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.rate
            delay = self._free_at - now
        outs = [IOFuture(r) for r in requests]

        def run() -> None:
            for inner, out in zip(ThreadQueue.submit(self, requests), outs):
                inner.add_done_callback(lambda f, out=out: out.set_exception(f._error) if f._error is not None
                                        else out.set_result(f._result))

        t = threading.Timer(delay, run)
        t.daemon = True
        t.start()
        return outs


def make(read_bytes_per_s: float = 2e6, workers: int = 2) -> ThrottledQueue:
    return ThrottledQueue(read_bytes_per_s=read_bytes_per_s, workers=workers)
