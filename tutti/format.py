"""The segment format of docs/format.md, in one place.

A chunk of `T` tokens is stored as one segment per layer: the tokens' KV in canonical
[token, head, content] order (`token_bytes` = heads x content bytes per token), zero-padded to a
multiple of 4 KiB so every segment can be moved with direct IO. A chunk's slot in a slab holds
its layers' segments back to back; checksums (and keyed tags) cover a whole padded segment.
Everything that sizes, offsets or pads segments asks this module.
"""

from __future__ import annotations

FORMAT_VERSION = 2  # the segment packing and its checksum (2: mixed sums); part of every namespace's fingerprint
SEGMENT_ALIGN = 4096  # bytes: direct IO moves whole 4 KiB blocks


def align_up(nbytes: int, to: int = SEGMENT_ALIGN) -> int:
    """`nbytes` rounded up to a multiple of `to` (4 KiB: the segment alignment)."""
    return -(-nbytes // to) * to


def segment_bytes(tokens: int, token_bytes: int) -> int:
    """Bytes of one layer's segment of `tokens` tokens, padding included."""
    return align_up(tokens * token_bytes)


def slot_bytes(num_layers: int, segment: int) -> int:
    """Bytes of one chunk's slot: its layers' segments back to back."""
    return num_layers * segment


def segment_offset(layer: int, segment: int) -> int:
    """Where layer `layer`'s segment starts inside a chunk's slot."""
    return layer * segment


def token_span(first_token: int, last_token: int, token_bytes: int) -> tuple[int, int]:
    """The byte range [start, end) of tokens [first_token, last_token) inside a segment."""
    return first_token * token_bytes, last_token * token_bytes
