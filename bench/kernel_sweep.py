"""Sweep the Triton gather/scatter launch parameters against a same-bytes copy_, same run.

Layouts: vLLM's FlashAttention cache ([2, blocks, 16, 8 KV heads, 128] bf16, K and V apart),
the packed K|V layout of bench/test_kernels_bench.py, and an MLA latent ([blocks, 16, 576]
bf16). For each: copy_ of the same bytes (the baseline), then gather and scatter for every
(block words, num_warps, split, group) tried, in GB/s of read + write and as a ratio to copy_.

    python3 bench/kernel_sweep.py --out /tmp/kernel_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tutti.kernels import PagedLayout, triton_kernels  # noqa: E402

LAYERS, TOTAL, MOVED, BPC = 4, 4096, 2048, 16
SHAPES = {
    "fa_kv_apart_h8d128": dict(shape=(2, TOTAL, 16, 8, 128), roles=("kv", "block", "token", "head", "dim")),
    "packed_h8d128": dict(shape=(TOTAL, 16, 8, 256), perm=(0, 2, 1, 3), roles=("block", "head", "token", "dim")),
    "mla_576": dict(shape=(TOTAL, 16, 576), roles=("block", "token", "dim")),
}


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60) / 1e3


def setup(name: str):
    spec = SHAPES[name]
    caches = []
    for _ in range(LAYERS):
        a = torch.randn(spec["shape"], device="cuda").to(torch.bfloat16)
        caches.append(a.permute(*spec["perm"]) if "perm" in spec else a)
    layout = PagedLayout.from_tensor(caches[0], spec["roles"])
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(TOTAL, generator=g)[:MOVED].reshape(-1, BPC).to("cuda")
    T = BPC * layout.block_size
    seg = torch.empty((LAYERS, ids.shape[0], layout.segment_bytes(T)), dtype=torch.uint8, device="cuda")
    kv = LAYERS * MOVED * layout.block_size * layout.token_bytes
    return caches, layout, ids, seg, kv


def defaults_only(a) -> None:
    """The default launches against copy_, N interleaved rounds: the spread says how much one
    figure of the sweep can be trusted."""
    import statistics

    out = {"device": torch.cuda.get_device_name(), "rounds": a.defaults_only, "shapes": {}}
    for name in a.shapes.split(","):
        caches, layout, ids, seg, kv = setup(name)
        src = torch.empty(kv, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        variants = {"": {}}
        for c in filter(None, a.configs.split(",")):
            blk, warps, split = (int(x) for x in c.split(":"))
            variants[f"[{c}]"] = dict(block=blk, num_warps=warps, split=split or None)
        ops = [op + tag for tag in variants for op in ("gather", "scatter")]
        rounds = {"copy": [], **{op: [] for op in ops}}
        for _ in range(a.defaults_only):
            rounds["copy"].append(2 * kv / bench(lambda: dst.copy_(src)) / 1e9)
            for tag, kw in variants.items():
                for op, fn in (("gather", triton_kernels.gather), ("scatter", triton_kernels.scatter)):
                    rounds[op + tag].append(2 * kv / bench(
                        lambda: fn(caches, layout, ids, seg, id_range=(0, TOTAL - 1), **kw)) / 1e9)
        ratios = {op: [g / c for g, c in zip(rounds[op], rounds["copy"])] for op in ops}
        out["shapes"][name] = {"GBps": rounds, "x_copy_median": {op: statistics.median(r) for op, r in ratios.items()},
                               "x_copy_range": {op: (min(r), max(r)) for op, r in ratios.items()}}
        print(name, {op: round(statistics.median(r), 3) for op, r in ratios.items()},
              {op: (round(min(r), 3), round(max(r), 3)) for op, r in ratios.items()}, flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/kernel_sweep.json")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default="", help="with --defaults-only: also these launches, "
                    "'block:warps:split' comma-separated (split 0 = one program per tile)")
    ap.add_argument("--defaults-only", type=int, default=0, metavar="N",
                    help="skip the sweep; time copy_ and the default launch N times, interleaved (median and range)")
    a = ap.parse_args()
    if a.defaults_only:
        return defaults_only(a)
    out = {"device": torch.cuda.get_device_name(), "layers": LAYERS, "moved_blocks": MOVED, "shapes": {}}
    for name in a.shapes.split(","):
        caches, layout, ids, seg, kv = setup(name)
        src = torch.empty(kv, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy_gbps = 2 * kv / bench(lambda: dst.copy_(src)) / 1e9
        rows = []
        groups = (1, 4) if name.startswith("mla") else (1,)
        configs = [(1024, 4, 1)] + [(b, w, None) for b in (1024, 2048, 4096) for w in (4, 8)]  # first: the old default
        for op, (block, warps, split), group in itertools.product(("gather", "scatter"), configs, groups):
            fn = triton_kernels.gather if op == "gather" else triton_kernels.scatter
            kw = dict(block=block, num_warps=warps, split=split, group=group, id_range=(0, TOTAL - 1))
            try:
                fn(caches, layout, ids, seg, **kw)
                t = bench(lambda: fn(caches, layout, ids, seg, **kw))
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a row too
                rows.append({"op": op, "block": block, "warps": warps, "split": split, "group": group, "error": str(exc)[:200]})
                continue
            g = 2 * kv / t / 1e9
            rows.append({"op": op, "block": block, "warps": warps, "split": split, "group": group,
                         "GBps": round(g, 1), "x_copy": round(g / copy_gbps, 3)})
        default = {}
        for op in ("gather", "scatter"):
            fn = triton_kernels.gather if op == "gather" else triton_kernels.scatter
            fn(caches, layout, ids, seg, id_range=(0, TOTAL - 1))
            t = bench(lambda: fn(caches, layout, ids, seg, id_range=(0, TOTAL - 1)))
            default[op] = {"GBps": round(2 * kv / t / 1e9, 1), "x_copy": round(2 * kv / t / 1e9 / copy_gbps, 3)}
        best = {op: max((r for r in rows if r["op"] == op and "GBps" in r), key=lambda r: r["GBps"]) for op in ("gather", "scatter")}
        out["shapes"][name] = {"copy_GBps": round(copy_gbps, 1), "kv_bytes": kv, "default": default, "best": best, "rows": rows}
        print(name, "copy", round(copy_gbps), "default", default, "best", best, flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
