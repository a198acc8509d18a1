"""Overlap of the layer-wise load pipeline with compute (the engine issue's GPU benchmark).

A synthetic model of L layers: each layer is a matmul of tunable duration, and each layer's KV
for N chunks comes from storage through the full pipeline (IO into staging, copy to the GPU,
scatter on a side stream, one event per layer). Reported, all measured in the same run:
  io      - a step with the loads alone (wait for each layer back to back)
  compute - the matmuls alone
  wall    - both together, the way vLLM runs them
  overlap efficiency = max(io, compute) / wall   (1.0 = storage fully hidden)
and the host time spent in the step-start hook per request.

    python3 bench/pipeline_overlap.py --root /dev/shm/tutti-bench [--layers 32 --chunks 8]
Runs on the CPU too (small sizes, synchronous kernels), where overlap is not expected.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk  # noqa: E402
from tutti.engine.build import Geometry, build_worker  # noqa: E402
from tutti.kernels import PagedLayout  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/tutti-overlap")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=8, help="chunks loaded per layer (one request each)")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--io-backend", default="auto")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--matmul", type=int, default=0, help="matmul size; 0 = calibrate to balance with IO")
    ap.add_argument("--gil-spin", action="store_true",
                    help="a thread spins in Python through every timed step (vLLM's engine loop beside a load): "
                         "do reads slow down when the reaper and the step wait for the GIL?")
    ap.add_argument("--switch-interval", type=float, default=0.0, help="sys.setswitchinterval for the run (0: leave it)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)

    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    spin = Spinner() if a.gil_spin else None
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    es = torch.empty((), dtype=dtype).element_size()
    T, H, D, N = a.chunk_tokens, a.heads, a.head_size, a.block_size
    bpc = T // N
    nblocks = 2 * a.chunks * bpc + 8
    # vLLM 0.26 FlashAttention NHD: logical (B, H, N, 2D), physical (B, N, H, 2D)
    caches = [torch.randn(nblocks, N, H, 2 * D, device=dev, dtype=dtype).permute(0, 2, 1, 3) for _ in range(a.layers)]
    layout = PagedLayout.from_tensor(caches[0], ("block", "head", "token", "dim"))
    geom = Geometry(model="overlap-bench", cache_dtype=str(dtype).replace("torch.", ""), chunk_tokens=T, block_size=N,
                    num_layers=a.layers, num_heads=H, content_bytes=2 * D * es)
    shutil.rmtree(a.root, ignore_errors=True)
    os.makedirs(a.root, exist_ok=True)
    seg = geom.segment_bytes
    staging_slots = a.layers + a.lookahead + 2  # stores hold one slot per layer; loads roll through the rest
    cfg = {"root": a.root, "capacity_bytes": (a.chunks + 1) * geom.slot_bytes, "chunk_tokens": T,
           "io_backend": a.io_backend, "kernel_variant": a.kernel, "lookahead": a.lookahead,
           "staging_slots": staging_slots, "max_inflight_stores": a.layers,
           "staging_bytes": staging_slots * a.chunks * seg}
    w = build_worker(cfg, geom, caches=caches, layout=layout)
    # store the chunks once through the pipeline itself
    stores = [StoreChunk(f"r{i}", bytes([i]) * 32, i, tuple(range(i * bpc, (i + 1) * bpc)), ticket=i + 1)
              for i in range(a.chunks)]
    w.start_step(StepPlan(1, stores=stores))
    for layer in range(a.layers):
        w.save_layer(layer)
    w.end_step()
    w.flush()
    rep = w.take_report()
    assert sorted(rep.stored) == [s.ticket for s in stores], rep
    loads = [LoadChunk(f"q{i}", bytes([i]) * 32, i, tuple(range((a.chunks + i) * bpc, (a.chunks + i + 1) * bpc)))
             for i in range(a.chunks)]

    def step(compute, io, x=None, wmat=None) -> tuple[float, float]:
        sync(dev)
        with spin or contextlib.nullcontext():
            return _step(compute, io, x, wmat)

    def _step(compute, io, x=None, wmat=None) -> tuple[float, float]:
        t0 = time.perf_counter()
        host = 0.0
        if io:
            h0 = time.perf_counter()
            w.start_step(StepPlan(0, loads=loads))
            host = time.perf_counter() - h0
        for layer in range(a.layers):
            if io:
                w.wait_layer(layer)
            if compute:
                x = torch.tanh(x @ wmat)
            if io:
                w.save_layer(layer)
        if io:
            w.end_step()
        sync(dev)
        return time.perf_counter() - t0, host

    io_t = [step(False, True)[0] for _ in range(a.rounds)]
    io_s = statistics.median(io_t)
    m = a.matmul
    if m == 0:  # calibrate: total compute within 10 % of the loads alone (the balanced case)
        m = 512
        for _ in range(10):
            x = torch.randn(m, m, device=dev, dtype=dtype)
            wm = torch.randn(m, m, device=dev, dtype=dtype) / m ** 0.5
            step(True, False, x, wm)  # warm-up: library heuristics for this size
            c = statistics.median(step(True, False, x, wm)[0] for _ in range(3))
            if abs(c / io_s - 1) < 0.1:
                break
            # matmul time grows as m^3: step towards the balance, at most 2x per move
            m = max(64, min(32768, int(m * min(2.0, max(0.5, (io_s / max(c, 1e-6)) ** (1 / 3))))))
    x = torch.randn(m, m, device=dev, dtype=dtype)
    wm = torch.randn(m, m, device=dev, dtype=dtype) / m ** 0.5
    comp, wall, hosts = [], [], []
    for _ in range(a.rounds):  # interleaved so drift hits all three alike
        comp.append(step(True, False, x, wm)[0])
        t, h = step(True, True, x, wm)
        wall.append(t)
        hosts.append(h)
        io_t.append(step(False, True)[0])
    failed = w.take_failed_blocks()
    res = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "layers": a.layers, "chunks": a.chunks, "segment_bytes": seg, "bytes_per_step": a.layers * a.chunks * seg,
        "backend": w.queue.caps().backend, "kernel": w.kernel.name, "matmul": m, "root": a.root,
        "io_s": statistics.median(io_t), "compute_s": statistics.median(comp), "wall_s": statistics.median(wall),
        "host_start_step_ms_per_request": 1e3 * statistics.median(hosts) / a.chunks,
        "failed_blocks": len(failed), "gil_spin": a.gil_spin, "switch_interval": sys.getswitchinterval(),
    }
    res["overlap_efficiency"] = max(res["io_s"], res["compute_s"]) / res["wall_s"]
    res["load_GBps"] = res["bytes_per_step"] / res["io_s"] / 1e9
    w.close()
    shutil.rmtree(a.root, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


class Spinner:
    """A thread that runs Python while the context is open (vLLM's engine loop, busy beside a step)."""

    def __init__(self) -> None:
        self._on = threading.Event()
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop:
            self._on.wait()
            n = 0
            while self._on.is_set():
                n += 1  # pure Python: holds the GIL until the interpreter switches

    def __enter__(self) -> "Spinner":
        self._on.set()
        return self

    def __exit__(self, *exc) -> None:
        self._on.clear()


if __name__ == "__main__":
    main()
