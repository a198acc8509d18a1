"""Store and load throughput: the uring backend vs the threads backend vs fio's io_uring engine.

What it measures: writing then reading one file of TUTTI_IO_BENCH_BYTES (default 1 GiB) in
segment-sized requests (256 KiB, 1 MiB, 4 MiB, 32 MiB), O_DIRECT everywhere so the page cache
plays no part, the same in-flight depth (64 MiB outstanding, 2..64 requests) and the same
staging footprint (a window of depth x segment bytes, as fio's fixed buffers) for every engine, over TUTTI_IO_BENCH_ROUNDS (default
5) rounds. Engines are interleaved and their order rotates every round, so drift in the device
(host cache, thermal, other tenants) hits every engine alike. Stores overwrite the same
pre-written file (no engine pays for block allocation that another does not).

Reported per size and direction: median GiB/s per engine, the ratio uring / best reference
(threads or fio), and CPU seconds per GiB (process CPU time of our process for uring/threads,
fio's own usr+sys for fio). Goal: ratio >= 0.9 at every size.

Run:
    python3 bench/test_io_bench.py --quick              # 256 MiB, 5 rounds, prints a table
    TUTTI_IO_BENCH_BYTES=$((256<<20)) python3 -m pytest bench/test_io_bench.py --benchmark-only -s
Env: TUTTI_IO_BENCH_BYTES, TUTTI_IO_BENCH_ROUNDS, TUTTI_IO_BENCH_DIR (file system under test,
default the temp dir), TUTTI_IO_BENCH_NO_FIO=1 to leave fio out, TUTTI_IO_BENCH_STAGING=full to
stage the whole file in memory (one buffer byte per file byte) instead of the in-flight window.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tutti.io.buffers import aligned_buffer  # noqa: E402
from tutti.io.queue import IORequest, open_queue, submit_all, wait_all  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SEGMENTS = (256 * KiB, 1 * MiB, 4 * MiB, 32 * MiB)
IN_FLIGHT_BYTES = 64 * MiB  # bytes outstanding at once, the same for every engine


def depth_for(seg: int) -> int:
    return max(2, min(64, IN_FLIGHT_BYTES // seg))


def _run_queue(backend: str, op: str, path: str, buf, seg: int, total: int) -> tuple[float, float]:
    depth = depth_for(seg)
    kwargs = {"queue_depth": depth}
    if backend == "threads":
        kwargs["workers"] = depth
    # Cycle over an in-flight-sized window of the buffer, the footprint fio's iodepth buffers
    # have; TUTTI_IO_BENCH_STAGING=full uses one buffer byte per file byte instead (in a VM that
    # costs noticeably more per byte: the host maps many more guest pages for DMA).
    window = total if os.environ.get("TUTTI_IO_BENCH_STAGING") == "full" else min(total, depth * seg)
    with open_queue(backend, **kwargs) as q:
        q.register_buffers([buf[:window]])
        fd = q.open_file(path, write=(op == "write"))
        try:
            reqs = [IORequest(fd, off, buf, off % window, seg, op) for off in range(0, total, seg)]
            c0, t0 = time.process_time(), time.perf_counter()
            wait_all(submit_all(q, reqs))
            t1, c1 = time.perf_counter(), time.process_time()
        finally:
            os.close(fd)
    return t1 - t0, c1 - c0


def _run_fio(op: str, path: str, seg: int, total: int) -> tuple[float, float]:
    depth = depth_for(seg)
    cmd = [
        "fio", "--name=tutti", f"--filename={path}", "--ioengine=io_uring", "--direct=1",
        f"--rw={op}", f"--bs={seg}", f"--size={total}", f"--iodepth={depth}",
        f"--iodepth_batch_submit={depth}", "--iodepth_batch_complete_min=1",
        "--fixedbufs=1", "--fallocate=none", "--output-format=json",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    side = job[op]
    if side["io_bytes"] != total:
        raise RuntimeError(f"fio moved {side['io_bytes']} of {total} bytes")
    seconds = total / side["bw_bytes"]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * job["job_runtime"] / 1000.0
    return seconds, cpu


def run_comparison(total: int, rounds: int, directory: str | None = None, use_fio: bool | None = None,
                   segments=SEGMENTS, log=print) -> dict:
    """Interleaved rounds; returns {(seg, op): {engine: {"gibps": [...], "cpu_per_gib": [...]}}}."""
    if total % max(segments):
        raise ValueError(f"total={total}: must be a multiple of the largest segment ({max(segments)} B)")
    if use_fio is None:
        use_fio = shutil.which("fio") is not None and not os.environ.get("TUTTI_IO_BENCH_NO_FIO")
    engines = ["uring", "threads"] + (["fio"] if use_fio else [])
    workdir = tempfile.mkdtemp(prefix="tutti-io-bench-", dir=directory)
    path = os.path.join(workdir, "data")
    results: dict = {}
    try:
        staged = total if os.environ.get("TUTTI_IO_BENCH_STAGING") == "full" else min(total, IN_FLIGHT_BYTES)
        buf = aligned_buffer(staged)
        buf.copy_(torch.randint(0, 256, (staged,), dtype=torch.uint8))
        _run_queue("threads", "write", _create(path), buf, 32 * MiB, total)  # lay the file out once
        for r in range(rounds):
            for seg in segments:
                order = engines[r % len(engines):] + engines[: r % len(engines)]
                for op in ("write", "read"):
                    for eng in order:
                        if eng == "fio":
                            secs, cpu = _run_fio(op, path, seg, total)
                        else:
                            secs, cpu = _run_queue(eng, op, path, buf, seg, total)
                        slot = results.setdefault((seg, op), {}).setdefault(eng, {"gibps": [], "cpu_per_gib": []})
                        slot["gibps"].append(total / GiB / secs)
                        slot["cpu_per_gib"].append(cpu / (total / GiB))
            log(f"round {r + 1}/{rounds} done")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _create(path: str) -> str:
    open(path, "wb").close()
    return path


def summarize(results: dict) -> list[dict]:
    rows = []
    for (seg, op), by_engine in sorted(results.items()):
        med = {e: statistics.median(v["gibps"]) for e, v in by_engine.items()}
        cpu = {e: statistics.median(v["cpu_per_gib"]) for e, v in by_engine.items()}
        refs = {e: m for e, m in med.items() if e != "uring"}
        best = max(refs, key=refs.get)
        rows.append({
            "segment": seg, "op": "store" if op == "write" else "load", "gibps": med, "cpu_s_per_gib": cpu,
            "best_ref": best, "ratio": med["uring"] / refs[best],
            "uring_range": (min(by_engine["uring"]["gibps"]), max(by_engine["uring"]["gibps"])),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    engines = list(rows[0]["gibps"]) if rows else []
    head = f"{'seg':>7} {'op':>5} " + " ".join(f"{e + ' GiB/s':>13}" for e in engines)
    head += " " + " ".join(f"{e + ' cpu/GiB':>15}" for e in engines) + f" {'uring/best':>12}"
    lines = [head]
    for row in rows:
        seg = f"{row['segment'] // KiB}K" if row["segment"] < MiB else f"{row['segment'] // MiB}M"
        line = f"{seg:>7} {row['op']:>5} " + " ".join(f"{row['gibps'][e]:>13.2f}" for e in engines)
        line += " " + " ".join(f"{row['cpu_s_per_gib'][e]:>15.3f}" for e in engines)
        line += f" {row['ratio']:>7.2f} ({row['best_ref']})"
        line += f"  uring {row['uring_range'][0]:.2f}-{row['uring_range'][1]:.2f}"
        lines.append(line)
    return "\n".join(lines)


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def test_io_store_load(benchmark):
    """pytest-benchmark entry: the interleaved comparison, figures in extra_info and printed."""
    total = _env_int("TUTTI_IO_BENCH_BYTES", GiB)
    rounds = _env_int("TUTTI_IO_BENCH_ROUNDS", 5)
    holder = {}

    def go():
        holder["rows"] = summarize(run_comparison(total, rounds, os.environ.get("TUTTI_IO_BENCH_DIR")))

    benchmark.pedantic(go, rounds=1, iterations=1)
    rows = holder["rows"]
    print("\n" + format_table(rows))
    benchmark.extra_info["bytes"] = total
    benchmark.extra_info["rounds"] = rounds
    benchmark.extra_info["rows"] = [
        {**r, "gibps": {k: round(v, 3) for k, v in r["gibps"].items()}} for r in rows
    ]
    for r in rows:  # the figures are real measurements: sanity only, no speed asserted
        assert all(v > 0 for v in r["gibps"].values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 MiB per pass (unless TUTTI_IO_BENCH_BYTES is set)")
    ap.add_argument("--bytes", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=_env_int("TUTTI_IO_BENCH_ROUNDS", 5))
    ap.add_argument("--dir", default=os.environ.get("TUTTI_IO_BENCH_DIR"))
    ap.add_argument("--no-fio", action="store_true")
    args = ap.parse_args(argv)
    total = args.bytes or _env_int("TUTTI_IO_BENCH_BYTES", 256 * MiB if args.quick else GiB)
    rows = summarize(run_comparison(total, args.rounds, args.dir, use_fio=False if args.no_fio else None,
                                    log=lambda m: print(m, file=sys.stderr)))
    print(f"total {total / MiB:.0f} MiB per pass, {args.rounds} rounds, in-flight {IN_FLIGHT_BYTES // MiB} MiB")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
