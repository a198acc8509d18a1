"""TuttiTier vs vLLM's own `fs` tier: the same chunks stored and loaded through vLLM's
secondary-tier interface (TransferJob in, JobResult out), on the same disk, in the same process.

Why here and not only on the GPU: both tiers move bytes between vLLM's CPU tier (a host memory
region) and files; no GPU is involved below the CPU tier, so the disk half of the H200's
end-to-end figure (scripts/gpu_tier.py) can be measured, and improved, on any machine.

What it measures: `--chunks` chunks of `--chunk-bytes` (default 2 MiB: 16 tokens of the 8B
geometry, vLLM's offload chunk at block size 16) stored as one job, then loaded as one job (a
long prompt's promotion), the page cache emptied of both tiers' files before each load
(fadvise DONTNEED after the data is durable; fs reads with O_DIRECT anyway). Rounds alternate
the order of the tiers. Reported: median GB/s per tier and direction and the ratio tutti / fs.

Run:
    python3 bench/test_tier_bench.py --quick             # 128 chunks x 2 MiB, 3 rounds, a table
    python3 -m pytest bench/test_tier_bench.py --benchmark-only -s
Env / flags: TUTTI_TIER_BENCH_DIR (the file system under test; default the temp dir).
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

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

MiB = 1 << 20


def offloading_spec(chunk_bytes: int):
    """A real TieringOffloadingSpec over a config like the one vLLM builds for the 8B geometry."""
    from vllm.v1.kv_offload import config as c
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"l{i}" for i in range(32)),
                                        group_id=0),),
        worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False, extra_config={"secondary_tiers": [], "cpu_bytes_to_use": 1 << 30},
        engine_id="bench", model=c.OffloadingModelConfig(name="tier-bench-8b", dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                            data_parallel_index=0, data_parallel_size=1,
                                            data_parallel_rank_local=0, is_parallelism_agnostic=True))
    return TieringOffloadingSpec(cfg)


def aligned(shape: tuple[int, int]) -> np.ndarray:
    """Page-aligned like vLLM's CPU tier (pinned pages): what O_DIRECT needs."""
    n = shape[0] * shape[1]
    raw = np.empty(n + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    return raw[off:off + n].reshape(shape)


def make_tier(kind: str, root: str, spec, region: np.ndarray):
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    view = memoryview(region)
    if kind == "fs":
        return SecondaryTierFactory.create_secondary_tier({"type": "fs", "root_dir": root}, view, spec)
    return SecondaryTierFactory.create_secondary_tier(
        {"type": "TuttiTier", "module_path": "tutti.vllm.tier", "root": root,
         "capacity_bytes": 2 * region.nbytes + (64 << 20)}, view, spec)


def run_job(tier, job_id: int, keys: list[bytes], chunks: list[int], promotion: bool, timeout: float = 600) -> float:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    job = TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks), is_promotion=promotion,
                      req_context=ReqContext(req_id=f"bench-{job_id}"))
    t0 = time.perf_counter()
    (tier.submit_load if promotion else tier.submit_store)(job)
    end = t0 + timeout
    while time.perf_counter() < end:
        done = list(tier.get_finished_jobs())
        if done:
            dt = time.perf_counter() - t0
            if not all(r.success for r in done):
                raise RuntimeError(f"job {job_id} failed in {type(tier).__name__}")
            return dt
        time.sleep(0.0005)
    raise TimeoutError(f"job {job_id} did not finish in {timeout} s")


