"""What a chunk is, for one rank: the geometry that goes into a namespace's fingerprint.

Its own module because both halves of the engine and the vLLM boundary (tutti.vllm.compat,
which derives it from vLLM's config) need it, and none of them should import the builders for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tutti.engine.keys import namespace_seed
from tutti.format import FORMAT_VERSION, segment_bytes as _segment_bytes, slot_bytes as _slot_bytes


@dataclass(frozen=True)
class Geometry:
    """What a chunk is, for one rank: everything that goes into the namespace fingerprint."""

    model: str
    cache_dtype: str
    chunk_tokens: int
    block_size: int  # the scheduler's (manager) block size
    num_layers: int
    num_heads: int  # H: KV head slots on this rank (1 for MLA)
    content_bytes: int  # C: bytes per (head, token)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # MLA: the latent cache is the same on every TP rank, so it is stored once (by TP rank 0,
    # in TP rank 0's namespace) and every TP rank reads it from there.
    kv_replicated: bool = False
    model_id: str = ""  # identity of the weights and model config behind `model` (see identity.model_identity)
    integrity: str = ""  # "" (checksums) or the keyed tag's name: a store with a secret is its own namespace
    # Hybrid models: each layer's KV cache group as "<group>:<kind>" ("full", "sw<window>", "state"), in
    # layer order, joined by ","; "" for one group. A chunk holds every layer's segment either
    # way; the groups say which block list each layer's blocks come from, and are part of the
    # namespace.
    groups: str = ""
    # How a segment's bytes are stored (tutti.codec): "identity" (as they are) or a codec's name, part
    # of the namespace when not "identity"; `stored_segment`: a layer's stride in a slot under it
    # (0: segment_bytes). Set together by with_codec.
    codec: str = "identity"
    stored_segment: int = 0

    def _layer_groups(self) -> list[tuple[int, str]]:
        """(group, kind) of each layer, in layer order; [] for one group."""
        return [(int(g), kind) for g, kind in (item.split(":", 1) for item in self.groups.split(","))] \
            if self.groups else []

    @property
    def group_of_layer(self) -> list[int] | None:
        return [g for g, _ in self._layer_groups()] or None

    @property
    def kind_of_layer(self) -> list[str]:
        """Each layer's group kind ("full", "sw<window>", "state"); [] for one group."""
        return [kind for _, kind in self._layer_groups()]

    @property
    def state_groups(self) -> list[int]:
        """Groups of state-space layers (kind "state"): Mamba / linear-attention states."""
        return sorted({g for g, kind in self._layer_groups() if kind == "state"})

    @property
    def store_tp_rank(self) -> int:
        """The TP rank whose namespace holds this rank's chunks."""
        return 0 if self.kv_replicated else self.tp_rank

    @property
    def writes(self) -> bool:
        """Whether this rank stores chunks (and so owns, and locks, its namespace)."""
        return self.store_tp_rank == self.tp_rank

    @property
    def num_writers(self) -> int:
        """Ranks that must commit a chunk before it is resident."""
        return self.pp_size if self.kv_replicated else self.num_workers

    @property
    def store_ranks(self) -> list[tuple[int, int, int]]:
        """(tp_rank, pp_rank, global rank) of every rank that owns a namespace."""
        tps = [0] if self.kv_replicated else range(self.tp_size)
        return [(tp, pp, pp * self.tp_size + tp) for pp in range(self.pp_size) for tp in tps]

    @property
    def segment_bytes(self) -> int:
        return _segment_bytes(self.chunk_tokens, self.num_heads * self.content_bytes)

    @property
    def stored_segment_bytes(self) -> int:
        """A layer's stride in a chunk's slot: the segment, or what the codec may encode it into."""
        return self.stored_segment or self.segment_bytes

    @property
    def slot_bytes(self) -> int:
        """A chunk's slot in the store (every layer's stored segment)."""
        return _slot_bytes(self.num_layers, self.stored_segment_bytes)

    @property
    def chunk_bytes(self) -> int:
        """A chunk's raw segments, every layer (a store's staging region): slot_bytes without a codec."""
        return _slot_bytes(self.num_layers, self.segment_bytes)

    def with_codec(self, codec) -> "Geometry":
        """This geometry with its segments stored through `codec` (tutti.codec): unchanged for
        "identity"; else its name joins the fingerprint and a layer's stride becomes the codec's
        max_encoded_bytes(segment_bytes), 4 KiB aligned (derived once, here)."""
        from tutti.codec import encoded_stride, is_identity

        if is_identity(codec):
            if self.codec != "identity":
                raise ValueError(f"codec: this geometry's segments are stored with {self.codec!r}, not 'identity'")
            return self
        stride = encoded_stride(codec, self.segment_bytes)
        if self.codec == codec.name and self.stored_segment == stride:
            return self
        return Geometry(**{**vars(self), "codec": codec.name, "stored_segment": stride})

    @property
    def num_workers(self) -> int:
        return self.tp_size * self.pp_size

    def for_rank(self, tp_rank: int, pp_rank: int = 0) -> "Geometry":
        return Geometry(**{**vars(self), "tp_rank": tp_rank, "pp_rank": pp_rank})

    def fingerprint(self):
        from tutti.store.fingerprint import Fingerprint, codec_extra
        return Fingerprint(
            model=self.model, cache_dtype=self.cache_dtype, format_version=FORMAT_VERSION,
            chunk_tokens=self.chunk_tokens, num_layers=self.num_layers, num_heads=self.num_heads,
            content_bytes=self.content_bytes, segment_bytes=self.stored_segment_bytes,
            tp_rank=self.store_tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size,
            extra=self._extra() + codec_extra(self.codec),
        )

    def _extra(self) -> tuple[tuple[str, str], ...]:
        # Not the segment format, but what the KV values were computed with: the attention
        # kernels accumulate per block, so KV computed at block size 32 differs (in the last
        # bits) from KV computed at 64, and a checkpoint replaced under the same path changes it
        # entirely. Either would make a hit differ from recompute.
        from tutti.engine.keys import KEY_VERSION

        # key version: a store whose keys were derived otherwise (v1: token ids only) is a
        # different namespace, left on disk for `tutti inspect`, never served under new rules
        out = [("block_size", str(self.block_size)), ("key_version", str(KEY_VERSION))]
        if self.model_id:
            out.append(("model_id", self.model_id))
        if self.integrity:
            out.append(("integrity", self.integrity))
        if self.groups:
            out.append(("groups", self.groups))
        return tuple(out)

    def seed(self) -> bytes:
        """Key seed: shared by all ranks (a chunk's key does not depend on the rank), nor on the
        codec (what a chunk holds is the same KV; the fingerprint keeps the encodings apart)."""
        return namespace_seed(self.model, self.cache_dtype, FORMAT_VERSION, self.chunk_tokens,
                              self.num_layers * self.pp_size, self.tp_size, self.pp_size, self._extra())
