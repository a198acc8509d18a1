"""Conformance suite for gather/scatter variants, public so a new kernel can prove itself.

Every case builds real caches in one of vLLM's layouts (from shapes and strides, as vLLM
hands them over), fills them with random bytes and checks the variant byte for byte
against the torch reference AND against an independent "logical" view computed with plain
permutes, so a bug shared by the reference and the layout description is caught too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from . import reference
from .layout import PagedLayout
from .registry import KernelVariant, get_variant

DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": getattr(torch, "float8_e4m3fn", torch.uint8),
}

KINDS = (
    "nhd",  # per-layer (B, H, N, 2D) view, NHD memory order
    "hnd",  # per-layer (B, H, N, 2D), HND memory order (also the CPU backend)
    "shared_int8",  # [B, H, N, C] int8 views into one buffer, layer outermost
    "shared_int8_block_outer",  # same, all layers of one block adjacent, NHD inside
    "shared_int8_scales",  # block-outermost int8 views with 2 inline scale bytes per token-head
    "shared_int8_odd",  # ... with 1 odd byte: forces 1-byte words
    "mla3",  # (B, N, W)
    "mla4",  # (B, 1, N, W)
    "kv_outer",  # (2, B, N, H, D)
    "kv_inner",  # (B, 2, N, H, D)
    "cross_layer_block_outer",  # single tensor (B, L, N, H, 2D)
    "cross_layer_layer_outer",  # single tensor (L, B, H, N, 2D)
)


@dataclass
class CacheCase:
    """Caches in one layout plus an independent byte view ``logical()``: uint8 (L, B, N, H, C)."""

    kind: str
    caches: list
    layout: PagedLayout
    roles: tuple
    logical: Callable[[], torch.Tensor]


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype != torch.uint8 else x


def _random(shape, dtype, gen: torch.Generator, device) -> torch.Tensor:
    es = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * es), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device) if es > 1 or dtype != torch.uint8 else raw.to(device)


def make_case(
    kind: str,
    dtype: torch.dtype,
    block_size: int,
    *,
    num_blocks: int = 8,
    num_heads: int = 2,
    head_size: int = 8,
    num_layers: int = 2,
    seed: int = 0,
    device="cpu",
) -> CacheCase:
    """Build ``num_layers`` layers of random KV in layout ``kind`` (see KINDS)."""
    g = torch.Generator().manual_seed(seed)
    B, N, H, D, L = num_blocks, block_size, num_heads, head_size, num_layers
    es = torch.empty(0, dtype=dtype).element_size()
    if kind == "nhd":
        allocs = [_random((B, N, H, 2 * D), dtype, g, device) for _ in range(L)]
        caches = [a.permute(0, 2, 1, 3) for a in allocs]
        roles = ("block", "head", "token", "dim")
        logical = lambda: torch.stack([_bytes(a) for a in allocs])
    elif kind == "hnd":
        allocs = [_random((B, H, N, 2 * D), dtype, g, device) for _ in range(L)]
        caches = allocs
        roles = ("block", "head", "token", "dim")
        logical = lambda: torch.stack([_bytes(a).permute(0, 2, 1, 3) for a in allocs])
    elif kind.startswith("shared_int8"):
        extra = {"shared_int8_scales": 2, "shared_int8_odd": 1}.get(kind, 0)
        C = 2 * D * es + extra
        roles = ("block", "head", "token", "dim")
        if kind == "shared_int8":
            buf = _random((L, B, H, N, C), torch.int8, g, device)
            caches = [buf[l] for l in range(L)]
            logical = lambda: _bytes(buf).permute(0, 1, 3, 2, 4)
        else:
            buf = _random((B, L, N, H, C), torch.int8, g, device)
            caches = [buf[:, l].permute(0, 2, 1, 3) for l in range(L)]
            logical = lambda: _bytes(buf).permute(1, 0, 2, 3, 4)
    elif kind in ("mla3", "mla4"):
        W = 2 * D + D // 4  # latent + rope, like 512 + 64
        if kind == "mla3":
            allocs = [_random((B, N, W), dtype, g, device) for _ in range(L)]
            roles = ("block", "token", "dim")
            logical = lambda: torch.stack([_bytes(a).unsqueeze(2) for a in allocs])
        else:
            allocs = [_random((B, 1, N, W), dtype, g, device) for _ in range(L)]
            roles = ("block", "head", "token", "dim")
            logical = lambda: torch.stack([_bytes(a).permute(0, 2, 1, 3) for a in allocs])
        caches = allocs
    elif kind == "kv_outer":
        allocs = [_random((2, B, N, H, D), dtype, g, device) for _ in range(L)]
        caches = allocs
        roles = ("kv", "block", "token", "head", "dim")
        logical = lambda: torch.stack([torch.cat([_bytes(a[0]), _bytes(a[1])], -1) for a in allocs])
    elif kind == "kv_inner":
        allocs = [_random((B, 2, N, H, D), dtype, g, device) for _ in range(L)]
        caches = allocs
        roles = ("block", "kv", "token", "head", "dim")
        logical = lambda: torch.stack([torch.cat([_bytes(a[:, 0]), _bytes(a[:, 1])], -1) for a in allocs])
    elif kind == "cross_layer_block_outer":
        a = _random((B, L, N, H, 2 * D), dtype, g, device)
        caches = [a]
        roles = ("block", "layer", "token", "head", "dim")
        logical = lambda: _bytes(a).permute(1, 0, 2, 3, 4)
    elif kind == "cross_layer_layer_outer":
        a = _random((L, B, H, N, 2 * D), dtype, g, device)
        caches = [a]
        roles = ("layer", "block", "head", "token", "dim")
        logical = lambda: _bytes(a).permute(0, 1, 3, 2, 4)
    else:
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}")
    layout = PagedLayout.from_tensor(caches[0], roles)
    return CacheCase(kind, caches, layout, roles, logical)


def layers_of(case: CacheCase) -> int:
    return len(case.caches) * case.layout.num_layers


def expected_segments(case: CacheCase, block_ids: torch.Tensor, k: int, seg_bytes: int) -> torch.Tensor:
    """Segments computed from ``logical()`` alone: the format's definition, independent of PagedLayout."""
    ids = block_ids.to(torch.int64).cpu()
    kb = (ids.unsqueeze(-1) * k + torch.arange(k)).reshape(ids.shape[0], -1)
    lg = case.logical().cpu()
    L, n = lg.shape[0], ids.shape[0]
    data = lg[:, kb].reshape(L, n, -1)
    out = torch.zeros((L, n, seg_bytes), dtype=torch.uint8)
    out[:, :, : data.shape[2]] = data
    return out


def storage_bytes(case: CacheCase) -> list[torch.Tensor]:
    """Snapshot of every distinct storage the caches live in."""
    seen, snaps = set(), []
    for c in case.caches:
        st = c.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            snaps.append(torch.empty(0, dtype=torch.uint8, device=c.device).set_(st).clone().cpu())
    return snaps


def describe_mismatch(got: torch.Tensor, want: torch.Tensor, layout: Optional[PagedLayout] = None, what: str = "segment") -> str:
    """Locate the first differing byte, in (layer, chunk, token, head, byte) when a layout is known."""
    got, want = got.cpu(), want.cpu()
    diff = (got != want).nonzero()
    if diff.numel() == 0:
        return "no mismatch"
    idx = tuple(int(i) for i in diff[0])
    msg = f"{what} differs at index {idx} ({int((got != want).sum())} bytes differ): got {int(got[idx])}, want {int(want[idx])}"
    if layout is not None and len(idx) == 3:
        off = idx[2]
        tb, c = layout.token_bytes, layout.content_bytes
        msg += f" = layer {idx[0]}, chunk {idx[1]}, token {off // tb}, head {off % tb // c}, content byte {off % c}"
    return msg


@dataclass
class ConformanceReport:
    variant: str
    device: str
    cases: list = field(default_factory=list)

    @property
    def num_cases(self) -> int:
        return len(self.cases)


def _pick_ids(num_manager: int, n: int, m: int, gen: torch.Generator, exclude=()) -> torch.Tensor:
    pool = [i for i in torch.randperm(num_manager, generator=gen).tolist() if i not in set(exclude)]
    return torch.tensor(pool[: n * m], dtype=torch.int64).reshape(n, m)


def run_case(
    variant: Union[str, KernelVariant],
    kind: str,
    dtype_name: str,
    block_size: int,
    *,
    k: int = 1,
    device="cpu",
    num_chunks: int = 2,
    blocks_per_chunk: int = 2,
    ids_dtype: torch.dtype = torch.int64,
    extra_bytes: int = 0,
) -> str:
    """Gather then scatter into other blocks with ``variant``; every byte checked. Returns the case name."""
    v = get_variant(variant)
    dtype = DTYPES[dtype_name]
    name = f"{kind}/{dtype_name}/bs{block_size}/k{k}"
    num_blocks = (2 * num_chunks * blocks_per_chunk + 1) * k
    case = make_case(kind, dtype, block_size, num_blocks=num_blocks, device=device)
    g = torch.Generator().manual_seed(block_size * 7 + k)
    ids = _pick_ids(num_blocks // k, num_chunks, blocks_per_chunk, g)
    T = blocks_per_chunk * k * case.layout.block_size
    S = case.layout.segment_bytes(T) + extra_bytes
    L = layers_of(case)
    want = expected_segments(case, ids, k, S)
    ids_d = ids.to(device=device, dtype=ids_dtype)

    out_ref = torch.full((L, num_chunks, S), 0xAB, dtype=torch.uint8, device=device)
    reference.gather(case.caches, case.layout, ids_d, out_ref, kernel_blocks_per_block=k)
    if not torch.equal(out_ref.cpu(), want):
        raise AssertionError(f"{name}: torch reference gather is wrong: " + describe_mismatch(out_ref, want, case.layout))
    out = torch.full((L, num_chunks, S), 0xAB, dtype=torch.uint8, device=device)
    v.gather(case.caches, case.layout, ids_d, out, kernel_blocks_per_block=k)
    if not torch.equal(out.cpu(), want):
        raise AssertionError(f"{name}: variant {v.name!r} gather: " + describe_mismatch(out, want, case.layout))

    # scatter into other blocks of an identical copy; compare whole storages with the reference
    other = _pick_ids(num_blocks // k, num_chunks, blocks_per_chunk, g, exclude=ids.reshape(-1).tolist())
    other_d = other.to(device=device, dtype=ids_dtype)
    dst_ref = make_case(kind, dtype, block_size, num_blocks=num_blocks, device=device)
    dst = make_case(kind, dtype, block_size, num_blocks=num_blocks, device=device)
    reference.scatter(dst_ref.caches, dst_ref.layout, other_d, want.to(device), kernel_blocks_per_block=k)
    v.scatter(dst.caches, dst.layout, other_d, out, kernel_blocks_per_block=k)
    for i, (a, b) in enumerate(zip(storage_bytes(dst), storage_bytes(dst_ref))):
        if not torch.equal(a, b):
            raise AssertionError(f"{name}: variant {v.name!r} scatter: " + describe_mismatch(a, b, what=f"cache storage {i}"))
    back = torch.empty_like(out)
    reference.gather(dst.caches, dst.layout, other_d, back, kernel_blocks_per_block=k)
    if not torch.equal(back.cpu(), want):
        raise AssertionError(f"{name}: variant {v.name!r} scatter did not round-trip: " + describe_mismatch(back, want, dst.layout))
    return name


CROSS_PAIRS = (
    ("hnd", "kv_outer"),
    ("nhd", "cross_layer_block_outer"),
    ("shared_int8_block_outer", "kv_inner"),
    ("kv_inner", "cross_layer_layer_outer"),
    ("mla3", "mla4"),
)


def run_cross_case(variant, src_kind: str, dst_kind: str, dtype_name: str, *, device="cpu") -> str:
    """Gather in ``src_kind`` with block size 16, scatter into ``dst_kind`` with block size 32, byte-exact."""
    v = get_variant(variant)
    dtype = DTYPES[dtype_name]
    name = f"cross {src_kind}/bs16 -> {dst_kind}/bs32/{dtype_name}"
    a = make_case(src_kind, dtype, 16, num_blocks=8, device=device, seed=1)
    b = make_case(dst_kind, dtype, 32, num_blocks=5, device=device, seed=2)
    if a.layout.token_bytes != b.layout.token_bytes or layers_of(a) != layers_of(b):
        raise ValueError(f"{name}: layouts hold different tokens ({a.layout} vs {b.layout})")
    ids_a = torch.tensor([[5, 2], [0, 7]], device=device)  # 2 chunks of 32 tokens
    ids_b = torch.tensor([[3], [1]], device=device)
    S = a.layout.segment_bytes(32)
    seg = torch.empty((layers_of(a), 2, S), dtype=torch.uint8, device=device)
    v.gather(a.caches, a.layout, ids_a, seg)
    v.scatter(b.caches, b.layout, ids_b, seg)
    # token-level check: logical bytes of the chunk's tokens in both layouts
    la, lb = a.logical().cpu(), b.logical().cpu()
    for n in range(2):
        ta = la[:, ids_a[n].cpu()].reshape(la.shape[0], 32, -1)
        tb = lb[:, int(ids_b[n])].reshape(lb.shape[0], 32, -1)
        if not torch.equal(ta, tb):
            raise AssertionError(f"{name}: chunk {n} tokens differ after the move: " + describe_mismatch(tb, ta, what="tokens"))
    back = torch.empty_like(seg)
    v.gather(b.caches, b.layout, ids_b, back)
    if not torch.equal(back.cpu(), seg.cpu()):
        raise AssertionError(f"{name}: segments differ after the cross-layout move: " + describe_mismatch(back, seg, b.layout))
    return name


def check_variant(variant: Union[str, KernelVariant], *, device="cpu", quick: bool = False) -> ConformanceReport:
    """Run the layout x dtype x block-size suite (+ manager blocks spanning kernel blocks and
    cross-layout moves) against the torch reference; AssertionError names the first mismatch."""
    v = get_variant(variant)
    report = ConformanceReport(v.name, str(device))
    dtypes = ("fp16", "fp8") if quick else tuple(DTYPES)
    sizes = (16,) if quick else (16, 32)
    for kind in KINDS:
        for dt in dtypes:
            for bs in sizes:
                report.cases.append(run_case(v, kind, dt, bs, device=device))
        report.cases.append(run_case(v, kind, "bf16", 16, k=2, device=device, ids_dtype=torch.int32, extra_bytes=4096))
    for src, dst in CROSS_PAIRS[:2] if quick else CROSS_PAIRS:
        report.cases.append(run_cross_case(v, src, dst, "bf16", device=device))
    return report
