"""Host cost of a whole load through the file path: per-layer items against chunk-major groups.

A load awaited whole (every asynchronous load on tutti's loading thread, a FULL CUDA-graph step)
of a 4k-token hit is stored through the real WorkerPipeline on a disk root, then loaded back
whole through the same worker, alternately by the per-layer path (a read, copy, verify, scatter
and event per layer and group of chunks) and chunk-major (tutti/engine/worker/loads/file_chunks.py: one read
per chunk, one copy/verify/scatter per group of chunks). Per job: host seconds, IO requests (a
wrapper of the real queue counts them) and torch calls made from Python (a TorchFunctionMode
counts every torch function and tensor method called: each releases and takes the GIL back):
`torch_calls` all of them, `pipeline_calls` those of the load pipeline with each checksum or
scatter kernel as one (on the CPU a kernel is torch code of many calls, on CUDA one launch: this
is the count CUDA would see, bar the copies and events the CPU does not make). Checksums are
verified as when serving. Same process, same files, same ring; the only switch is whether
`load_file_chunks` is asked.

    TRITON_INTERPRET=1 python3 bench/whole_load_calls.py --out results/whole_load_calls_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import tutti.engine.worker.loads.pipeline as loads_mod  # noqa: E402
from load_rate import store_all, worker  # noqa: E402
from tutti.engine.build import Geometry  # noqa: E402
from tutti.engine.plan import LoadChunk, StepPlan  # noqa: E402
from tutti.io.queue import WrappedQueue  # noqa: E402


class CountingQueue(WrappedQueue):
    """The worker's real queue, counting the requests it is handed."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.requests = 0

    def submit(self, requests):
        futs = self.inner.submit(requests)
        self.requests += len(futs)
        return futs


class TorchCalls(TorchFunctionMode):
    """Counts torch functions and tensor methods called from Python while active: all of them
    (`calls`), and those of the load pipeline with each checksum or scatter kernel as one
    (`pipeline`: on the CPU those kernels are torch code of many calls, on CUDA one launch each)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.pipeline = 0
        self.inside = 0  # > 0 within a kernel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.pipeline += self.inside == 0
        return func(*args, **(kwargs or {}))

    def kernel(self, fn):
        """`fn` counted as one pipeline call."""
        def run(*a, **kw):
            self.pipeline += 1
            self.inside += 1
            try:
                return fn(*a, **kw)
            finally:
                self.inside -= 1
        return run


def geometry(layers: int, chunk_tokens: int, heads: int) -> Geometry:
    """The 8B model's KV layout (bf16, head size 128, blocks of 16) with fewer KV heads: the
    same count of chunks and layers (what sets the calls), a quarter of the bytes at 2 heads."""
    return Geometry(model="whole-load-calls", cache_dtype="bfloat16", chunk_tokens=chunk_tokens, block_size=16,
                    num_layers=layers, num_heads=heads, content_bytes=2 * 128 * 2)


def make_caches(layers: int, blocks: int, heads: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn((2, blocks, 16, heads, 128), generator=g).to(torch.bfloat16) for _ in range(layers)]


def one_job(w, n: int, bpc: int, step: int, chunk_major: bool) -> dict:
    """One whole load of every chunk; returns its host seconds, requests and torch calls."""
    real = loads_mod.load_file_chunks
    if not chunk_major:
        loads_mod.load_file_chunks = lambda lp, todo: False  # the per-layer path, same ring and files
    loads = [LoadChunk("q", i.to_bytes(32, "little"), i, tuple(range(i * bpc, (i + 1) * bpc))) for i in range(n)]
    for c in w.caches:
        c.zero_()
    before = w.queue.requests
    mode = TorchCalls()
    ctx = w.ctx
    kernels = {"checksum": ctx.checksum, "scatter": ctx.scatter}
    for name, fn in kernels.items():
        setattr(ctx, name, mode.kernel(fn))
    try:
        t0 = time.perf_counter()
        with mode:
            w.start_step(StepPlan(step, loads=loads), layerwise=False)
            w.end_step()
            failed = w.take_failed_blocks()
        dt = time.perf_counter() - t0
    finally:
        loads_mod.load_file_chunks = real
        for name, fn in kernels.items():
            setattr(ctx, name, fn)
    assert not failed, f"{len(failed)} blocks failed"
    return {"seconds": dt, "requests": w.queue.requests - before, "torch_calls": mode.calls,
            "pipeline_calls": mode.pipeline}


KEYS = ("seconds", "requests", "torch_calls", "pipeline_calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="uring")
    ap.add_argument("--root", default=None, help="a directory on a disk (default: a temporary one)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    geom = geometry(a.layers, a.chunk_tokens, a.heads)
    bpc = a.chunk_tokens // 16
    n = a.tokens // a.chunk_tokens
    caches = make_caches(a.layers, n * bpc, a.heads)
    root = tempfile.mkdtemp(prefix="whole-load-calls-", dir=a.root)
    chunk = a.layers * geom.segment_bytes
    # a load ring of 8 chunks (two halves of 4); stores hold 4 chunks a step
    slot = 2 << 20
    ring_slots = max(1, 8 * chunk // slot)
    kw = dict(io_backend=a.backend, staging_bytes=(ring_slots + 2 * ring_slots) * slot,
              staging_slots=3 * ring_slots, max_inflight_stores=2 * ring_slots, mapped_loads=False,
              capacity_bytes=2 * n * chunk)
    try:
        store_all(root, caches, geom, n, bpc, **kw)
        sections = {}
        for verify in (True, False):  # off: the path's own cost, without the CPU's torch checksum
            w = worker(root, caches, geom, verify_checksums=verify, **kw)
            w.queue = CountingQueue(w.queue)
            runs: dict[str, list[dict]] = {"per_layer": [], "chunk_major": []}
            one_job(w, n, bpc, 1, True)  # warm: the page cache plays no part (O_DIRECT), the code paths do
            for r in range(a.repeats):
                for name in ("per_layer", "chunk_major"):  # alternated: drift hits both alike
                    runs[name].append(one_job(w, n, bpc, 10 + 2 * r + (name == "chunk_major"),
                                              name == "chunk_major"))
            w.close()
            med = {name: {k: statistics.median(j[k] for j in js) for k in KEYS} for name, js in runs.items()}
            sections["checksums_on" if verify else "checksums_off"] = {
                "median": med,
                "ratio_per_layer_over_chunk_major": {k: med["per_layer"][k] / med["chunk_major"][k] for k in KEYS},
                "runs": runs}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = {
        "what": "one whole load (layerwise=False) of a hit through the file path, per-layer vs chunk-major",
        "command": "TRITON_INTERPRET=1 python3 bench/whole_load_calls.py " + " ".join(sys.argv[1:]),
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                 "device": "cpu"},
        "geometry": {"tokens": a.tokens, "kv_heads": a.heads, "chunks": n, "layers": a.layers,
                     "chunk_tokens": a.chunk_tokens, "segment_bytes": geom.segment_bytes, "chunk_bytes": chunk,
                     "load_ring_chunks": 8},
        "backend": a.backend, "repeats": a.repeats,
        **sections,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
