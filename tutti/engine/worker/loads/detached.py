"""Detached loads: a job of whole-chunk loads launched without waiting for it (vLLM's
asynchronous loads from mapped slabs on the step's own thread), resolved once its last event
fires, each job with a pinned verdict buffer of its own."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tutti.engine.plan import LoadChunk


DETACHED_JOBS = 32  # detached jobs in flight at once (each keeps a pinned verdict buffer); more wait on the thread


@dataclass
class Detached:
    """One job launched by `launch_detached`, in flight until its last event fires."""

    loads: list[LoadChunk]
    sums: list[tuple[int, ...]]
    bad_host: torch.Tensor | None  # its verdicts, copied back by the job's last copy
    landed: object  # CUDA event after that copy (None on the CPU: done at launch)
    started: object  # CUDA event before its first copy (timing)
    pool_buffer: torch.Tensor | None  # the pinned buffer bad_host views, back to the pool once resolved
    nbytes: int
    host_seconds: float
    keys: set[bytes]  # failed at launch (unmapped slabs)
    blocks: set[int]

    def ready(self) -> bool:
        return self.landed is None or self.landed.query()


class DetachedLoads:
    """LoadPipeline's detached jobs (a mixin over LoadCore and the layer-wise start/finish)."""

    # ---------------------------------------------------------------- detached jobs
    def launch_detached(self, loads: list[LoadChunk]) -> "Detached":
        """Every chunk of `loads` queued on this pipeline's stream from the caller's thread, with
        nothing waited for: copies from mapped slabs (a RAM root), verified and scattered, chunk
        by chunk failing where its slab is not mapped. Returns the job's handle: `ready()` once it
        landed, then `resolve_detached` reads its verdicts. For asynchronous loads launched from
        the step's thread (EngineConfig.async_launch): no second thread takes turns at the GIL
        with the forward pass. Several jobs may be in flight: one stream runs them in order."""
        ctx = self.ctx
        t0 = time.perf_counter()
        started = None
        if ctx.cuda:
            # blocks just handed to these requests may still be in use by work already queued
            # on the compute stream (a freed request's last step): scatter only after it
            self.stream.wait_stream(torch.cuda.current_stream(ctx.device))
            started = torch.cuda.Event(enable_timing=True)
            started.record(self.stream)
        self._pool_taken = None
        try:
            with self.on_stream():
                self.start(loads, layerwise=False, file_path=False)
                self.finish(detached=True)
                landed = None
                if ctx.cuda:
                    landed = torch.cuda.Event(enable_timing=True)  # queried, never waited on
                    landed.record(self.stream)
        except BaseException:
            if self._pool_taken is not None:  # the caller abandons the job: its buffer goes back
                self._pool_free.append(self._pool_taken)  # (a later job's copy into it is ordered after, on this stream)
                self._pool_taken = None
            raise
        job = Detached(loads=self.loads, sums=self.sums, bad_host=self._bad_host, landed=landed,
                       started=started, pool_buffer=self._pool_taken, nbytes=self.step_bytes,
                       host_seconds=time.perf_counter() - t0, keys=self.failed_keys, blocks=self._failed_blocks)
        self._bad_host = self._bad = self._verified = self._pool_taken = None
        self.loads, self.sums, self._items, self.step_bytes = [], [], [], 0
        self.failed_keys, self._failed_blocks, self._failed_log = set(), set(), set()
        return job

    def resolve_detached(self, job: "Detached") -> tuple[set[bytes], set[int]]:
        """(keys failed, the blocks they would have written) of a job that is `ready()`; counts
        its bytes with the device's time for them (the read rate of a mapped root)."""
        saved = self.failed_keys, self._failed_blocks, self._failed_log
        self.failed_keys, self._failed_blocks, self._failed_log = job.keys, job.blocks, set(job.keys)
        try:
            if job.bad_host is not None:
                self._judge(job.bad_host, job.loads, job.sums)
        finally:
            keys, blocks = self._failed_log, self._failed_blocks
            self.failed_keys, self._failed_blocks, self._failed_log = saved
            if job.pool_buffer is not None and job.pool_buffer.numel() >= self._pool_size:
                self._pool_free.append(job.pool_buffer)
                job.pool_buffer = None
        if job.nbytes:
            seconds = job.host_seconds
            if job.started is not None and job.landed is not None:
                seconds = max(seconds, job.started.elapsed_time(job.landed) / 1e3)
            self.counters.add(bytes_loaded=job.nbytes, load_seconds=seconds, rate_bytes=job.nbytes,
                              rate_seconds=seconds)
        return keys, blocks

    def can_detach(self) -> bool:
        """A detached job can be launched now (a verdict buffer of its own is free)."""
        return not self.ctx.cuda or bool(self._pool_free) or not self._pool_sized

    def _detached_buffer(self, n: int) -> torch.Tensor:
        """Pinned room for one detached job's verdicts, from a pool sized at start-up (warm_up):
        a job in flight keeps its own until resolved."""
        if not self._pool_sized or (self._pool_free and self._pool_free[-1].numel() < n):
            self.size_detached_pool(n)  # at start-up (warm_up); later only past every earlier size
        if not self._pool_free:
            raise RuntimeError("tutti: no detached verdict buffer is free (can_detach() was not asked)")
        self._pool_taken = self._pool_free.pop()
        return self._pool_taken[:n]

    def size_detached_pool(self, n: int, jobs: int = DETACHED_JOBS) -> None:
        """`jobs` pinned verdict buffers of `n` entries (a job loading every block), at start-up;
        buffers of jobs still in flight are dropped when they come back (a smaller size)."""
        size = max(n, 4096)
        self._pool_free = [torch.empty(size, dtype=torch.bool, pin_memory=self.ctx.cuda) for _ in range(jobs)]
        self._pool_sized, self._pool_size = True, size
