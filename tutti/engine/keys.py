"""Chunk keys: a hash chained over each chunk's token ids, seeded by the namespace.

Equal prefixes give equal keys in every process and across restarts, so we own the hash
(blake2b) rather than rely on Python's `hash` or vLLM's per-process seed.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

KEY_BYTES = 32


def namespace_seed(*parts: object) -> bytes:
    """A seed that makes keys of different namespaces (model, dtype, format...) never collide."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tutti-ns")
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.digest()


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, seed: bytes, start: int = 0,
               parent: bytes | None = None) -> list[bytes]:
    """Keys of the full chunks of `token_ids`: key[i] = H(key[i-1] || tokens of chunk i).

    `start`/`parent` continue an existing chain (chunk index `start` with `parent` = key of
    chunk start-1), so a growing request hashes only its new chunks.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: expected a positive token count")
    keys: list[bytes] = []
    prev = seed if parent is None else parent
    n_full = len(token_ids) // chunk_tokens
    for c in range(start, n_full):
        toks = array("q", token_ids[c * chunk_tokens:(c + 1) * chunk_tokens])
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tutti-ck")
        h.update(prev)
        h.update(toks.tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys
