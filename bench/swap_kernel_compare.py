"""tutti's gather/scatter against vLLM's own Triton swap kernel, on the layouts both handle.

vLLM 0.33 and 0.34 ship ``vllm/v1/kv_offload/cpu/swap_blocks_triton.py`` (the same file in both):
``_swap_blocks_kernel`` copies a batch of (source address, destination address, size) descriptors,
8-byte words at a time, 12 programs (``NUM_SMS``) looping over the descriptors; ``swap_blocks_batch``
launches it, with the descriptors copied to the GPU on every call, and sends batches of fewer than
16 descriptors (``MIN_N``) to vLLM's DMA op (``cuMemcpyBatchAsync``). vLLM's offloading worker
(``cpu/gpu_worker.py``) chooses it only for CPU->GPU loads from pinned memory whose pages are all
under 28 KiB (``THRESHOLD_BYTES``) and multiples of 8 bytes; stores and larger pages go to DMA.
One descriptor is one page: one block of one layer, copied whole between the GPU cache and a CPU
tensor of (CPU blocks, blocks_per_chunk x page bytes) per layer.

tutti gathers a chunk's blocks of every layer into a packed segment (L, N, S) in its canonical
token-major order and scatters it back. Where one block of one layer is ONE contiguous run in that
order (K|V adjacent per head, heads adjacent per token, tokens adjacent: NHD blocks with K and V
packed, MLA latents, block-outer shared and cross-layer buffers), a chunk's segment is its blocks'
pages end to end, i.e. exactly vLLM's CPU row of that chunk: both kernels then move the same bytes
between the same places, and this compares them. Layouts whose block is several runs (K and V
apart, head-major HND) are listed with the reason: vLLM copies such a page as the GPU holds it,
tutti's segment reorders it, so the bytes differ by design.

Correctness (any machine; CPU through TRITON_INTERPRET=1): per layout, the segments vLLM's kernel
writes (descriptors: page of block b of layer l -> its place in the segment) are compared byte for
byte with tutti's Triton gather, the torch reference and the segments computed from the layout's
logical view alone (tutti.kernels.conformance); the caches vLLM's kernel scatters into are compared
whole (every block, moved or not) with tutti's scatter and the reference; a negative control (two
blocks of a chunk exchanged in vLLM's descriptors) must be told apart. vLLM's module is loaded from
the extracted site by file path; its two imports (``vllm._custom_ops``, ``vllm.triton_utils``) are
answered by stand-ins (Triton itself; the DMA op where this machine's vLLM has one), so nothing
else of vLLM is imported. On the CPU ``swap_blocks_batch`` itself cannot run (it moves its
descriptors to "cuda"): its launch, ``_swap_blocks_kernel[(min(NUM_SMS, n),)](..., BYTES_PER_CHUNK=
min(next_power_of_2(page), 8192))``, is made directly, as gpu_worker's choice would make it.

Speed (CUDA only, compiled, ``triton.testing.do_bench``): per layout and number of blocks moved,
GB/s of bytes moved (each byte once; NOT kernels.md's read + write):
- device<->device: tutti's gather / scatter (default launch, and capped to 12 programs like vLLM)
  against vLLM's kernel over the same descriptors, already on the GPU;
- host->device, vLLM's load path: ``swap_blocks_batch`` as vLLM calls it (pinned host rows, pinned
  descriptors copied per call), tutti's load path (pinned host segments copied to the GPU, then
  scatter), and vLLM's DMA op where the installed vLLM has it;
- device->host: tutti's gather then a copy to pinned memory, vLLM's DMA op, and vLLM's kernel
  writing pinned memory (which vLLM itself never chooses).

    TRITON_INTERPRET=1 python3 bench/swap_kernel_compare.py --out /tmp/swap_cpu.json   # correctness
    python3 bench/swap_kernel_compare.py --out /tmp/swap_kernel_h200.json              # CUDA: + GB/s

vLLM's code is found under --site, else TUTTI_VLLM034_SITE / TUTTI_VLLM033_SITE, else where
scripts/check_vllm_033.sh [0.34.0] extracts it (~/.cache/tutti/vllm-VERSION/site).
"""

from __future__ import annotations

