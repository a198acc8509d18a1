"""Byte-level description of one paged KV cache layout.

vLLM hands over KV caches in many physical shapes (NHD/HND, K and V apart or packed,
MLA latents, int8 views into one shared buffer, a cross-layer single tensor). Every one of
them is "pieces of contiguous bytes at strided addresses", so the kernels only ever see this
description and never a shape: the same code moves every layout, and the canonical segment
(docs/format.md) does not depend on which layout produced it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from tutti.format import segment_bytes as _segment_bytes

ROLES = ("block", "token", "head", "kv", "dim", "layer")


@dataclass(frozen=True)
class PagedLayout:
    """Where each byte of (layer, kernel block, token, head, piece) lives, in bytes.

    Byte ``w`` of piece ``p`` of head ``h`` of token ``t`` of kernel block ``b`` of layer ``l`` is at
    ``base(l) + l*stride_layer + b*stride_block + t*stride_token + h*stride_head + p*stride_piece + w``.
    """

    num_blocks: int
    block_size: int
    num_heads: int
    num_pieces: int
    piece_bytes: int
    stride_block: int
    stride_token: int
    stride_head: int
    stride_piece: int
    stride_layer: int = 0
    num_layers: int = 1

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_heads", "num_pieces", "piece_bytes", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"PagedLayout.{name}={v!r}: expected a positive int")
        if self.num_pieces not in (1, 2):
            raise ValueError(f"PagedLayout.num_pieces={self.num_pieces}: expected 1 (K|V adjacent or MLA) or 2 (K and V apart)")
        for name in ("stride_block", "stride_token", "stride_head", "stride_piece", "stride_layer"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"PagedLayout.{name}={v!r}: expected a non-negative int (bytes); negative strides are not supported")

    @property
    def content_bytes(self) -> int:
        """C: bytes per (token, head): K then V, or the MLA latent."""
        return self.num_pieces * self.piece_bytes

    @property
    def token_bytes(self) -> int:
        """H*C: bytes of one token of one layer in a segment."""
        return self.num_heads * self.content_bytes

    def segment_bytes(self, chunk_tokens: int) -> int:
        """Bytes of one canonical segment of ``chunk_tokens`` tokens: T*H*C rounded up to 4 KiB."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: expected a positive int")
        return _segment_bytes(chunk_tokens, self.token_bytes)

    def extent_bytes(self) -> int:
        """One past the last byte this layout touches, relative to the layer's base address."""
        return (
            (self.num_layers - 1) * self.stride_layer
            + (self.num_blocks - 1) * self.stride_block
            + (self.block_size - 1) * self.stride_token
            + (self.num_heads - 1) * self.stride_head
            + (self.num_pieces - 1) * self.stride_piece
            + self.piece_bytes
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor, roles: Sequence[str]) -> "PagedLayout":
        """Describe ``t`` given the role of each of its dims (see ROLES)."""
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"t={type(t).__name__}: expected a torch.Tensor")
        roles = tuple(roles)
        if len(roles) != t.dim():
            raise ValueError(f"roles={roles}: expected one role per dim of the tensor of shape {tuple(t.shape)}")
        for r in roles:
            if r not in ROLES:
                raise ValueError(f"roles={roles}: unknown role {r!r}; expected one of {ROLES}")
        for r in set(roles):
            if roles.count(r) > 1:
                raise ValueError(f"roles={roles}: role {r!r} appears more than once")
        for r in ("block", "token", "dim"):
            if r not in roles:
                raise ValueError(f"roles={roles}: missing role {r!r}")
        es = t.element_size()
        d = roles.index("dim")
        if t.stride(d) != 1 and t.shape[d] > 1:
            raise ValueError(
                f"roles={roles}: the 'dim' axis {d} of shape {tuple(t.shape)} has stride {t.stride(d)}; "
                "expected 1 (the innermost contiguous elements)"
            )
        if any(s < 0 for s in t.stride()):
            raise ValueError(f"tensor strides {t.stride()}: negative strides are not supported")

        def size(r: str, default: int = 1) -> int:
            return t.shape[roles.index(r)] if r in roles else default

        def stride(r: str) -> int:
            if r not in roles or t.shape[roles.index(r)] == 1:
                return 0  # a size-1 dim is never stepped along: its stride is meaningless
            return t.stride(roles.index(r)) * es

        if "kv" in roles and size("kv") != 2:
            raise ValueError(f"roles={roles}: the 'kv' axis of shape {tuple(t.shape)} has size {size('kv')}; expected 2 (K, V)")
        return cls(
            num_blocks=size("block"),
            block_size=size("token"),
            num_heads=size("head"),
            num_pieces=size("kv"),
            piece_bytes=size("dim") * es,
            stride_block=stride("block"),
            stride_token=stride("token"),
            stride_head=stride("head"),
            stride_piece=stride("kv"),
            stride_layer=stride("layer"),
            num_layers=size("layer"),
        )


def infer_roles(
    shape: Sequence[int],
    *,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    num_layers: Optional[int] = None,
    mla: bool = False,
) -> tuple[str, ...]:
    """Name each dim of a KV cache ``shape`` by matching sizes; the last dim is always "dim".

    Raises ValueError when no assignment fits or when two differ on a dim that matters
    (e.g. num_heads == block_size), because guessing there would silently scramble KV.
    ``head_size`` is unused for matching (the last dim may be D, 2D, the MLA width or bytes)
    but kept so callers state what they know.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 3:
        raise ValueError(f"shape={shape}: expected at least (blocks, tokens, dim)")
    sizes = {"block": num_blocks, "token": block_size, "head": num_heads, "kv": 2}
    if num_layers is not None:
        sizes["layer"] = num_layers
    if mla:
        if num_heads != 1:
            raise ValueError(f"num_heads={num_heads} with mla=True: expected 1 (MLA has one latent per token)")
        sizes.pop("kv")
    required = {"block", "token"}
    if num_heads > 1:
        required.add("head")
    if num_layers is not None and num_layers > 1:
        required.add("layer")
    outer = shape[:-1]
    found: list[tuple[str, ...]] = []
    for combo in itertools.product(list(sizes), repeat=len(outer)):
        if len(set(combo)) != len(combo) or not required <= set(combo):
            continue
        if all(sizes[r] == s for r, s in zip(combo, outer)):
            found.append(combo + ("dim",))
    if not found:
        raise ValueError(
            f"shape={shape}: no dim assignment matches num_blocks={num_blocks}, block_size={block_size}, "
            f"num_heads={num_heads}, num_layers={num_layers}, mla={mla}; pass explicit roles to PagedLayout.from_tensor"
        )
    # Assignments that differ only on size-1 dims describe the same bytes: keep the first.
    distinct = {tuple(r for r, s in zip(c, shape) if s != 1) for c in found}
    if len(distinct) > 1:
        raise ValueError(
            f"shape={shape} is ambiguous: it fits roles {sorted(set(found))}; "
            "pass explicit roles to PagedLayout.from_tensor(t, roles)"
        )
    return found[0]