def evict(root: str) -> None:
    """Drop the tier's file pages from the page cache (clean after the tier's own syncs)."""
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def measure(base: str, chunks: int, chunk_bytes: int, rounds: int, kinds=("fs", "tutti")) -> dict:
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    spec = offloading_spec(chunk_bytes)
    src = np.random.default_rng(0).integers(0, 256, (chunks, chunk_bytes), dtype=np.uint8)
    results: dict = {k: {"store_gbs": [], "load_gbs": []} for k in kinds}
    job = 0
    for rnd in range(rounds):
        order = list(kinds) if rnd % 2 == 0 else list(reversed(kinds))
        for kind in order:
            root = os.path.join(base, f"{kind}-{rnd}")
            shutil.rmtree(root, ignore_errors=True)
            os.makedirs(root)
            region = aligned(src.shape)
            region[:] = src
            tier = make_tier(kind, root, spec, region)
            keys = [bytes([rnd, i & 255, i >> 8]) + b"k" * 29 for i in range(chunks)]
            job += 1
            ts = run_job(tier, job, keys, list(range(chunks)), False)
            region[:] = 0
            evict(root)
            job += 1
            tl = run_job(tier, job, keys, list(range(chunks)), True)
            if not np.array_equal(region, src):
                raise AssertionError(f"{kind}: loaded bytes differ from the stored ones")
            tier.shutdown()
            results[kind]["store_gbs"].append(chunks * chunk_bytes / ts / 1e9)
            results[kind]["load_gbs"].append(chunks * chunk_bytes / tl / 1e9)
            shutil.rmtree(root, ignore_errors=True)
    out = {"chunks": chunks, "chunk_bytes": chunk_bytes, "rounds": rounds, "dir": base}
    for kind, r in results.items():
        out[kind] = {k: statistics.median(v) for k, v in r.items()} | {"raw": r}
    if "fs" in results and "tutti" in results:
        out["ratio_tutti_over_fs"] = {d: out["tutti"][d] / out["fs"][d] for d in ("store_gbs", "load_gbs")}
    return out


def table(res: dict) -> str:
    rows = [f"| {k} | {res[k]['store_gbs']:.2f} | {res[k]['load_gbs']:.2f} |" for k in ("fs", "tutti") if k in res]
    r = res.get("ratio_tutti_over_fs")
    if r:
        rows.append(f"| tutti / fs | {r['store_gbs']:.2f}x | {r['load_gbs']:.2f}x |")
    return (f"{res['chunks']} chunks x {res['chunk_bytes'] >> 20} MiB, median of {res['rounds']} rounds, {res['dir']}\n"
            "| tier | store GB/s | load GB/s |\n|---|---|---|\n" + "\n".join(rows))


def _base_dir() -> str:
    return tempfile.mkdtemp(prefix="tutti-tier-bench-", dir=os.environ.get("TUTTI_TIER_BENCH_DIR") or None)


def test_tier_load_throughput(benchmark):
    """pytest-benchmark: one load job of 64 x 2 MiB chunks through TuttiTier (fs's figure beside it
    in extra_info, measured in the same process)."""
    base = _base_dir()
    try:
        res = measure(base, 64, 2 * MiB, 1)
        benchmark.extra_info.update(res)
        print("\n" + table(res))  # the ratio to vLLM's fs tier: what `tutti bench tier` is for
        spec = offloading_spec(2 * MiB)
        src = np.random.default_rng(1).integers(0, 256, (64, 2 * MiB), dtype=np.uint8)
        region = aligned(src.shape)
        region[:] = src
        root = os.path.join(base, "pb")
        os.makedirs(root)
        tier = make_tier("tutti", root, spec, region)
        keys = [bytes([9, i]) + b"p" * 30 for i in range(64)]
        run_job(tier, 1, keys, list(range(64)), False)
        ids = iter(range(2, 1 << 30))
        benchmark.pedantic(lambda: run_job(tier, next(ids), keys, list(range(64)), True),
                           setup=lambda: evict(root), rounds=3)
        assert np.array_equal(region, src)
        tier.shutdown()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="128 chunks, 3 rounds")
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--chunk-bytes", type=int, default=2 * MiB)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.quick:
        a.chunks, a.rounds = 128, 3
    base = _base_dir()
    try:
        res = measure(base, a.chunks, a.chunk_bytes, a.rounds)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