import argparse
import builtins
import hashlib
import importlib.util
import json
import os
import platform
import sys
import time
import types
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tutti.kernels import PagedLayout, check_args, get_variant  # noqa: E402
from tutti.kernels import reference  # noqa: E402
from tutti.kernels.conformance import DTYPES, KINDS, expected_segments, layers_of, make_case, storage_bytes  # noqa: E402

KERNEL_FILE = os.path.join("vllm", "v1", "kv_offload", "cpu", "swap_blocks_triton.py")
VERSIONS = ("0.33.0", "0.34.0")
SENTINEL = 0xA5
INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---------------------------------------------------------------------------------------------
# vLLM's kernel, loaded by file path


def site_for(version: str) -> Optional[str]:
    """The extracted site of `version` holding the swap kernel, where scripts/check_vllm_033.sh
    puts it (or the TUTTI_VLLM0XX_SITE that .ci/run exports); None when it is not here."""
    tag = "".join(version.split(".")[:2])  # 0.34.0 -> 034
    cands = [os.environ.get(f"TUTTI_VLLM{tag}_SITE")]
    if version == "0.33.0" and os.environ.get("VLLM033_DIR"):
        cands.append(os.path.join(os.environ["VLLM033_DIR"], "site"))
    if os.environ.get("VLLM_SITE_DIR"):
        cands.append(os.path.join(os.environ["VLLM_SITE_DIR"], "site"))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    cands.append(os.path.join(cache, "tutti", f"vllm-{version}", "site"))
    for c in cands:
        if c and os.path.isfile(os.path.join(c, KERNEL_FILE)):
            return c
    return None


def _dma_op():
    """vLLM's C++ swap_blocks_batch (cuMemcpyBatchAsync) where the installed vLLM has it, else the reason."""
    if not torch.cuda.is_available():
        return None, "no CUDA"
    try:
        import vllm._C  # noqa: F401  - registers torch.ops._C_cache_ops
    except Exception as exc:  # noqa: BLE001
        return None, f"the installed vLLM's _C does not load: {type(exc).__name__}: {exc}"[:200]
    ns = getattr(torch.ops, "_C_cache_ops", None)
    op = getattr(ns, "swap_blocks_batch", None) if ns is not None else None
    if op is None:
        return None, "the installed vLLM has no _C_cache_ops.swap_blocks_batch (added after 0.26)"
    return op, ""


class _Ops:
    """Stand-in for ``vllm._custom_ops``: swap_blocks_batch (batches under MIN_N) goes to vLLM's
    DMA op when this machine's vLLM has one, else says so."""

    def __init__(self):
        self._op, self._why = None, "not looked up"
        self._looked = False

    def swap_blocks_batch(self, src, dst, sizes, is_src_access_order_any=False):
        if not self._looked:
            self._op, self._why = _dma_op()
            self._looked = True
        if self._op is None:
            raise RuntimeError(f"vLLM's DMA swap_blocks_batch is not available here: {self._why}")
        try:
            self._op(src, dst, sizes, is_src_access_order_any)
        except RuntimeError:
            self._op(src, dst, sizes)


