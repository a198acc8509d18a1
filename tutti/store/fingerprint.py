"""What a stored chunk's bytes mean: the key that separates one KV layout from another.

Two processes may only share chunks when every field here agrees: the same model weights,
the same cache dtype, the same token/layer/head geometry and the same slice of the model
(tensor/pipeline rank). The store puts each fingerprint in its own directory, named by
`digest()`, so a chunk written under one layout can never be read back under another.

How a segment's bytes are stored (a codec, tutti.codec) is part of it too: a codec other than
"identity" is the `extra` entry ("codec", its name) and `segment_bytes` is then its stride. Identity
is the entry's absence, so every namespace written before codecs existed keeps its digest.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: Segments are moved with direct IO, so each one must be a whole number of 4 KiB blocks.
from tutti.format import SEGMENT_ALIGN  # noqa: E402

CODEC_KEY = "codec"  # the `extra` entry naming the codec of a namespace's segments
IDENTITY_CODEC = "identity"  # tutti.codec.IDENTITY: never an entry (see codec_extra)

_DTYPE_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_INT_FIELDS = (
    "format_version",
    "chunk_tokens",
    "num_layers",
    "num_heads",
    "content_bytes",
    "segment_bytes",
    "tp_rank",
    "tp_size",
    "pp_rank",
    "pp_size",
)


@dataclass(frozen=True)
class Fingerprint:
    """Everything that decides the meaning of a chunk's bytes on this rank."""

    model: str
    cache_dtype: str  # resolved dtype name: "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", ...
    format_version: int  # the engine's segment packing format
    chunk_tokens: int  # T: tokens per chunk
    num_layers: int  # L: layers held by this rank (one segment each)
    num_heads: int  # H: KV heads on this rank
    content_bytes: int  # C: bytes of one head's K and V for one token (identity: what one row holds)
    # The on-disk stride of a layer: for the engine tutti.format.segment_bytes(T, H x C), the
    # T x H x C meaningful bytes padded to 4 KiB; the store only needs it 4 KiB-aligned and >= C.
    segment_bytes: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    extra: tuple[tuple[str, str], ...] = ()  # anything else that changes the bytes (sorted by key)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError(
                f"Fingerprint.model={self.model!r}: expected a non-empty model name or path"
            )
        if not isinstance(self.cache_dtype, str) or not _DTYPE_RE.match(self.cache_dtype) or self.cache_dtype == "auto":
            raise ValueError(
                f"Fingerprint.cache_dtype={self.cache_dtype!r}: expected a resolved lower-case dtype name "
                "such as 'bfloat16' or 'fp8_e4m3'; resolve 'auto' and strip a 'torch.' prefix first"
            )
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Fingerprint.{name}={value!r}: expected an int")
        for name in ("chunk_tokens", "num_layers", "num_heads", "content_bytes", "segment_bytes", "tp_size", "pp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Fingerprint.{name}={getattr(self, name)}: expected a positive count")
        if self.format_version < 0:
            raise ValueError(f"Fingerprint.format_version={self.format_version}: expected >= 0")
        if self.segment_bytes % SEGMENT_ALIGN:
            raise ValueError(
                f"Fingerprint.segment_bytes={self.segment_bytes}: must be a multiple of {SEGMENT_ALIGN}; "
                f"round content_bytes up to the next {SEGMENT_ALIGN} B"
            )
        if self.content_bytes > self.segment_bytes:
            raise ValueError(
                f"Fingerprint.content_bytes={self.content_bytes}: larger than segment_bytes="
                f"{self.segment_bytes}; segment_bytes must hold the whole content (round it up to 4 KiB)"
            )
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise ValueError(
                    f"Fingerprint.{rank}={getattr(self, rank)}: expected 0 <= {rank} < {size}={getattr(self, size)}"
                )
        object.__setattr__(self, "extra", _normalize_extra(self.extra))
        if dict(self.extra).get(CODEC_KEY) in ("", IDENTITY_CODEC):
            raise ValueError(
                f"Fingerprint.extra: {CODEC_KEY}={dict(self.extra)[CODEC_KEY]!r}: segments stored as they are have "
                f"no {CODEC_KEY!r} entry (so namespaces written before codecs keep their digest); leave it out"
            )

    @property
    def codec(self) -> str:
        """The codec the namespace's segments are stored with ("identity": as they are)."""
        return dict(self.extra).get(CODEC_KEY, IDENTITY_CODEC)

    # -- identity --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["extra"] = [list(pair) for pair in self.extra]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Fingerprint":
        if not isinstance(data, Mapping):
            raise ValueError(f"Fingerprint.from_dict: expected a mapping, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(f"Fingerprint.from_dict: unknown field(s) {unknown}; expected only {names}")
        missing = [n for n in names if n not in data and n != "extra"]
        if missing:
            raise ValueError(f"Fingerprint.from_dict: missing field(s) {missing}")
        kwargs = dict(data)
        kwargs["extra"] = data.get("extra", ())
        return cls(**kwargs)

    def canonical_json(self) -> str:
        """Key-sorted, whitespace-free JSON: the same fingerprint always gives the same text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)

    def digest(self) -> str:
        """First 16 hex digits of sha256(canonical JSON): the namespace's directory name."""
        return hashlib.sha256(self.canonical_json().encode("ascii")).hexdigest()[:16]


def codec_extra(name: str) -> tuple[tuple[str, str], ...]:
    """The `extra` entries naming codec `name`: none for "identity" (every existing namespace keeps
    its fingerprint), ((CODEC_KEY, name),) otherwise (a store written with one codec is never read
    with another)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"codec name {name!r}: expected a non-empty string")
    return () if name == IDENTITY_CODEC else ((CODEC_KEY, name),)


def _normalize_extra(extra: Any) -> tuple[tuple[str, str], ...]:
    # Accept a dict or any iterable of pairs; store a key-sorted tuple so equal content is equal.
    items = extra.items() if isinstance(extra, Mapping) else extra
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        raise ValueError(f"Fingerprint.extra={extra!r}: expected (key, value) string pairs or a dict") from None
    seen: set[str] = set()
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise ValueError(f"Fingerprint.extra: entry {pair!r} is not a (str, str) pair")
        if pair[0] in seen:
            raise ValueError(f"Fingerprint.extra: key {pair[0]!r} appears twice; give each key once")
        seen.add(pair[0])
    return tuple(sorted(pairs))  # type: ignore[arg-type]
