"""Loads vLLM does not wait for inside a step: its asynchronous loads.

The request sits in vLLM's waiting queue until the worker reports it received; meanwhile its
chunks are read, verified and scattered on a thread of their own, with their own staging slots
and CUDA stream, so the forward passes of other requests never wait for them. The outcome is
per request: received, or failed (any chunk that could not be read or failed its checksum),
which vLLM turns into a recompute of the request. Why this exists: with several KV cache groups
(hybrid models) vLLM cannot take a synchronous load failure block by block, only per request.
"""

from __future__ import annotations

import queue as _queue
import threading
from contextlib import nullcontext

import torch

from tutti.engine.context import log
from tutti.engine.plan import LoadChunk


class AsyncLoads:
    def __init__(self, pipeline) -> None:
        """`pipeline`: a LoadPipeline over its own staging ring (not the step's)."""
        self.pipeline = pipeline
        self.stream = torch.cuda.Stream(pipeline.ctx.device) if pipeline.ctx.cuda else None
        self._jobs: _queue.Queue = _queue.Queue()
        self._lock = threading.Lock()
        self._received: set[str] = set()
        self._failed: set[str] = set()
        self._pending = 0
        self._thread = threading.Thread(target=self._loop, name="tutti-async-loads", daemon=True)
        self._thread.start()

    def submit(self, step: int, loads: list[LoadChunk]) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put((step, list(loads)))

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def take(self) -> tuple[set[str], set[str]]:
        """(received, failed) requests since the last call."""
        with self._lock:
            out = (self._received, self._failed)
            self._received, self._failed = set(), set()
            return out

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, loads = job
            try:
                failed = self._run(loads)
            except Exception:  # noqa: BLE001 - every request of the job fails (vLLM recomputes), the thread goes on
                log.exception("tutti: asynchronous loads of step %d failed", step)
                failed = {ld.key for ld in loads}
            reqs = {ld.req_id for ld in loads}
            bad = {ld.req_id for ld in loads if ld.key in failed}
            counters = self.pipeline.counters
            with counters.lock:
                counters.report.steps_done.append(step)  # the planner unpins their chunks
            with self._lock:
                self._received |= reqs - bad
                self._failed |= bad
                self._pending -= 1

    def _run(self, loads: list[LoadChunk]) -> set[bytes]:
        """Every layer of `loads`, verified; returns the keys that failed."""
        lp = self.pipeline
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:  # "the compute stream" of these loads is this thread's own stream
            lp.start(loads, layerwise=False)
            lp.finish()
            lp.take_failed_blocks()  # resolves the device verdicts (this thread waits, nobody else)
            if self.stream is not None:
                self.stream.synchronize()  # the scatters landed before vLLM is told
        return lp.take_failed_keys()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
