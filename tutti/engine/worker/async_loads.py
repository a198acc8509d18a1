"""Loads vLLM does not wait for inside a step: its asynchronous loads.

The request sits in vLLM's waiting queue until the worker reports it received; meanwhile its
chunks are read, verified and scattered on a thread of their own, with their own staging slots
and CUDA stream, so the forward passes of other requests never wait for them. From a mapped RAM
root nothing is read: the step's own thread queues the copies and kernels on that stream and
later only asks the job's event whether it landed (EngineConfig.async_launch). The outcome is
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

from tutti.engine.worker.context import log
from tutti.engine.hostcost import gil_free_wait
from tutti.engine.plan import LoadChunk


class AsyncLoads:
    def __init__(self, pipeline, inline=None) -> None:
        """`pipeline`: a LoadPipeline over its own staging ring (not the step's), run on this
        thread. `inline`: a LoadPipeline whose jobs are launched from the submitting (step's)
        thread and only polled after (`LoadPipeline.launch_detached`: mapped RAM roots); the
        thread then takes only the jobs it cannot (every verdict buffer in use)."""
        self.pipeline = pipeline
        self.inline = inline
        self._inline_jobs: deque = deque()  # (step, loads, Detached or None, failed keys, blocks, entry)
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
        if self.inline is not None and self.inline.can_detach() and not any(ld.tier for ld in loads):
            # (a lower tier's chunks are read from a drive: this thread's job)
            self._launch(step, loads)
            return
        after = None
        if self.stream is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.pipeline.ctx.device))
        entry = {"step": step, "chunks": len(loads), "submitted": time.perf_counter()}
        with self._lock:
            self._pending += 1
            self.timeline.append(entry)
        self._jobs.put((step, list(loads), after, entry))

    def _launch(self, step: int, loads: list[LoadChunk]) -> None:
        """A job launched here, on the step's thread (see `inline`); polled by take()."""
        now = time.perf_counter()
        entry = {"step": step, "chunks": len(loads), "submitted": now, "started": now, "inline": True}
        lp, job, failed, blocks = self.inline, None, set(), set()
        try:
            job = lp.launch_detached(loads)
        except Exception as exc:  # noqa: BLE001 - the job's requests fail (vLLM recomputes), serving goes on
            log.exception("tutti: asynchronous loads of step %d failed", step)
            # the compute stream waits for whatever was queued (no host wait), then the chunks fail
            lp.abandon(loads, f"its asynchronous load raised {type(exc).__name__}: {exc}")
            failed, blocks = lp.take_failed_keys(), lp.take_failed_blocks()
        entry["launched"] = time.perf_counter()
        with self._lock:
            self.timeline.append(entry)
        self._inline_jobs.append((step, loads, job, failed, blocks, entry))

    def _poll(self) -> None:
        """Report the jobs launched on the step's thread that have landed, in launch order (one
        stream runs them in that order). Called on the step's thread only."""
        while self._inline_jobs:
            step, loads, job, failed, blocks, entry = self._inline_jobs[0]
            if job is not None and not job.ready():
                return
            self._inline_jobs.popleft()
            if job is not None:
                failed, blocks = self.inline.resolve_detached(job)
            self._report(step, loads, failed, blocks, entry)

    @property
    def pending(self) -> int:
        """Jobs not landed yet."""
        inline = sum(1 for j in self._inline_jobs if j[2] is not None and not j[2].ready())
        with self._lock:
            return self._pending + inline

    def wait(self, timeout: float) -> None:
        """Sleep (the GIL released) until a job finishes or `timeout` passes; at once when none is
        pending or one already finished unreported. For steps that run no forward pass."""
        self._landed.clear()
        with self._lock:
            if self._received or self._failed:
                return
        if self._inline_jobs:  # launched here: their events are polled (a sleep releases the GIL)
            deadline = time.monotonic() + timeout
            while self._inline_jobs and time.monotonic() < deadline and not self._landed.is_set():
                job = self._inline_jobs[0][2]
                if job is None or job.ready():
                    return
                time.sleep(0.0002)
            return
        with self._lock:
            if not self._pending:
                return
        self._landed.wait(timeout)

    def take(self) -> tuple[set[str], set[str], set[int]]:
        """(received, failed) requests since the last call, and the blocks the failed chunks would
        have written: taken together, so vLLM learns of a request and its bad blocks at once."""
        self._poll()
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
            self._report(step, loads, failed, blocks, entry, thread=True)

    def _report(self, step: int, loads: list[LoadChunk], failed: set[bytes], blocks: set[int], entry: dict,
                thread: bool = False) -> None:
        reqs = {ld.req_id for ld in loads}
        bad = {ld.req_id for ld in loads if ld.key in failed}
        self.pipeline.counters.record(steps_done=[step])  # the planner unpins their chunks
        with self._lock:
            if thread:
                self._pending -= 1
            self._received |= reqs - bad
            self._failed |= bad
            self._failed_blocks |= blocks
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
        if self._inline_jobs and self.inline is not None and self.inline.ctx.cuda:
            self.inline.stream.synchronize()  # nothing of theirs lands after the server stops
            self._poll()
