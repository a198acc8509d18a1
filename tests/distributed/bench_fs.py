"""Figures for results/distributed_fs.md: tutti through a GlusterFS FUSE mount against the same
disk directly, on this machine.

Brings a volume up (gluster.py: bricks on the disk under --base), then for each root (node a's
mount; a directory beside the bricks, on the same disk):
  - raw queue rates: 1 MiB requests over a 256 MiB file, threads and io_uring, O_DIRECT;
  - tutti's worker pipeline (bench/load_rate.py's, on the CPU): a prompt of --tokens tokens of an
    8B-like KV geometry (--layers layers, 8 KV heads, head_dim 128, bf16, 256-token chunks) stored,
    then loaded whole; the best of --rounds rounds alternating between the roots;
and the follow delay: a chunk stored on node a (real planner and worker, nodes.Server) until
node b's planner knows it, --follows times, at follow_interval_s 0.25 (the default) and 0.05;
with --demo, `tutti demo` over each root (time to first token, recompute against hits).

    python3 tests/distributed/bench_fs.py [--base /var/tmp] [--tokens 8192] [--layers 8] [--rounds 3] [--demo] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "bench"))
sys.path.insert(0, str(HERE.parents[1]))

import gluster  # noqa: E402


def raw_rates(root: Path, size: int = 256 << 20, io: int = 1 << 20, repeats: int = 3) -> dict:
    from tutti.io.buffers import aligned_buffer
    from tutti.io.queue import IORequest, open_queue, submit_all, wait_all

    buf = aligned_buffer(size, pin=False)
    buf.fill_(7)
    out = {}
    for backend in ("threads", "uring"):
        try:
            q = open_queue(backend)
        except Exception as exc:  # noqa: BLE001
            out[backend] = f"unavailable: {exc}"
            continue
        w, r = [], []
        for i in range(repeats):
            path = root / f"raw-{backend}-{i}.bin"
            fd = q.open_file(path, write=True, create=True)
            t = time.perf_counter()
            wait_all(submit_all(q, [IORequest(fd, o, buf, o, io, op="write") for o in range(0, size, io)]))
            os.fdatasync(fd)
            w.append(size / (time.perf_counter() - t))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t = time.perf_counter()
            wait_all(submit_all(q, [IORequest(fd, o, buf, o, io) for o in range(0, size, io)]))
            r.append(size / (time.perf_counter() - t))
            os.close(fd)
            os.unlink(path)
        out[backend] = {"write_MBps": statistics.median(w) / 1e6, "read_MBps": statistics.median(r) / 1e6,
                        "direct": q.caps().direct_io}
        q.close()
    return out


def pipeline_rates(root: Path, tokens: int, layers: int, chunk: int = 256, repeats: int = 3) -> dict:
    import load_rate as lr

    geom = lr.geometry(layers, chunk)
    bpc = chunk // lr.BS
    n = tokens // chunk
    caches = lr.make_caches(layers, n * bpc, "cpu")
    kv = sum(c.numel() * c.element_size() for c in caches)
    kw = {"staging_bytes": "256MiB", "staging_slots": 64, "max_inflight_stores": 48}
    store_s = lr.store_all(str(root), caches, geom, n, bpc, **kw)
    w = lr.worker(str(root), caches, geom, **kw)
    try:
        times = [lr.load_once(w, n, bpc, 10 + r, False, layers) for r in range(repeats)]
        out = {"kv_MB": kv / 1e6, "chunks": n, "store_MBps": kv / store_s / 1e6,
               "load_MBps": kv / min(times) / 1e6, "load_s": min(times), "backend": w.queue.caps().backend,
               "auto": w.decisions.describe()}
    finally:
        w.close()
    return out


def follow_delays(cluster: gluster.Cluster, interval: float, n: int) -> list[float]:
    from nodes import Server, prompt

    name = f"follow-{interval}"
    (cluster.mounts["a"] / name).mkdir()
    a = Server(cluster.mounts["a"] / name, "a", 0, follow_interval_s=interval, capacity_bytes=1 << 26)
    b = Server(cluster.mounts["b"] / name, "b", 1, follow_interval_s=interval, capacity_bytes=1 << 26)
    out = []
    try:
        for i in range(n):
            _, _, plan = a.request(f"r{i}", prompt(1000 + i, 1), [0, 1, 2])
            t0 = time.monotonic()
            key = plan.stores[0].key
            while key not in b.planner.foreign:
                if time.monotonic() - t0 > 30:
                    raise RuntimeError("not followed in 30 s")
                time.sleep(0.002)
            out.append(time.monotonic() - t0)
            time.sleep(0.3 * (i % 4))  # stores land at different phases of the follow loop
    finally:
        a.close()
        b.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="/var/tmp", help="where the bricks (and the direct root) go: a disk")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--follows", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--demo", action="store_true", help="also `tutti demo` (the demo model on real vLLM, 4 prompts "
                    "of 2048 tokens served twice: recompute, then hits) over each root")
    ap.add_argument("--out", default="/tmp/distributed_fs.json")
    a = ap.parse_args()
    res: dict = {"kernel": os.uname().release, "cpus": os.cpu_count()}
    t0 = time.perf_counter()
    with gluster.Cluster(tempfile.mkdtemp(prefix="tutti-glbench-", dir=a.base)) as c:
        res["bringup_s"] = c.bringup_s
        res["brick_fs"] = gluster.fs_type_of(c.base) or "(the disk of " + str(c.base) + ")"
        direct = c.base / "direct"
        direct.mkdir()
        roots = (("mount", c.mounts["a"]), ("direct", direct))
        for label, root in roots:
            res.setdefault("raw", {})[label] = raw_rates(root)
            print(label, "raw", json.dumps(res["raw"][label]), flush=True)
        # the pipeline: rounds alternating between the roots (this machine's CPUs are shared), the
        # best store and load rate of each root kept; the first round warms the process up
        for r in range(a.rounds + 1):
            for label, root in roots:
                root = root / f"bench{r}"
                root.mkdir()
                got = pipeline_rates(root, a.tokens, a.layers)
                shutil.rmtree(root, ignore_errors=True)
                print(label, "pipeline", r, json.dumps(got), flush=True)
                if r == 0:
                    continue
                best = res.setdefault("pipeline", {}).setdefault(label, got)
                for k in ("store_MBps", "load_MBps"):
                    best[k] = max(best[k], got[k])
        if a.demo:
            from tutti.tools.demo import run_demo

            for label, root in roots:
                r = run_demo(root=str(root / "demo"), prompt_tokens=2048, echo=lambda s: None)
                res.setdefault("demo", {})[label] = {
                    "recompute_ttft_s": [x["ttft_s"] for x in r.first["rows"]],
                    "hit_ttft_s": [x["ttft_s"] for x in r.second["rows"]],
                    "hit_tokens": r.hit_tokens, "prompt_tokens": r.prompt_tokens, "identical": r.identical,
                    "declined_hit_tokens": r.second["stats"]["declined_hit_tokens"],
                    "load_MBps": r.second["stats"]["bytes_loaded"] / max(r.second["stats"]["load_seconds"], 1e-9) / 1e6}
                print("demo", label, json.dumps(res["demo"][label]), flush=True)
        for interval in (0.25, 0.05):
            d = follow_delays(c, interval, a.follows)
            res.setdefault("follow", {})[str(interval)] = {
                "median_s": statistics.median(d), "max_s": max(d), "min_s": min(d), "n": len(d)}
            print("follow", interval, json.dumps(res["follow"][str(interval)]), flush=True)
    res["total_s"] = time.perf_counter() - t0
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
