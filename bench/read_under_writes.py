"""Reads of hits while stores are written, on one drive: what the writer's window does to them.

Why: on the H200's virtio disk a serving run read hits at 0.2 GB/s while its stores were being
written, against 1.7 GB/s for reads alone, so the hit policy recomputed nearly every hit. Reads
and writes share the drive's queue, and a read waits for whatever is queued ahead of it: tutti's
writer used to submit a whole run of chunk writes at once (16 chunks of an 8B model are 512 MiB).
`write_window_bytes` keeps at most that many bytes of writes in flight; a window written
`64MiB+reads_first` also has the writes yield to the reads as tutti's `reads_first` does (writes
of 4 MiB, one in flight while a read is: `tutti.io.queue.ReadsFirst`).

This drives tutti's own IO queue (io_uring, O_DIRECT) the way the pipelines do: a writer thread
writes runs of `--run` chunks of 32 MiB through `tutti.io.queue.submit_windowed`, one run after
another, while the main thread keeps `--depth` reads of 1 MiB segments in flight (a load's
segments). For each window: reads alone, writes alone, then both at once; ratios are to the
phase alone of the same run.

    python3 bench/read_under_writes.py --out /tmp/ruw.json [--windows off,64MiB,64MiB+reads_first] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from tutti.engine.config.settings import parse_bytes  # noqa: E402
from tutti.io.buffers import aligned_buffer  # noqa: E402
from tutti.io.queue import READ, WRITE, IORequest, ReadsFirst, open_queue, submit_all, submit_windowed  # noqa: E402

MiB = 1 << 20
CHUNK = 32 * MiB  # an 8B model's chunk of 256 tokens: 32 layers x 1 MiB
SEG = 1 * MiB


def reads_for(q, fd, buf, seconds: float, depth: int, file_bytes: int, stop: threading.Event | None = None,
              rf: ReadsFirst | None = None) -> float:
    """Bytes/s of 1 MiB reads at random offsets, `depth` in flight, for `seconds`."""
    rng = random.Random(1)
    n_seg = file_bytes // SEG
    inflight: list = []
    moved, t0 = 0, time.perf_counter()
    slot = 0
    while time.perf_counter() - t0 < seconds and not (stop is not None and stop.is_set()):
        while len(inflight) < depth:
            req = IORequest(fd, rng.randrange(n_seg) * SEG, buf, (slot % depth) * SEG, SEG, READ)
            slot += 1
            futs = submit_all(q, [req])
            if rf is not None:
                rf.track(futs)
            inflight.extend(futs)
        fut = inflight.pop(0)
        moved += fut.result(timeout=30)
    for fut in inflight:
        fut.result(timeout=30)
    return moved / (time.perf_counter() - t0)


class Writer(threading.Thread):
    """Runs of chunk writes, one after another, through submit_windowed."""

    def __init__(self, q, fd, buf, run: int, window: int | None, area_bytes: int, rf: ReadsFirst | None = None) -> None:
        super().__init__(name="bench-writer", daemon=True)
        self.q, self.fd, self.buf, self.run_len, self.window, self.area = q, fd, buf, run, window, area_bytes
        self.rf = rf
        self.stop = threading.Event()
        self.moved = 0
        self.seconds = 0.0

    def run(self) -> None:
        t0, off = time.perf_counter(), 0
        while not self.stop.is_set():
            reqs = []
            piece = CHUNK if self.rf is None else self.rf.yield_bytes  # tutti's stores split so, too
            for i in range(self.run_len):
                for o in range(0, CHUNK, piece):
                    reqs.append(IORequest(self.fd, off + o, self.buf, i * CHUNK + o, piece, WRITE, tag=i))
                off = (off + CHUNK) % self.area
            errors: dict = {}
            window = self.window if self.rf is None else (lambda: self.rf.window(self.window))
            futs, stalled = submit_windowed(self.q, reqs, window, 30.0, errors)
            if errors or stalled:
                raise RuntimeError(f"writes failed: {errors}")
            self.moved += sum(f.request.length for f in futs)
        self.seconds = time.perf_counter() - t0


def measure(a, window_text: str) -> dict:
    size, _, mode = window_text.partition("+")
    window = None if size == "off" else parse_bytes("window", size)
    rf = ReadsFirst() if mode == "reads_first" else None
    rpath, wpath = os.path.join(a.dir, "ruw-read.bin"), os.path.join(a.dir, "ruw-write.bin")
    with open_queue("uring", queue_depth=256) as q:
        wbuf, rbuf = aligned_buffer(a.run * CHUNK, pin=False), aligned_buffer(a.depth * SEG, pin=False)
        wbuf.fill_(7)
        q.register_buffers([wbuf, rbuf])
        rfd = q.open_file(rpath, write=True, create=True)
        wfd = q.open_file(wpath, write=True, create=True)
        try:
            if os.fstat(rfd).st_size < a.read_bytes:  # the hits' file, written once
                errs: dict = {}
                for off in range(0, a.read_bytes, a.run * CHUNK):
                    n = min(a.run, (a.read_bytes - off) // CHUNK)
                    submit_windowed(q, [IORequest(rfd, off + i * CHUNK, wbuf, i * CHUNK, CHUNK, WRITE) for i in range(n)],
                                    None, 30.0, errs)
            alone = reads_for(q, rfd, rbuf, a.seconds, a.depth, a.read_bytes)
            w = Writer(q, wfd, wbuf, a.run, window, a.write_bytes, rf)
            w.start()
            time.sleep(a.seconds)
            w.stop.set()
            w.join()
            writes_alone = w.moved / w.seconds
            w = Writer(q, wfd, wbuf, a.run, window, a.write_bytes, rf)
            w.start()
            time.sleep(0.5)  # the writer's queue is full before the reads start
            under = reads_for(q, rfd, rbuf, a.seconds, a.depth, a.read_bytes, rf=rf)
            w.stop.set()
            w.join()
            writes_under = w.moved / w.seconds
        finally:
            os.close(rfd)
            os.close(wfd)
    return {"window": window_text, "read_alone_GBps": round(alone / 1e9, 3), "read_under_writes_GBps": round(under / 1e9, 3),
            "read_under_over_alone": round(under / alone, 3), "write_alone_GBps": round(writes_alone / 1e9, 3),
            "write_under_reads_GBps": round(writes_under / 1e9, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/read_under_writes.json")
    ap.add_argument("--dir", default="/tmp", help="a directory on the drive to measure (not tmpfs)")
    ap.add_argument("--windows", default="off,64MiB,64MiB+reads_first")
    ap.add_argument("--run", type=int, default=16, help="chunks (32 MiB) in one run of writes")
    ap.add_argument("--depth", type=int, default=16, help="1 MiB reads in flight")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--read-bytes", type=lambda v: parse_bytes("read_bytes", v), default=1 << 30)
    ap.add_argument("--write-bytes", type=lambda v: parse_bytes("write_bytes", v), default=2 << 30)
    a = ap.parse_args()
    results = [measure(a, w) for w in a.windows.split(",")]
    for r in results:
        print(json.dumps(r))
    with open(a.out, "w") as f:
        json.dump({"args": {k: v for k, v in vars(a).items()}, "results": results}, f, indent=1)
    for p in ("ruw-read.bin", "ruw-write.bin"):
        try:
            os.unlink(os.path.join(a.dir, p))
        except OSError:
            pass


if __name__ == "__main__":
    main()
