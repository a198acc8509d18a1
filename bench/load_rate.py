"""Load rate of tutti's worker pipeline against the ceilings of the same machine, same run.

A 32k-token prompt of an 8B model's KV geometry (32 layers, 8 KV heads, head_dim 128, bf16,
vLLM's FlashAttention layout [2, blocks, 16, heads, dim]: 4 GiB) is stored through the real
WorkerPipeline, then loaded back whole (as in a FULL CUDA-graph step) and layer by layer (as in
a PIECEWISE or eager step, with no model compute in between: the pipeline alone), timed from
the step's start to the moment the GPU has scattered the last layer. Beside it, measured in the
same process on the same files:
  - raw reads of the slab files (threads backend, pinned buffer; io_uring where not tmpfs),
  - pinned host-to-device copies (the PCIe ceiling),
  - host-to-device copies straight from a registered mapping of a slab file (the RAM-root ceiling).
Roots: /dev/shm (mapped loads on and off) and a disk directory (O_DIRECT).

    python3 bench/load_rate.py --out /tmp/load_rate.json [--tokens 32768] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk  # noqa: E402
from tutti.engine.build import Geometry, build_worker  # noqa: E402
from tutti.kernels import PagedLayout  # noqa: E402

BS, H, D = 16, 8, 128


def make_caches(layers: int, blocks: int, dev: str, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(0)
    return [torch.randn((2, blocks, BS, H, D), generator=g, device=dev, dtype=torch.float32).to(dtype)
            for _ in range(layers)]


def geometry(layers: int, chunk_tokens: int) -> Geometry:
    return Geometry(model="load-rate", cache_dtype="bfloat16", chunk_tokens=chunk_tokens, block_size=BS,
                    num_layers=layers, num_heads=H, content_bytes=2 * D * 2)


def worker(root: str, caches, geom: Geometry, **kw):
    layout = PagedLayout.from_tensor(caches[0], ("kv", "block", "token", "head", "dim"))
    cfg = {"root": root, "capacity_bytes": 8 * (4 << 30), "chunk_tokens": geom.chunk_tokens,
           "staging_bytes": "2GiB", "staging_slots": 256, "max_inflight_stores": 192, "lookahead": 2}
    cfg.update(kw)
    w = build_worker(cfg, geom, caches=caches, layout=layout)
    w.warm_up()
    return w


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def store_all(root, caches, geom, n_chunks, bpc, **kw) -> float:
    w = worker(root, caches, geom, **kw)
    t0 = time.perf_counter()
    per_step = 8
    for s in range(0, n_chunks, per_step):
        stores = [StoreChunk("r", i.to_bytes(32, "little"), i, tuple(range(i * bpc, (i + 1) * bpc)), ticket=i + 1)
                  for i in range(s, min(n_chunks, s + per_step))]
        w.start_step(StepPlan(s + 1, stores=stores))
        w.end_step()
        w.flush(timeout=600)
    dt = time.perf_counter() - t0
    rep = w.take_report()
    w.close()
    assert len(rep.stored) == n_chunks, (len(rep.stored), rep.store_failed[:5])
    return dt


def load_once(w, n_chunks, bpc, step, layerwise: bool, layers: int) -> float:
    loads = [LoadChunk("q", i.to_bytes(32, "little"), i, tuple(range(i * bpc, (i + 1) * bpc))) for i in range(n_chunks)]
    for c in w.caches:
        c.zero_()
    sync()
    t0 = time.perf_counter()
    w.start_step(StepPlan(step, loads=loads), layerwise=layerwise)
    if layerwise:
        for layer in range(layers):
            w.wait_layer(layer)
            w.save_layer(layer)
    w.end_step()
    sync()
    dt = time.perf_counter() - t0
    failed = w.take_failed_blocks()
    assert not failed, f"{len(failed)} blocks failed"
    return dt


def _copy_rate(host: torch.Tensor, rounds: int = 4) -> float:
    """GB/s of host-to-device copies of `host` (one warm-up copy first)."""
    dev = torch.empty(host.numel(), dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    sync()
    t0 = time.perf_counter()
    for _ in range(rounds):
        dev.copy_(host, non_blocking=True)
    sync()
    return rounds * host.numel() / (time.perf_counter() - t0) / 1e9


def ceilings(root: str, nbytes: int) -> dict:
    from tutti.io.buffers import aligned_buffer
    from tutti.io.queue import IORequest, open_queue, submit_all, wait_all
    from tutti.store.rammap import fs_type, register_host

    out = {"fs": fs_type(root)}
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith("slab-"))
    seg = 1 << 20
    for backend in ("threads",) + (() if out["fs"] == "tmpfs" else ("uring",)):
        q = open_queue(backend)
        buf = aligned_buffer(256 * seg)
        q.register_buffers([buf])
        total, t = 0, 0.0
        for path in files:
            fd = q.open_file(path)
            size = min(os.fstat(fd).st_size, nbytes - total) // seg * seg
            reqs = [IORequest(fd, off, buf, (i % 256) * seg, seg) for i, off in enumerate(range(0, size, seg))]
            t0 = time.perf_counter()
            for i in range(0, len(reqs), 256):
                wait_all(submit_all(q, reqs[i:i + 256]))
            t += time.perf_counter() - t0
            total += size
            os.close(fd)
        q.close()
        out[f"read_{backend}_GBps"] = total / t / 1e9 if t else 0.0
    if torch.cuda.is_available():
        out["h2d_pinned_GBps"] = _copy_rate(aligned_buffer(1 << 30))
        if out["fs"] == "tmpfs" and files:
            import mmap

            fd = os.open(files[0], os.O_RDONLY)
            n = os.fstat(fd).st_size // (1 << 20) * (1 << 20)
            mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            t_map = torch.frombuffer(mm, dtype=torch.uint8)
            t0 = time.perf_counter()
            undo = register_host(t_map.data_ptr(), n)
            out["register_s_per_GiB"] = (time.perf_counter() - t0) / (n / (1 << 30))
            out["h2d_mapped_GBps"] = _copy_rate(t_map)
            out["mapped_registered"] = undo is not None
            if undo:
                undo()
            del t_map
            os.close(fd)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/load_rate.json")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--shm-root", default="/dev/shm/tutti-load-rate")
    ap.add_argument("--disk-root", default="/tmp/tutti-load-rate")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--roots", default="shm,disk")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    geom = geometry(a.layers, a.chunk_tokens)
    bpc = a.chunk_tokens // BS
    n_chunks = a.tokens // a.chunk_tokens
    blocks = n_chunks * bpc
    caches = make_caches(a.layers, blocks, dev)
    kv_bytes = sum(c.numel() * c.element_size() for c in caches)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "tokens": a.tokens,
           "layers": a.layers, "kv_bytes": kv_bytes, "cases": []}
    for name in a.roots.split(","):
        root = a.shm_root if name == "shm" else a.disk_root
        shutil.rmtree(root, ignore_errors=True)
        store_s = store_all(root, caches, geom, n_chunks, bpc, mapped_loads=False)
        ceil = ceilings(root, kv_bytes)
        res.setdefault("ceilings", {})[name] = ceil
        variants = [("mapped", {"mapped_loads": True}), ("file", {"mapped_loads": False})] if name == "shm" else \
                   [("file", {"mapped_loads": False})]
        for label, kw in variants:
            for slots in (256, 64):
                w = worker(root, caches, geom, staging_slots=slots, max_inflight_stores=slots // 4 * 3, **kw)
                row = {"root": name, "path": label, "staging_slot_MiB": (2 << 30) // slots >> 20,
                       "backend": w.queue.caps().backend, "store_s": store_s, "warmup_s": w.warmup_seconds}
                for mode, lw in (("whole", False), ("layerwise", True)):
                    times = [load_once(w, n_chunks, bpc, 10 + r, lw, a.layers) for r in range(a.repeats)]
                    row[f"{mode}_s"] = min(times)
                    row[f"{mode}_GBps"] = kv_bytes / min(times) / 1e9
                w.close()
                res["cases"].append(row)
                print(json.dumps(row), flush=True)
        shutil.rmtree(root, ignore_errors=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res.get("ceilings"), indent=1))


if __name__ == "__main__":
    main()
