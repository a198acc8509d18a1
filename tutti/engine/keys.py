"""Chunk keys: a hash chained over each chunk's token ids and identity, seeded by the namespace.

A hit must mean what vLLM's prefix cache means, so a chunk's key covers everything vLLM puts in
a block hash: the token ids, and per block the extra keys (LoRA adapter, multimodal inputs and
their offsets, cache salt, prompt-embedding hashes), handed in as bytes by whoever knows them
(`identity`). Equal prefixes with equal identities give equal keys in every process and across
restarts, so we own the hash (blake2b) rather than rely on Python's `hash` or a per-process seed.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Any, Callable, Sequence

KEY_BYTES = 32
# Version of the key derivation: 2 added each chunk's identity (extra keys) to the chain.
KEY_VERSION = 2

# identity(start, end) -> bytes: what besides the token ids tokens [start, end) were computed with
Identity = Callable[[int, int], bytes]


class UnkeyableError(ValueError):
    """A request's identity holds something tutti cannot encode stably: it is neither stored
    nor served."""


def namespace_seed(*parts: object) -> bytes:
    """A seed that makes keys of different namespaces (model, dtype, format...) never collide."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tutti-ns")
    for part in parts:
        h.update(repr(part).encode())
        h.update(b"\x00")
    return h.digest()


def canonical(obj: Any) -> bytes:
    """A stable, unambiguous encoding of str/bytes/int/float/bool/None and tuples or lists of
    them (the values vLLM's extra keys hold); anything else raises UnkeyableError."""
    out = bytearray()

    def enc(o: Any) -> None:
        if o is None:
            out.extend(b"N")
        elif isinstance(o, bool):
            out.extend(b"T" if o else b"F")
        elif isinstance(o, int):
            b = str(o).encode()
            out.extend(b"i" + struct.pack("<I", len(b)) + b)
        elif isinstance(o, float):
            out.extend(b"f" + struct.pack("<d", o))
        elif isinstance(o, str):
            b = o.encode("utf-8", "surrogatepass")
            out.extend(b"s" + struct.pack("<I", len(b)) + b)
        elif isinstance(o, (bytes, bytearray, memoryview)):
            b = bytes(o)
            out.extend(b"b" + struct.pack("<I", len(b)) + b)
        elif isinstance(o, (tuple, list)):
            out.extend(b"l" + struct.pack("<I", len(o)))
            for x in o:
                enc(x)
        else:
            raise UnkeyableError(f"cannot key a chunk on a {type(o).__name__} ({o!r:.80})")

    enc(obj)
    return bytes(out)


def chunk_keys(token_ids: Sequence[int], chunk_tokens: int, seed: bytes, start: int = 0,
               parent: bytes | None = None, identity: Identity | None = None) -> list[bytes]:
    """Keys of the full chunks of `token_ids`: key[i] = H(key[i-1] || tokens of chunk i ||
    identity of chunk i).

    `start`/`parent` continue an existing chain (chunk index `start` with `parent` = key of
    chunk start-1), so a growing request hashes only its new chunks. `identity` may raise
    UnkeyableError.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens={chunk_tokens}: expected a positive token count")
    keys: list[bytes] = []
    prev = seed if parent is None else parent
    n_full = len(token_ids) // chunk_tokens
    for c in range(start, n_full):
        lo, hi = c * chunk_tokens, (c + 1) * chunk_tokens
        toks = array("q", token_ids[lo:hi])
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"tutti-ck")
        h.update(prev)
        h.update(toks.tobytes())
        extra = identity(lo, hi) if identity is not None else b""
        h.update(struct.pack("<Q", len(extra)))
        h.update(extra)
        prev = h.digest()
        keys.append(prev)
    return keys


def state_key(chunk_key: bytes) -> bytes:
    """The key of the state-space (Mamba / linear-attention) state taken at the END of the chunk
    `chunk_key`: a state is valid only at the token where it was taken, so it is its own entry,
    present only where a step ended exactly on that chunk boundary. Derived from the chunk's
    key, so it inherits everything the chunk's identity holds (tokens, salt, LoRA, images)."""
    return hashlib.blake2b(chunk_key, digest_size=len(chunk_key), person=b"tutti-state").digest()
