"""The GIL switch interval and tutti's threads, on the CPU: both directions of the hand-off.

1. A file-path load beside a thread that spins in Python. While a request waits outside the
   batch for its asynchronous load, vLLM's engine loop spins (steps with nothing to compute) and
   holds the GIL; every IO worker that completes a read, and the load thread that waits for it,
   then waits up to the switch interval for the GIL. A whole load of `tokens` tokens of the 8B
   KV geometry (32 layers, chunks of 256 tokens, checksums off) through the real WorkerPipeline
   from a /dev/shm root with the threads backend (the file path), alone, beside a spinning
   thread at CPython's 5 ms, and beside it at shorter intervals.
2. A step-like loop beside a thread of Python bursts. The step's thread alternates a little
   Python (its hooks, the scheduler) with GIL-free waits (the GPU); a background thread runs
   bursts of Python between blocking waits (the load thread: launch checks, checksum combines).
   When the step's thread wakes while a burst runs, it waits for the burst's end or the switch
   interval, whichever comes first: the mean and p99 of the step's time at each interval.
3. (`--parts yield`) The same step-like loop beside a writer that yields to the hits' reads, as
   the tiers' copier does before each slice of a copy: reads are always in flight (one lands
   every `--read-every-s`, the next tracked at once), and the writer waits for them, capped at
   50 ms, then writes a slice (a GIL-free pause). Polling every 0.5 ms (how the copier waited
   before `ReadsFirst.wait_idle`, kept here as the baseline) against sleeping on the reads: the
   step's time, the writer's wake-ups and its thread's CPU seconds.

    python3 bench/gil_spin_load.py --out /tmp/gil_spin.json [--tokens 4096] [--intervals 0.005,0.0005,0.0002]
    python3 bench/gil_spin_load.py --parts yield --out /tmp/gil_yield.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def python_work(seconds: float) -> None:
    """Hold the GIL for `seconds`, as Python code does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def load_part(a, intervals: list[float]) -> list[dict]:
    from load_rate import geometry, load_once, make_caches, store_all, worker

    layers, bpc = 32, 16
    geom = geometry(layers, 256)
    n = a.tokens // 256
    caches = make_caches(layers, n * bpc, "cpu")
    shutil.rmtree(a.root, ignore_errors=True)
    os.makedirs(a.root)
    kw = dict(verify_checksums=False, io_backend="threads", mapped_loads=False, staging_bytes="384MiB",
              staging_slots=48, max_inflight_stores=32, gil_switch_interval_s="off")
    store_all(a.root, caches, geom, n, bpc, **kw)
    w = worker(a.root, caches, geom, **kw)
    nbytes = n * layers * geom.segment_bytes
    out = []
    try:
        modes = [("alone", 0.005)] + [("spinning thread", iv) for iv in intervals]
        for _ in range(a.rounds):
            for mode, iv in modes:
                sys.setswitchinterval(iv)
                stop = threading.Event()
                t = threading.Thread(target=spin, args=(stop,), daemon=True) if mode != "alone" else None
                if t:
                    t.start()
                ts = [load_once(w, n, bpc, 100 + i, False, layers) for i in range(3)]
                stop.set()
                if t:
                    t.join()
                out.append({"part": "load", "mode": mode, "interval_s": iv,
                            "GBps": [round(nbytes / x / 1e9, 3) for x in ts]})
                print(json.dumps(out[-1]), flush=True)
    finally:
        sys.setswitchinterval(0.005)
        w.close()
        shutil.rmtree(a.root, ignore_errors=True)
    return out