def load_vllm_swap(site: str) -> types.ModuleType:
    """vLLM's swap_blocks_triton.py from `site`, executed with its imports of vllm answered by
    stand-ins: the module sees Triton and a DMA stand-in, and no other vLLM module is imported."""
    import triton
    import triton.language as tl

    path = os.path.join(site, KERNEL_FILE)
    stand_ins = {"vllm._custom_ops": _Ops(), "vllm.triton_utils": types.SimpleNamespace(tl=tl, triton=triton)}
    real_import = builtins.__import__

    def _import(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "vllm" and fromlist and set(fromlist) <= {"_custom_ops"}:
            return types.SimpleNamespace(_custom_ops=stand_ins["vllm._custom_ops"])
        if name in stand_ins:
            return stand_ins[name]
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"{path} imports {name}: no stand-in for it (this bench loads the kernel alone)")
        return real_import(name, globals, locals, fromlist, level)

    spec = importlib.util.spec_from_file_location("tutti_bench_vllm_swap_blocks_triton", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__["__builtins__"] = dict(builtins.__dict__, __import__=_import)
    spec.loader.exec_module(mod)
    with open(path, "rb") as f:
        mod.SHA256 = hashlib.sha256(f.read()).hexdigest()
    return mod


def vllm_choice(mod, page: int, n: int) -> str:
    """What vLLM's offloading worker would run for a CPU->GPU load of `n` pages of `page` bytes
    from pinned memory (gpu_worker._select_swap_blocks_fn, then swap_blocks_batch's MIN_N)."""
    if page >= mod.THRESHOLD_BYTES or page % 8:
        return f"DMA (page {page} B: Triton only below {mod.THRESHOLD_BYTES} B, multiples of 8)"
    if n < mod.MIN_N:
        return f"DMA ({n} descriptors: Triton from {mod.MIN_N})"
    return f"triton ({bytes_per_chunk(page)}-byte chunks, {min(mod.NUM_SMS, n)} programs)"


def bytes_per_chunk(page: int) -> int:
    import triton

    return min(triton.next_power_of_2(page), 8192)


def vllm_kernel(mod, src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, page: int) -> None:
    """swap_blocks_batch's launch, descriptors where they are (CPU under the interpreter, GPU compiled)."""
    n = src.numel()
    mod._swap_blocks_kernel[(min(mod.NUM_SMS, n),)](src, dst, sizes, n, BYTES_PER_CHUNK=bytes_per_chunk(page))


# ---------------------------------------------------------------------------------------------
# layouts both handle


def page_of(layout: PagedLayout) -> tuple[Optional[int], str]:
    """Bytes of one block of one layer when they are ONE run in the segment's token-major order
    (then a chunk's segment is its blocks' pages end to end), else None and why not."""
    run = layout.piece_bytes
    if layout.num_pieces == 2:
        if layout.stride_piece != run:
            return None, ("K and V apart: a block is two runs, which vLLM copies as they are (K, then V); "
                          "tutti's segment holds K|V per token and head")
        run *= 2
    if layout.num_heads > 1:
        if layout.stride_head != run:
            return None, "head-major block (HND): vLLM copies it as it is; tutti's segment is token-major"
        run *= layout.num_heads
    if layout.block_size > 1:
        if layout.stride_token != run:
            return None, "a block's tokens are not adjacent: vLLM copies the block as it is; tutti's segment is token-major"
        run *= layout.block_size
    return run, ""


def descriptors(layer_addrs, layout: PagedLayout, page: int, ids: torch.Tensor, seg: torch.Tensor, to_seg: bool):
    """vLLM's descriptors for the move tutti's gather (to_seg) or scatter makes: page of block
    ids[n, j] of layer l <-> bytes j*page.. of segment (l, n), layer by layer as gpu_worker orders them."""
    ids = ids.to("cpu", torch.int64)
    n, m = ids.shape
    base = torch.tensor(layer_addrs, dtype=torch.int64)[:, None, None]
    blocks = base + ids[None] * layout.stride_block  # (L, N, M)
    l = torch.arange(len(layer_addrs), dtype=torch.int64)[:, None, None]
    slots = (seg.data_ptr() + l * seg.stride(0) + torch.arange(n)[None, :, None] * seg.stride(1)
             + torch.arange(m)[None, None, :] * page)
    src, dst = (blocks, slots) if to_seg else (slots, blocks)
    src, dst = src.reshape(-1).contiguous(), dst.reshape(-1).contiguous()
    return src, dst, torch.full_like(src, page)


# ---------------------------------------------------------------------------------------------
# correctness


def check_case(mod, kind: str, dtype_name: str, *, device: str, num_chunks: int = 4, blocks_per_chunk: int = 4,
               num_heads: int = 2, head_size: int = 8, num_layers: int = 2, label: Optional[str] = None) -> dict:
    """Gather and scatter by vLLM's kernel, tutti's Triton kernel and the torch reference, compared byte for byte."""
    dtype = DTYPES[dtype_name]
    nb = 2 * num_chunks * blocks_per_chunk + 1
    kw = dict(num_blocks=nb, num_heads=num_heads, head_size=head_size, num_layers=num_layers, device=device)
    case = make_case(kind, dtype, 16, seed=3, **kw)
    page, why = page_of(case.layout)
    row = {"layout": label or kind, "kind": kind, "dtype": dtype_name, "heads": num_heads, "head_size": head_size,
           "page_bytes": page, "layers": layers_of(case), "chunks": num_chunks, "blocks_per_chunk": blocks_per_chunk}
    if page is None:
        return dict(row, both=False, why=why)
    L = layers_of(case)
    n_desc = L * num_chunks * blocks_per_chunk
    row.update(descriptors=n_desc, vllm_would_run=vllm_choice(mod, page, n_desc))
    if page % 8:
        return dict(row, both=False, why=f"page of {page} bytes: vLLM's kernel moves 8-byte words (its worker sends this to DMA)")
    g = torch.Generator().manual_seed(11)
    perm = torch.randperm(nb, generator=g)
    ids = perm[: num_chunks * blocks_per_chunk].reshape(num_chunks, blocks_per_chunk).to(device)
    T = blocks_per_chunk * case.layout.block_size
    S = case.layout.segment_bytes(T)
    d = T * case.layout.token_bytes
    triton_v = get_variant("triton")
    t0 = time.perf_counter()

    # gather: caches -> segments
    want = expected_segments(case, ids, 1, S)  # from the layout's logical view alone
    plan = check_args(case.caches, case.layout, ids, torch.empty((L, num_chunks, S), dtype=torch.uint8, device=device), 1, "out")
    seg_v = torch.full((L, num_chunks, S), SENTINEL, dtype=torch.uint8, device=device)
    src, dst, sizes = descriptors(plan.layer_addrs, case.layout, page, ids, seg_v, True)
    vllm_kernel(mod, src.to(device), dst.to(device), sizes.to(device), page)
    seg_t = torch.full_like(seg_v, SENTINEL)
    triton_v.gather(case.caches, case.layout, ids, seg_t)
    seg_r = torch.full_like(seg_v, SENTINEL)
    reference.gather(case.caches, case.layout, ids, seg_r)
    seg_v, seg_t, seg_r = seg_v.cpu(), seg_t.cpu(), seg_r.cpu()
    row["gather_equal"] = bool(torch.equal(seg_v[:, :, :d], seg_t[:, :, :d]) and torch.equal(seg_v[:, :, :d], seg_r[:, :, :d])
                               and torch.equal(seg_v[:, :, :d], want[:, :, :d]))
    # vLLM writes only its descriptors' bytes; tutti's gather also zeroes the padding up to 4 KiB
    row["padding_bytes"] = S - d
    row["vllm_left_padding"] = bool((seg_v[:, :, d:] == SENTINEL).all())
    row["tutti_zeroed_padding"] = bool((seg_t[:, :, d:] == 0).all())

    # negative control: two blocks of the first chunk exchanged in vLLM's descriptors
    swapped = ids.clone().cpu()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    seg_c = torch.full((L, num_chunks, S), SENTINEL, dtype=torch.uint8, device=device)
    src, dst, sizes = descriptors(plan.layer_addrs, case.layout, page, swapped, seg_c, True)
    vllm_kernel(mod, src.to(device), dst.to(device), sizes.to(device), page)
    row["control_detected"] = not torch.equal(seg_c.cpu()[:, :, :d], seg_t[:, :, :d])

    # scatter: segments -> other blocks of identical caches; whole storages compared
    other = perm[num_chunks * blocks_per_chunk: 2 * num_chunks * blocks_per_chunk].reshape(num_chunks, blocks_per_chunk).to(device)
    before = storage_bytes(make_case(kind, dtype, 16, seed=3, **kw))
    src_seg = want.to(device)
    dsts = {}
    for who in ("vllm", "tutti", "reference"):
        c = make_case(kind, dtype, 16, seed=3, **kw)
        if who == "vllm":
            p = check_args(c.caches, c.layout, other, src_seg, 1, "src")
            s, dd, z = descriptors(p.layer_addrs, c.layout, page, other, src_seg, False)
            vllm_kernel(mod, s.to(device), dd.to(device), z.to(device), page)
        elif who == "tutti":
            triton_v.scatter(c.caches, c.layout, other, src_seg)
        else:
            reference.scatter(c.caches, c.layout, other, src_seg)
        dsts[who] = storage_bytes(c)
    row["scatter_equal"] = all(torch.equal(a, b) and torch.equal(a, r) for a, b, r in
                               zip(dsts["vllm"], dsts["tutti"], dsts["reference"]))
    row["scatter_changed_cache"] = any(not torch.equal(a, b) for a, b in zip(dsts["vllm"], before))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    row["both"] = True
    row["ok"] = row["gather_equal"] and row["scatter_equal"] and row["control_detected"] and row["vllm_left_padding"] \
        and row["tutti_zeroed_padding"] and row["scatter_changed_cache"]
    return row


def check_h2d(mod, kind: str = "nhd", dtype_name: str = "bf16") -> dict:
    """CUDA only: vLLM's own swap_blocks_batch from pinned host rows, as its worker loads, against
    tutti's load path (copy to the GPU, scatter); whole cache storages compared."""
    num_chunks, bpc = 4, 8
    nb = 2 * num_chunks * bpc + 1
    kw = dict(num_blocks=nb, num_heads=2, head_size=64, num_layers=4, device="cuda")
    ca = make_case(kind, DTYPES[dtype_name], 16, seed=5, **kw)
    page, _ = page_of(ca.layout)
    ids = torch.randperm(nb)[: num_chunks * bpc].reshape(num_chunks, bpc)
    L = layers_of(ca)
    S = ca.layout.segment_bytes(bpc * 16)
    host = torch.randint(0, 256, (L, num_chunks, S), dtype=torch.uint8).pin_memory()
    p = check_args(ca.caches, ca.layout, ids.cuda(), host.cuda(), 1, "src")
    s, d, z = descriptors(p.layer_addrs, ca.layout, page, ids, host, False)
    s, d, z = s.pin_memory(), d.pin_memory(), z.pin_memory()
    mod.swap_blocks_batch(s, d, z, True, bytes_per_chunk=bytes_per_chunk(page))
    cb = make_case(kind, DTYPES[dtype_name], 16, seed=5, **kw)
    get_variant("triton").scatter(cb.caches, cb.layout, ids.cuda(), host.cuda())
    torch.cuda.synchronize()
    equal = all(torch.equal(a, b) for a, b in zip(storage_bytes(ca), storage_bytes(cb)))
    return {"kind": kind, "dtype": dtype_name, "page_bytes": page, "descriptors": s.numel(),
            "vllm_would_run": vllm_choice(mod, page, s.numel()), "h2d_equal": equal, "ok": equal}


# ---------------------------------------------------------------------------------------------
# speed (CUDA)

GPU_CASES = {  # name: (conformance kind, dtype, KV heads per GPU, head size); block 16
    "nhd_h1d128_bf16": ("nhd", "bf16", 1, 128),  # 8 KiB pages (8 KV heads over TP 8)
    "nhd_h2d128_bf16": ("nhd", "bf16", 2, 128),  # 16 KiB
    "mla_576_bf16": ("mla3", "bf16", 1, 256),  # 512 + 64 latent: 18 KiB
    "nhd_h8d128_bf16": ("nhd", "bf16", 8, 128),  # 64 KiB: vLLM's worker sends this to DMA
}


def _bench(fn) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100) / 1e3


