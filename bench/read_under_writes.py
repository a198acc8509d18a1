"""Reads of hits while the writer writes stores, on a disk root: tutti's own pipeline, same run.

Why: on the H200's virtio disk a serving run read hits at 0.2 GB/s while its stores were being
written, against 1.7 GB/s for reads alone, so the hit policy recomputed nearly every hit. The
reads and the writes share the drive's queue: a read submitted behind a deep queue of writes
waits for all of them. This measures, through the real WorkerPipeline (8B KV geometry: 32 layers,
chunks of 256 tokens, 32 MiB each; O_DIRECT through io_uring): the read rate alone, then the
read rate of steps that each load M stored chunks while the previous steps' stores are being
written, for each `write_window_bytes` given (the writer's bytes in flight; "off" = a run's
writes all at once, as before the window existed).

    python3 bench/read_under_writes.py --out /tmp/ruw.json [--windows off,64MiB] [--root /tmp/ruw]

Ratios are to the reads alone of the same run. Checksums are off for the loads (on the CPU the
torch checksum, not the drive, would set the rate); the stores still compute theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from load_rate import geometry, make_caches, worker  # noqa: E402

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk  # noqa: E402


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def run_window(a, window: str, caches, geom, bpc: int) -> dict:
    root = os.path.join(a.root, f"w-{window}")
    shutil.rmtree(root, ignore_errors=True)
    kw = {"verify_checksums": False, "io_backend": a.backend, "write_window_bytes": window}
    w = worker(root, caches, geom, **kw)
    try:
        # the hits: M chunks stored and durable before anything is timed
        w.start_step(StepPlan(1, stores=[StoreChunk("h", key(i), i, tuple(range(i * bpc, (i + 1) * bpc)), ticket=i + 1)
                                         for i in range(a.hits)]))
        w.end_step()
        w.flush(timeout=600)
        w.take_report()
        loads = [LoadChunk("q", key(i), i, tuple(range(i * bpc, (i + 1) * bpc))) for i in range(a.hits)]
        nbytes = a.hits * geom.num_layers * geom.segment_bytes

        def load(step: int, stores: list) -> float:
            t0 = time.perf_counter()
            w.start_step(StepPlan(step, loads=loads, stores=stores), layerwise=False)  # whole: read here
            dt = time.perf_counter() - t0
            w.end_step()  # the step's stores go to the writer
            assert not w.take_failed_blocks()
            return dt

        alone = min(load(2 + r, []) for r in range(a.repeats))
        times, step, nxt = [], 10, a.hits
        t_w0 = time.perf_counter()
        for s in range(a.steps):
            stores = [StoreChunk("s", key(1000 + nxt + j), nxt + j,
                                 tuple(range((nxt + j) * bpc, (nxt + j + 1) * bpc)), ticket=10_000 + nxt + j)
                      for j in range(a.stores_per_step)]
            nxt += a.stores_per_step
            dt = load(step + s, stores)
            if s:  # from the second step on, the earlier steps' writes are in flight
                times.append(dt)
        w.flush(timeout=600)
        write_s = time.perf_counter() - t_w0
        rep = w.take_report()
        stored = len(rep.stored)
        under = sorted(times)[len(times) // 2]
        return {"window": window, "read_alone_GBps": round(nbytes / alone / 1e9, 3),
                "read_under_writes_GBps": round(nbytes / under / 1e9, 3),
                "under_over_alone": round(alone / under, 3),
                "stored_chunks": stored, "skipped": rep.stores_skipped if hasattr(rep, "stores_skipped") else None,
                "write_GBps_incl_reads": round(stored * geom.num_layers * geom.segment_bytes / write_s / 1e9, 3)}
    finally:
        w.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/read_under_writes.json")
    ap.add_argument("--root", default="/tmp/tutti-read-under-writes")
    ap.add_argument("--windows", default="off,64MiB")
    ap.add_argument("--backend", default="uring")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hits", type=int, default=8, help="chunks each step loads")
    ap.add_argument("--stores-per-step", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    geom = geometry(a.layers, 256)
    bpc = 256 // 16
    blocks = (a.hits + a.steps * a.stores_per_step) * bpc
    caches = make_caches(a.layers, blocks, "cpu")
    results = [run_window(a, win, caches, geom, bpc) for win in a.windows.split(",")]
    for r in results:
        print(json.dumps(r))
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
