"""How a segment's bytes are stored: the codec seam.

Every kernel gathers and scatters the canonical [tokens, heads, K|V] segment (tutti.format), and
every checksum and keyed tag covers those raw bytes. A codec changes only what lies in the slab:
a store encodes each layer's raw segment on the host (the writer thread, after the gather landed
in host staging) and writes the encoded bytes; a load reads them into host memory and decodes
them back into the staging the load path then copies, verifies and scatters (the thread that
processes the load). A layer's stride in a chunk's slot becomes `max_encoded_bytes(segment)`,
4 KiB aligned (`encoded_stride`; Geometry.with_codec derives it once).

"identity" (the default) stores segments as they are: the data path never calls it, and its
namespaces are those of a store without codecs. Any other codec's name is part of the namespace's
fingerprint (tutti.store.fingerprint), so a store written with one codec is never read with
another: give a changed encoding a new name.

A codec registers a name (`register_codec`) or is named as "package.module:attr" by the `codec`
key (a class, a no-argument factory or an instance). tests/codec_example.py is a worked example
(framed zlib). Loads from mapped slabs copy stored bytes straight to the device, so a codec other
than "identity" turns them off (tutti.engine.config.resolve.mapped_loads).
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from tutti.format import align_up
from tutti.plugins import Registry

IDENTITY = "identity"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")


class SegmentCodec(Protocol):
    """What a codec implements. `src` and `dst` are 1-D writable memoryviews of uint8 host memory
    (format "B"; no copy): `bytes(src)`, `zlib.compress(src)`, `numpy.frombuffer(src, numpy.uint8)`
    or `dst[a:b] = data` all work on them. A codec may be called from several threads at once (the
    writer thread encodes while loading threads decode): keep no per-call state on the object."""

    name: str  # part of the fingerprint of every namespace written with it: a new encoding, a new name

    def max_encoded_bytes(self, nbytes: int) -> int:
        """The most bytes `encode` writes for a segment of `nbytes` (may exceed `nbytes`)."""

    def encode(self, src: memoryview, dst: memoryview) -> int:
        """Encode the raw segment `src` into `dst` (len(dst) == max_encoded_bytes(len(src)));
        returns the bytes used. Decoding them must give back `src` byte for byte (checksums
        cover the raw segment: a lossy codec's loads fail their checksums)."""

    def decode(self, src: memoryview, dst: memoryview) -> None:
        """Fill `dst` (the raw segment, every byte) from the stored bytes `src` (the encoded length
        max_encoded_bytes(len(dst)); the bytes past what encode used are zero). `src` is hostile
        input: raise ValueError when it is malformed, and never write past `dst`, allocate memory
        unbounded by len(dst) or loop unbounded by len(src). A decode error fails that chunk (vLLM
        recomputes it), never the step."""


class IdentityCodec:
    """Segments stored as they are (the default): the data path never calls it."""

    name = IDENTITY

    def max_encoded_bytes(self, nbytes: int) -> int:
        return nbytes

    def encode(self, src: memoryview, dst: memoryview) -> int:
        n = len(src)
        dst[:n] = src
        return n

    def decode(self, src: memoryview, dst: memoryview) -> None:
        if len(src) < len(dst):
            raise ValueError(f"identity: {len(src)} stored bytes for a segment of {len(dst)}")
        dst[:] = src[:len(dst)]


_REGISTRY = Registry("codec", "register_codec", {IDENTITY: IdentityCodec}, ("max_encoded_bytes", "encode", "decode"),
                     doc="tutti.codec.SegmentCodec", noun="codec")
#: (name, class or no-argument factory): choosable as the `codec` key's value
register_codec = _REGISTRY.register
available_codecs = _REGISTRY.names


def get_codec(spec: Any) -> SegmentCodec:
    """The codec `spec` names (a registered name or "package.module:attr"; a codec object passes
    through); ValueError naming the `codec` key otherwise."""
    codec = _REGISTRY.get(spec)
    name = getattr(codec, "name", None)
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"codec={spec!r}: its codec's name is {name!r}; expected 1-64 of A-Z a-z 0-9 . _ + - "
                         "(the name goes into the fingerprint of every namespace written with it)")
    if name == IDENTITY and not isinstance(codec, IdentityCodec):
        raise ValueError(f"codec={spec!r}: its codec calls itself {IDENTITY!r}, the built-in that stores segments "
                         "as they are (a namespace without a codec); give a codec that changes bytes a name of "
                         "its own")
    return codec


def check_codec(spec: Any) -> None:
    """`spec` names a codec (checked before any IO; ValueError naming the key otherwise)."""
    get_codec(spec)


def is_identity(codec: Any) -> bool:
    """Whether `codec` stores segments as they are (the data path then never calls it)."""
    return isinstance(codec, IdentityCodec)


def encoded_stride(codec: SegmentCodec, segment_bytes: int) -> int:
    """A layer's stride in a chunk's slot under `codec`: max_encoded_bytes(segment_bytes) rounded
    up to 4 KiB (direct IO moves whole blocks); `segment_bytes` for "identity"."""
    if is_identity(codec):
        return segment_bytes
    most = codec.max_encoded_bytes(segment_bytes)
    if isinstance(most, bool) or not isinstance(most, int) or not 0 < most < 1 << 40:
        raise ValueError(f"codec={codec.name!r}: max_encoded_bytes({segment_bytes}) returned {most!r}; expected a "
                         "positive int (the most bytes encode writes for one segment)")
    return align_up(most)