def time_case(mod, name: str, layers: int, moved: int, bpc: int) -> list[dict]:
    kind, dt, heads, hs = GPU_CASES[name]
    total = 2 * moved + 1
    case = make_case(kind, DTYPES[dt], 16, num_blocks=total, num_heads=heads, head_size=hs, num_layers=layers,
                     device="cuda", seed=0)
    page, _ = page_of(case.layout)
    L = layers_of(case)
    ids_h = torch.randperm(total)[:moved].reshape(-1, bpc)
    ids = ids_h.cuda()
    n = ids.shape[0]
    S = case.layout.segment_bytes(bpc * 16)
    seg = torch.empty((L, n, S), dtype=torch.uint8, device="cuda")
    host = torch.empty((L, n, S), dtype=torch.uint8).pin_memory()
    kv = L * moved * page
    rng = (0, total - 1)
    plan = check_args(case.caches, case.layout, ids, seg, 1, "out")
    tri = get_variant("triton")
    rows = []

    def row(direction, impl, fn, note=""):
        r = {"case": name, "layers": L, "moved_blocks": moved, "page_bytes": page, "bytes": kv,
             "direction": direction, "impl": impl, "note": note}
        try:
            s = _bench(fn)
            r.update(seconds=s, GBps=round(kv / s / 1e9, 2))
        except Exception as exc:  # noqa: BLE001 - a path this machine lacks is a row too
            r.update(error=f"{type(exc).__name__}: {exc}"[:200])
        rows.append(r)

    g_src, g_dst, g_sz = (t.cuda() for t in descriptors(plan.layer_addrs, case.layout, page, ids_h, seg, True))
    s_src, s_dst, s_sz = (t.cuda() for t in descriptors(plan.layer_addrs, case.layout, page, ids_h, seg, False))
    row("d2d gather", "tutti triton", lambda: tri.gather(case.caches, case.layout, ids, seg, id_range=rng))
    row("d2d gather", "tutti triton, 12 programs",
        lambda: tri.gather(case.caches, case.layout, ids, seg, id_range=rng, max_programs=mod.NUM_SMS))
    row("d2d gather", "vllm triton kernel", lambda: vllm_kernel(mod, g_src, g_dst, g_sz, page), "descriptors on the GPU")
    row("d2d scatter", "tutti triton", lambda: tri.scatter(case.caches, case.layout, ids, seg, id_range=rng))
    row("d2d scatter", "tutti triton, 12 programs",
        lambda: tri.scatter(case.caches, case.layout, ids, seg, id_range=rng, max_programs=mod.NUM_SMS))
    row("d2d scatter", "vllm triton kernel", lambda: vllm_kernel(mod, s_src, s_dst, s_sz, page), "descriptors on the GPU")

    h_src, h_dst, h_sz = (t.pin_memory() for t in descriptors(plan.layer_addrs, case.layout, page, ids_h, host, False))
    choice = vllm_choice(mod, page, h_src.numel())
    row("h2d load", "vllm swap_blocks_batch", lambda: mod.swap_blocks_batch(
        h_src, h_dst, h_sz, True, bytes_per_chunk=bytes_per_chunk(page)),
        "as vLLM calls it (pinned descriptors copied per call); vLLM's worker would run: " + choice)
    row("h2d load", "vllm DMA", lambda: mod.ops.swap_blocks_batch(h_src, h_dst, h_sz, True), "cuMemcpyBatchAsync")
    row("h2d load", "tutti copy + scatter", lambda: (seg.copy_(host, non_blocking=True),
                                                      tri.scatter(case.caches, case.layout, ids, seg, id_range=rng)))
    d_src, d_dst, d_sz = (t.pin_memory() for t in descriptors(plan.layer_addrs, case.layout, page, ids_h, host, True))
    d_src_g, d_dst_g, d_sz_g = d_src.cuda(), d_dst.cuda(), d_sz.cuda()
    row("d2h store", "vllm DMA", lambda: mod.ops.swap_blocks_batch(d_src, d_dst, d_sz, False), "what vLLM runs for stores")
    row("d2h store", "tutti gather + copy", lambda: (tri.gather(case.caches, case.layout, ids, seg, id_range=rng),
                                                      host.copy_(seg, non_blocking=True)))
    row("d2h store", "vllm triton kernel", lambda: vllm_kernel(mod, d_src_g, d_dst_g, d_sz_g, page),
        "writes pinned memory; vLLM never chooses it for stores")
    return rows


