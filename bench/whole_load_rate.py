"""A whole load's read rate from a disk root through the real WorkerPipeline (the CPU is enough).

A load awaited whole (every asynchronous load, a FULL CUDA-graph step) of `tokens` tokens of the
8B KV geometry (32 layers, chunks of 256 tokens, 32 MiB each), checksums off (on the CPU the torch
checksum, not the drive, would set the rate), io_uring with O_DIRECT; five repeats, GB/s each.

    python3 bench/whole_load_rate.py 4096      # or 16384; --root is /tmp/ab-load-root
"""
import os, sys, time, shutil
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from load_rate import geometry, make_caches, worker, store_all, load_once
layers, tokens = 32, int(sys.argv[1]) if len(sys.argv) > 1 else 4096
geom = geometry(layers, 256)
bpc = 16
n = tokens // 256
caches = make_caches(layers, n * bpc, "cpu")
root = "/tmp/ab-load-root"
shutil.rmtree(root, ignore_errors=True); os.makedirs(root)
kw = dict(verify_checksums=False, io_backend="uring", staging_bytes="384MiB", staging_slots=48, max_inflight_stores=32)
store_all(root, caches, geom, n, bpc, **kw)
w = worker(root, caches, geom, **kw)
ts = [load_once(w, n, bpc, 100 + i, False, layers) for i in range(5)]
w.close()
nbytes = n * layers * geom.segment_bytes
print(tokens, "tokens whole:", [round(nbytes / t / 1e9, 2) for t in ts], "GB/s")
shutil.rmtree(root, ignore_errors=True)
