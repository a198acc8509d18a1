"""Loads vLLM does not wait for inside a step: its asynchronous loads.

The request sits in vLLM's waiting queue until the worker reports it received; meanwhile its
chunks are read, verified and scattered on a thread of their own, with their own staging slots
and CUDA stream, so the forward passes of other requests never wait for them. The outcome is
per request: received, or failed (any chunk that could not be read or failed its checksum),
with the blocks its failed chunks would have written, which vLLM recomputes. Why this exists:
vLLM's asynchronous scheduler schedules a step before the last step's output is read, so a
layer-wise load that fails its checksum already has a token sampled from its KV in flight (tutti
loads every hit this way under it); and with several KV cache groups (hybrid models) vLLM cannot
take a synchronous load failure block by block, only per request.
"""

from __future__ import annotations

import queue as _queue
import threading
import time
from collections import deque
from contextlib import nullcontext

import torch

from tutti.engine.context import log
from tutti.engine.hostcost import gil_free_wait
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
        self._failed_blocks: set[int] = set()
        self._pending = 0
        self._landed = threading.Event()  # a job finished: wakes wait()
        # when each recent job was submitted, started, launched (its copies and kernels queued),
        # landed on the device and taken by the step that tells vLLM (perf_counter seconds): where
        # a hit's wait outside the batch goes (bench/gil_interval_ab.py prints it)
        self.timeline: deque[dict] = deque(maxlen=256)
        self._thread = threading.Thread(target=self._loop, name="tutti-async-loads", daemon=True)
        self._thread.start()

    def submit(self, step: int, loads: list[LoadChunk]) -> None:
        """From the step's thread, when vLLM binds the step that hands these blocks out: on CUDA
        the loads wait for the work already queued on the compute stream (a freed request's last
        step may still use the blocks), without the host waiting."""
        after = None
        if self.stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.pipeline.ctx.device))
        entry = {"step": step, "chunks": len(loads), "submitted": time.perf_counter()}
        with self._lock:
            self._pending += 1
            self.timeline.append(entry)
        self._jobs.put((step, list(loads), after, entry))

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def wait(self, timeout: float) -> None:
        """Sleep (the GIL released) until a job finishes or `timeout` passes; at once when none is
        pending or one already finished unreported. For steps that run no forward pass."""
        self._landed.clear()
        with self._lock:
            if not self._pending or self._received or self._failed:
                return
        self._landed.wait(timeout)

    def take(self) -> tuple[set[str], set[str], set[int]]:
        """(received, failed) requests since the last call, and the blocks the failed chunks would
        have written: taken together, so vLLM learns of a request and its bad blocks at once."""
        with self._lock:
            out = (self._received, self._failed, self._failed_blocks)
            self._received, self._failed, self._failed_blocks = set(), set(), set()
            if out[0] or out[1]:
                now = time.perf_counter()
                for entry in reversed(self.timeline):
                    if "landed" in entry and "taken" not in entry:
                        entry["taken"] = now
            return out

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            step, loads, after, entry = job
            entry["started"] = time.perf_counter()
            try:
                failed, blocks = self._run(loads, after, entry)
            except Exception as exc:  # noqa: BLE001 - every request of the job fails (vLLM recomputes), the thread goes on
                log.exception("tutti: asynchronous loads of step %d failed", step)
                ctx = self.pipeline.ctx
                if ctx.cuda:  # no scatter of theirs may land after vLLM recomputes the blocks (this thread waits)
                    torch.cuda.synchronize(ctx.device)
                lp = self.pipeline
                lp.abandon(loads, f"its asynchronous load raised {type(exc).__name__}: {exc}")
                failed, blocks = lp.take_failed_keys(), lp.take_failed_blocks()
            reqs = {ld.req_id for ld in loads}
            bad = {ld.req_id for ld in loads if ld.key in failed}
            counters = self.pipeline.counters
            counters.record(steps_done=[step])  # the planner unpins their chunks
            with self._lock:
                self._received |= reqs - bad
                self._failed |= bad
                self._failed_blocks |= blocks
                self._pending -= 1
                entry["landed"] = time.perf_counter()
            self._landed.set()

    def _run(self, loads: list[LoadChunk], after=None, entry: dict | None = None) -> tuple[set[bytes], set[int]]:
        """Every layer of `loads`, verified; returns the keys that failed and their blocks."""
        lp = self.pipeline
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with ctx:  # "the compute stream" of these loads is this thread's own stream
            if after is not None:
                self.stream.wait_event(after)
            lp.start(loads, layerwise=False)
            lp.finish()
            if entry is not None:
                entry["launched"] = time.perf_counter()
            blocks = lp.take_failed_blocks()  # resolves the device verdicts (this thread waits, nobody else)
            if self.stream is not None:
                landed = torch.cuda.Event(blocking=True)  # this thread sleeps on it instead of spinning
                landed.record(self.stream)
                with gil_free_wait():
                    landed.synchronize()  # the scatters landed before vLLM is told
        return lp.take_failed_keys(), blocks

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=30)