# ---------------------------------------------------------------------------------------------


def print_checks(version: str, rows: list[dict]) -> None:
    print(f"\nvLLM {version}: correctness (byte for byte against tutti's Triton kernels and the torch reference)")
    print(f"  {'layout':26s} {'dtype':5s} {'page B':>7s} {'desc':>5s} {'gather':>6s} {'scatter':>7s} {'control':>7s} {'s':>6s}  vLLM's worker would run")
    for r in rows:
        if not r["both"]:
            print(f"  {r['layout']:26s} {r['dtype']:5s} {'-' if r['page_bytes'] is None else r['page_bytes']:>7}  not compared: {r['why']}")
            continue
        ok = lambda b: "same" if b else "DIFF"  # noqa: E731
        print(f"  {r['layout']:26s} {r['dtype']:5s} {r['page_bytes']:>7d} {r['descriptors']:>5d} {ok(r['gather_equal']):>6s} "
              f"{ok(r['scatter_equal']):>7s} {'caught' if r['control_detected'] else 'MISSED':>7s} {r['seconds']:>6.2f}  {r['vllm_would_run']}")


def print_speed(rows: list[dict]) -> None:
    print("\nGB/s (bytes moved, each once; triton.testing.do_bench)")
    print(f"  {'case':18s} {'blocks':>6s} {'direction':12s} {'impl':28s} {'GB/s':>8s}")
    for r in rows:
        g = f"{r['GBps']:8.2f}" if "GBps" in r else "       -"
        print(f"  {r['case']:18s} {r['moved_blocks']:>6d} {r['direction']:12s} {r['impl']:28s} {g}  {r.get('error', '')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", action="append", default=None, help="an extracted vLLM site (repeatable); "
                    "default: 0.33.0's and 0.34.0's where found")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--kinds", default=",".join(KINDS), help="conformance layouts to check (tutti.kernels.conformance.KINDS)")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--page-cases", default=",".join(GPU_CASES), help="also checked: these timing layouts' real "
                    "page sizes (8-64 KiB: vLLM's kernel loops over 8 KiB chunks), 2 layers, 8 blocks")
    ap.add_argument("--no-speed", action="store_true", help="CUDA: correctness only")
    ap.add_argument("--cases", default=",".join(GPU_CASES), help="CUDA timing layouts")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--moved", default="16,64,256,1024", help="blocks moved per layer, per timing (multiples of --bpc)")
    ap.add_argument("--bpc", type=int, default=16, help="blocks per chunk (16 x 16 tokens = 256)")
    a = ap.parse_args(argv)

    sites = [(None, s) for s in a.site] if a.site else [(v, site_for(v)) for v in VERSIONS]
    sites = [(v, s) for v, s in sites if s]
    if not sites:
        print("no extracted vLLM site holds " + KERNEL_FILE + ": run bash scripts/check_vllm_033.sh [0.34.0]", file=sys.stderr)
        return 2
    if any(int(x) % a.bpc for x in a.moved.split(",")):
        ap.error(f"--moved {a.moved}: expected multiples of --bpc {a.bpc}")
    cuda = torch.cuda.is_available() and not INTERP
    device = "cuda" if cuda else "cpu"
    if device == "cpu" and not INTERP:
        print("no CUDA: set TRITON_INTERPRET=1 to run the kernels through Triton's interpreter", file=sys.stderr)
        return 2
    out = {"command": ("TRITON_INTERPRET=1 " if INTERP else "") + "python3 bench/swap_kernel_compare.py "
           + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()}), "
                     "Triton interpreter", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "sites": {}}
    import triton

    out["triton"] = triton.__version__
    ok = True
    for version, site in sites:
        mod = load_vllm_swap(site)
        version = version or _version_of(site)
        entry = {"site": site, "kernel_sha256": mod.SHA256, "NUM_SMS": mod.NUM_SMS,
                 "THRESHOLD_BYTES": mod.THRESHOLD_BYTES, "MIN_N": mod.MIN_N,
                 "vllm_imported": any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "checks": []}
        for kind in filter(None, a.kinds.split(",")):
            for dt in a.dtypes.split(","):
                entry["checks"].append(check_case(mod, kind, dt, device=device))
        for name in filter(None, a.page_cases.split(",")):  # pages of real models: several chunks per descriptor
            kind, dt, heads, hs = GPU_CASES[name]
            entry["checks"].append(check_case(mod, kind, dt, device=device, num_chunks=2, num_heads=heads,
                                              head_size=hs, label=name))
        if cuda:
            entry["h2d_check"] = check_h2d(mod)
            ok &= entry["h2d_check"]["ok"]
        ok &= all(r["ok"] for r in entry["checks"] if r["both"]) and any(r["both"] for r in entry["checks"])
        print_checks(version, entry["checks"])
        out["sites"][version] = entry
    shas = {e["kernel_sha256"] for e in out["sites"].values()}
    out["same_kernel_file"] = len(shas) == 1
    if cuda and not a.no_speed:
        mod = load_vllm_swap(sites[-1][1])
        rows = []
        for name in a.cases.split(","):
            for moved in (int(x) for x in a.moved.split(",")):
                rows += time_case(mod, name, a.layers, moved, a.bpc)
                torch.cuda.empty_cache()
        out["speed"] = rows
        out["speed_site"] = sites[-1][1]
        print_speed(rows)
    else:
        out["speed"] = None
        out["speed_note"] = "not measured: no CUDA device" if not torch.cuda.is_available() else \
            "not measured: TRITON_INTERPRET=1 (kernels interpreted)" if INTERP else "not measured: --no-speed"
        print("\nspeed: " + out["speed_note"])
    out["ok"] = ok
    print("\ncorrectness:", "every compared layout moves the same bytes" if ok else "MISMATCH (see above)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


def _version_of(site: str) -> str:
    import glob

    infos = glob.glob(os.path.join(site, "vllm-*.dist-info"))
    return os.path.basename(infos[0])[5:-10] if infos else site


if __name__ == "__main__":
    sys.exit(main())
