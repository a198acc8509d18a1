"""Gather/scatter bandwidth vs same-run baselines (copy_, index_select / index_copy_).

    python3 -m pytest bench/test_kernels_bench.py -s --benchmark-columns=mean,ops

GB/s counts read + write bytes of the KV moved. On CUDA the figure comes from
triton.testing.do_bench; on CPU the torch variant runs on small sizes (and Triton only under
TRITON_INTERPRET=1, tiny). A summary with ratios to the baselines is printed at the end.
"""

from __future__ import annotations

import os

import pytest
import torch

from tutti.kernels import PagedLayout, get_variant
from tutti.kernels import triton_kernels

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (name, roles, shape factory(num_blocks)) ; block 16
SHAPES = {
    # 8 KV heads x 128 dims bf16, K|V packed, NHD: vLLM 0.26 flash-attn style (B, H, N, 2D) view
    "attn_h8d128_bf16": dict(elems=(16, 8, 256), perm=(0, 2, 1, 3), roles=("block", "head", "token", "dim")),
    # MLA: 576-element latent (512 + 64) bf16
    "mla_576_bf16": dict(elems=(16, 576), perm=None, roles=("block", "token", "dim")),
}
NUM_LAYERS = 4 if CUDA else 2
TOTAL_BLOCKS = 4096 if CUDA else 256
MOVED_BLOCKS = 2048 if CUDA else 64
BLOCKS_PER_CHUNK = 16 if CUDA else 4

_results: dict = {}


def _setup(shape_name: str):
    spec = SHAPES[shape_name]
    caches = []
    for _ in range(NUM_LAYERS):
        a = torch.randn((TOTAL_BLOCKS, *spec["elems"]), device=DEV).to(torch.bfloat16)
        caches.append(a.permute(*spec["perm"]) if spec["perm"] else a)
    layout = PagedLayout.from_tensor(caches[0], spec["roles"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(TOTAL_BLOCKS, generator=g)[:MOVED_BLOCKS].reshape(-1, BLOCKS_PER_CHUNK).to(DEV)
    T = BLOCKS_PER_CHUNK * layout.block_size
    seg = torch.empty((NUM_LAYERS, ids.shape[0], layout.segment_bytes(T)), dtype=torch.uint8, device=DEV)
    kv_bytes = NUM_LAYERS * MOVED_BLOCKS * layout.block_size * layout.token_bytes
    return caches, layout, ids, seg, kv_bytes


def _time(benchmark, fn) -> float:
    """Seconds per call: do_bench on CUDA, pytest-benchmark's mean on CPU."""
    if CUDA:
        import triton.testing

        benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=10, warmup_rounds=2)
        return triton.testing.do_bench(fn, warmup=25, rep=100) / 1e3
    benchmark.pedantic(fn, rounds=5 if not INTERP else 1, warmup_rounds=1)
    return benchmark.stats.stats.mean


def _record(benchmark, shape, label, seconds, kv_bytes):
    gbps = 2 * kv_bytes / seconds / 1e9
    benchmark.extra_info.update(gbps=round(gbps, 2), kv_bytes=kv_bytes, device=DEV)
    _results.setdefault(shape, {})[label] = gbps


@pytest.fixture(scope="module", autouse=True)
def summary():
    yield
    for shape, res in _results.items():
        print(f"\n[{DEV}] {shape}: {NUM_LAYERS} layers x {MOVED_BLOCKS} blocks, GB/s (read+write)")
        for label, g in sorted(res.items()):
            print(f"  {label:28s} {g:9.2f}")
        for op, base in (("gather", "index_select"), ("scatter", "index_copy_")):
            for impl in ("triton", "torch"):
                k = f"{op}/{impl}"
                if k in res and base in res:
                    print(f"  {k} / {base} = {res[k] / res[base]:.2f}x ; / copy_ = {res[k] / res['copy_']:.2f}x")


def _impls():
    impls = ["torch"]
    if CUDA or INTERP:
        impls.append("triton")
    return impls


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_paged_copy(benchmark, shape, impl, op):
    caches, layout, ids, seg, kv_bytes = _setup(shape)
    v = get_variant(impl)
    fn = (lambda: v.gather(caches, layout, ids, seg)) if op == "gather" else (lambda: v.scatter(caches, layout, ids, seg))
    benchmark.group = f"{shape}/{op}"
    _record(benchmark, shape, f"{op}/{impl}", _time(benchmark, fn), kv_bytes)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("base", ["copy_", "index_select", "index_copy_"])
def test_baselines(benchmark, shape, base):
    """Same bytes moved by torch: a flat copy_ and whole-block index_select / index_copy_ (NHD
    blocks are contiguous, so this is the best case an index kernel can reach)."""
    caches, layout, ids, seg, kv_bytes = _setup(shape)
    flat = [c.permute(0, 2, 1, 3) if c.dim() == 4 else c for c in caches]  # back to memory order
    flat = [f.reshape(TOTAL_BLOCKS, -1) for f in flat]
    idx = ids.reshape(-1)
    dst = [torch.empty((MOVED_BLOCKS, flat[0].shape[1]), dtype=flat[0].dtype, device=DEV) for _ in flat]
    if base == "copy_":
        src = [f[:MOVED_BLOCKS] for f in flat]
        fn = lambda: [d.copy_(s) for d, s in zip(dst, src)]
    elif base == "index_select":
        fn = lambda: [torch.index_select(f, 0, idx, out=d) for f, d in zip(flat, dst)]
    else:
        fn = lambda: [f.index_copy_(0, idx, d) for f, d in zip(flat, dst)]
    benchmark.group = f"{shape}/baseline"
    _record(benchmark, shape, base, _time(benchmark, fn), kv_bytes)


@pytest.mark.skipif(not CUDA, reason="SM sweep needs CUDA")
@pytest.mark.parametrize("frac", [0.125, 0.25, 0.5, 1.0, 4.0, None])
@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_sm_sweep(benchmark, op, frac):
    """How much bandwidth is left when the launch may only occupy part of the GPU."""
    caches, layout, ids, seg, kv_bytes = _setup("attn_h8d128_bf16")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    mp = None if frac is None else max(1, int(sms * frac))
    f = triton_kernels.gather if op == "gather" else triton_kernels.scatter
    fn = lambda: f(caches, layout, ids, seg, max_programs=mp)
    benchmark.group = f"sm_sweep/{op}"
    label = f"{op}/triton/programs={mp if mp else 'all'}"
    _record(benchmark, "attn_h8d128_bf16 sweep", label, _time(benchmark, fn), kv_bytes)


@pytest.mark.skipif(not CUDA, reason="checksum bandwidth on CUDA")
def test_checksum_bandwidth(benchmark):
    from tutti.kernels import segment_checksum_triton

    segs = torch.randint(0, 256, (128, 1 << 20), dtype=torch.uint8, device=DEV)
    s = _time(benchmark, lambda: segment_checksum_triton(segs))
    gbps = segs.numel() / s / 1e9
    benchmark.extra_info.update(gbps_read=round(gbps, 2))
    _results.setdefault("checksum", {})["read GB/s"] = gbps
