"""The format-2 segment checksum, compiled: Triton on the GPU against the torch reference and
the written definition (docs/format.md), and what it costs per byte next to a plain copy.

The CPU suite runs the Triton kernel only through the interpreter; a compiled kernel that
disagrees would fail every load (each chunk then recomputed) or, worse, pass a damaged one.

    python3 scripts/gpu_checksum.py --out $OUT       # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tutti.kernels import (segment_checksum, segment_checksum_definition as by_definition,  # noqa: E402
                           segment_checksum_torch, segment_checksum_triton)


def agree() -> dict:
    out = {}
    # an 8B geometry's segment (256 tokens x 2 x 8 heads x 128 x bf16 = 1 MiB), odd sizes, many rows
    for shape in [(4096,), (3, 8192 + 12), (2, 2, 4096 * 5), (31, 1 << 20), (127, 1 << 20), (5000, 4096)]:
        g = torch.Generator().manual_seed(sum(shape))
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
        ref = segment_checksum_torch(x)
        xc = x.cuda()
        tri = segment_checksum_triton(xc).cpu()
        auto = segment_checksum(xc).cpu()
        alt = segment_checksum_triton(xc, splits=3, block=256).cpu()
        flat = x.reshape(-1, shape[-1])
        ok_def = True
        if shape[-1] <= 1 << 16:
            ok_def = int(ref.reshape(-1)[-1]) == by_definition(flat[-1].numpy().tobytes())
        out[str(shape)] = {"triton_eq_torch": bool(torch.equal(ref, tri)), "auto_eq_torch": bool(torch.equal(ref, auto)),
                           "splits3_eq_torch": bool(torch.equal(ref, alt)), "torch_eq_definition": ok_def}
    x = torch.full((2, 4096), 0xFF, dtype=torch.uint8)
    out["all_ones"] = bool(torch.equal(segment_checksum_torch(x), segment_checksum_triton(x.cuda()).cpu()))
    # a flipped byte changes it, on the GPU
    y = torch.randint(0, 256, (4, 1 << 20), dtype=torch.uint8).cuda()
    a = segment_checksum(y).clone()
    y[2, 12345] ^= 0x10
    b = segment_checksum(y)
    out["flip_changes_only_that_row"] = bool(a[2] != b[2] and torch.equal(a[[0, 1, 3]], b[[0, 1, 3]]))
    return out


def cost() -> dict:
    """GB/s of the checksum over one step of 8B stores (32 chunks x 32 layers x 1 MiB) beside a
    device-to-device copy of the same bytes."""
    x = torch.randint(0, 256, (1024, 1 << 20), dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        segment_checksum(x)
        y.copy_(x)
    torch.cuda.synchronize()
    res = {}
    for name, fn in [("checksum", lambda: segment_checksum(x)), ("copy", lambda: y.copy_(x))]:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            fn()
        e.record()
        torch.cuda.synchronize()
        sec = s.elapsed_time(e) / 1e3 / 10
        res[name + "_GBps"] = round(x.numel() / sec / 1e9, 1)
        res[name + "_ms_per_GiB"] = round(sec * 1e3, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/checksum")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
           "agree": agree(), "cost": cost()}
    flat = [v for v in res["agree"].values() if isinstance(v, bool)] + \
           [b for d in res["agree"].values() if isinstance(d, dict) for b in d.values()]
    res["all_agree"] = all(flat)
    print(json.dumps(res, indent=1))
    with open(os.path.join(a.out, "checksum_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