def handoff_part(a, intervals: list[float]) -> list[dict]:
    out = []
    for _ in range(a.rounds):
        for iv in [0.005] + intervals:
            sys.setswitchinterval(iv)
            stop = threading.Event()

            def bursts() -> None:  # the load thread: a burst of Python, then a wait for IO
                while not stop.is_set():
                    python_work(a.burst_s)
                    time.sleep(a.burst_gap_s)

            t = threading.Thread(target=bursts, daemon=True)
            t.start()
            steps = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                python_work(a.step_python_s)  # hooks, scheduling
                time.sleep(a.step_wait_s)  # the GPU runs the step (GIL released)
                steps.append(time.perf_counter() - t0)
            stop.set()
            t.join()
            steps.sort()
            ideal = a.step_python_s + a.step_wait_s
            out.append({"part": "step", "interval_s": iv, "step_mean_ms": round(1e3 * statistics.mean(steps), 3),
                        "step_p99_ms": round(1e3 * steps[int(0.99 * len(steps))], 3),
                        "mean_over_ideal": round(statistics.mean(steps) / ideal, 3)})
            print(json.dumps(out[-1]), flush=True)
    sys.setswitchinterval(0.005)
    return out


def yield_part(a) -> list[dict]:
    from tutti.io.queue import IOFuture, IORequest, ReadsFirst

    buf = bytearray(4096)
    out = []
    for _ in range(a.rounds):
        for mode in ("no writer", "poll", "wait_idle"):
            stop = threading.Event()
            rf = ReadsFirst(4096)
            stats = {"wakeups": 0, "cpu_s": 0.0, "slices": 0}

            def reads() -> None:  # the hits: a read always in flight, one landing every read_every_s
                while not stop.is_set():
                    fut = IOFuture(IORequest(0, 0, buf, 0, 4096, "read"))
                    rf.track([fut])
                    time.sleep(a.read_every_s)
                    fut.set_result(4096)

            def writer() -> None:  # the copier: yield to the reads (capped at 50 ms), then a slice
                c0 = time.thread_time()
                while not stop.is_set():
                    if mode == "poll":
                        end = time.monotonic() + 0.05
                        while rf.reading() and time.monotonic() < end:
                            stats["wakeups"] += 1
                            time.sleep(0.0005)
                    else:
                        stats["wakeups"] += 1
                        rf.wait_idle(0.05)
                    time.sleep(a.slice_s)  # pwritev of a slice: the GIL released
                    stats["slices"] += 1
                stats["cpu_s"] = time.thread_time() - c0

            threads = [threading.Thread(target=reads, daemon=True)]
            if mode != "no writer":
                threads.append(threading.Thread(target=writer, daemon=True))
            for t in threads:
                t.start()
            steps = []
            t_start = time.perf_counter()
            for _ in range(a.steps):
                t0 = time.perf_counter()
                python_work(a.step_python_s)
                time.sleep(a.step_wait_s)
                steps.append(time.perf_counter() - t0)
            wall = time.perf_counter() - t_start
            stop.set()
            for t in threads:
                t.join()
            steps.sort()
            ideal = a.step_python_s + a.step_wait_s
            out.append({"part": "yield", "mode": mode, "step_mean_ms": round(1e3 * statistics.mean(steps), 3),
                        "step_p99_ms": round(1e3 * steps[int(0.99 * len(steps))], 3),
                        "mean_over_ideal": round(statistics.mean(steps) / ideal, 3),
                        "writer_wakeups_per_s": round(stats["wakeups"] / wall), "writer_slices": stats["slices"],
                        "writer_cpu_s_per_s": round(stats["cpu_s"] / wall, 4)})
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/gil_spin.json")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--root", default="/dev/shm/tutti-gil-spin")
    ap.add_argument("--intervals", default="0.005,0.001,0.0005,0.0002")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="load,step")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-python-s", type=float, default=0.0005)
    ap.add_argument("--step-wait-s", type=float, default=0.005)
    ap.add_argument("--burst-s", type=float, default=0.002)
    ap.add_argument("--burst-gap-s", type=float, default=0.003)
    ap.add_argument("--read-every-s", type=float, default=0.02, help="yield: a read lands this often")
    ap.add_argument("--slice-s", type=float, default=0.002, help="yield: a slice's write (GIL-free)")
    a = ap.parse_args()
    intervals = [float(x) for x in a.intervals.split(",")]
    results = []
    if "load" in a.parts:
        results += load_part(a, intervals)
    if "step" in a.parts:
        results += handoff_part(a, intervals)
    if "yield" in a.parts:
        results += yield_part(a)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
