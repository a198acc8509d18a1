"""A lossless segment codec, the worked example of tutti.codec: framed zlib.

A stored segment is a 4-byte little-endian length, then that many bytes of a zlib stream (level 1);
the rest of the stride is zero. It changes both the bytes and their length (a KV segment of
floats barely shrinks; its zero padding does). Decoding treats the stored bytes as hostile: a
length past what was read, a stream that is truncated, corrupt, or inflates to more or fewer
bytes than the segment, raises ValueError; inflating stops at the segment's size (memory bounded
by it) and zlib consumes its input once (time bounded by it).

Named in a config as {"codec": "tests.codec_example:ZlibCodec"}, or registered:
`register_codec("zlib", ZlibCodec)` then {"codec": "zlib"} (in that process only)."""

from __future__ import annotations

import zlib

HEADER = 4


class ZlibCodec:
    name = "zlib1"  # in every namespace written with it: a change to the framing would be "zlib2"

    def max_encoded_bytes(self, nbytes: int) -> int:
        # zlib's compressBound, and the header
        return HEADER + nbytes + (nbytes >> 12) + (nbytes >> 14) + (nbytes >> 25) + 13

    def encode(self, src: memoryview, dst: memoryview) -> int:
        packed = zlib.compress(src, 1)
        end = HEADER + len(packed)
        if end > len(dst):
            raise ValueError(f"zlib1: {len(packed)} B compressed do not fit {len(dst)} B")
        dst[:HEADER] = len(packed).to_bytes(HEADER, "little")
        dst[HEADER:end] = packed
        return end

    def decode(self, src: memoryview, dst: memoryview) -> None:
        if len(src) < HEADER:
            raise ValueError(f"zlib1: {len(src)} B hold no header")
        n = int.from_bytes(src[:HEADER], "little")
        if n > len(src) - HEADER:
            raise ValueError(f"zlib1: the header says {n} B follow; only {len(src) - HEADER} were stored")
        inflate = zlib.decompressobj()
        try:
            # one byte past the segment at most: room enough that a stream of the right size always
            # reaches its end, and a longer one is told apart without inflating any further
            out = inflate.decompress(src[HEADER:HEADER + n], len(dst) + 1)
        except zlib.error as exc:
            raise ValueError(f"zlib1: a corrupt stream ({exc})") from None
        if len(out) > len(dst):
            raise ValueError(f"zlib1: the stream inflates past the segment's {len(dst)} B")
        if not inflate.eof:
            raise ValueError("zlib1: the stream is truncated")
        if len(out) != len(dst):
            raise ValueError(f"zlib1: the stream inflates to {len(out)} B for a segment of {len(dst)} B")
        if inflate.unused_data:
            raise ValueError("zlib1: bytes follow the stream inside its stated length")
        dst[:] = out
