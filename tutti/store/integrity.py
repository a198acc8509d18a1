"""Keyed integrity: with a secret, every stored segment carries a MAC instead of a checksum.

Why: the per-segment checksum (docs/format.md) catches torn writes and bit rot, but it is
unkeyed: anyone who can write a store file can forge data that passes it, and anyone who can
compute a chunk's key (public facts: model, token ids) can file chunks under it. With a
secret (a file only the server can read, or an environment variable; never logged, never in
a manifest), chunk keys are seeded by it and each segment's journaled value is a keyed
BLAKE2b tag over (chunk key, layer, bytes), checked on the host before the segment is copied
to the GPU. Without a secret the store trusts everyone who can write it, which by default
(private modes, files of other users refused) is only the user running the server.
"""

from __future__ import annotations

import hashlib
import os
import stat

MIN_SECRET_BYTES = 16

#: The unkeyed tag of a whole offloaded chunk (TuttiTier, whose chunks live in host memory, not
#: on the GPU where the segment checksum is computed): named in the namespace's fingerprint.
CRC_TAG = "crc32+adler32"


def crc_tag(data) -> int:
    """CRC-32 and Adler-32 of `data` side by side (64 bits). Guards against accidents (torn
    writes, flipped bits, a stale client cache), not forgery; zlib releases the GIL, so tier
    threads check in parallel at several GB/s per core."""
    import zlib

    return zlib.crc32(data) | zlib.adler32(data) << 32


class SecretError(ValueError):
    """A secret that is missing, too short, or readable by others."""


def load_secret(*, file: str | None = None, env: str | None = None) -> bytes | None:
    """The secret from a file (ours, a regular file, no group/world access) or an environment
    variable; None when neither is configured. Errors name the source, never the value."""
    if file and env:
        raise SecretError("kv_connector_extra_config: set secret_file or secret_env, not both")
    if env:
        raw = os.environ.get(env)
        if raw is None:
            raise SecretError(f"kv_connector_extra_config.secret_env={env!r}: the variable is not set; export it "
                              "in the server's environment (at least 16 bytes)")
        data = raw.encode()
        where = f"environment variable {env!r}"
    elif file:
        path = os.path.expanduser(file)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise SecretError(f"kv_connector_extra_config.secret_file={file!r}: cannot open it ({exc.strerror}); "
                              "it must be a regular file readable by the server, not a link") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise SecretError(f"kv_connector_extra_config.secret_file={file!r}: must be a regular file owned by "
                                  f"uid {os.geteuid()} with no group or world access (chmod 600); it is mode "
                                  f"{stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}")
            data = os.read(fd, 4096).strip()
        finally:
            os.close(fd)
        where = f"secret_file {file!r}"
    else:
        return None
    if len(data) < MIN_SECRET_BYTES:
        raise SecretError(f"kv_connector_extra_config: the secret in {where} has {len(data)} bytes; use at least "
                          f"{MIN_SECRET_BYTES} random bytes (e.g. `head -c 32 /dev/urandom | base64`)")
    return data


class SegmentMac:
    """tag(chunk key, layer, bytes) -> unsigned 64-bit keyed BLAKE2b, and the keyed key seed.

    A tag also binds a context, the namespace digest of the reader it is right for (`bound`):
    the digest names the rank (TP and PP), the geometry and the model, and not the writer, so
    every writer of a namespace produces tags its readers check, while a segment copied from
    another rank's namespace (another rank's heads or layers) fails its tag. Unbound tags (an
    empty context) are for callers with one namespace per process (the tier binds its own)."""

    name = "blake2b-mac-64-bound"  # was blake2b-mac-64 (tags without a context): another namespace

    def __init__(self, secret: bytes, context: bytes = b"") -> None:
        self._key = hashlib.blake2b(secret, digest_size=32, person=b"tutti-mackey").digest()
        self._seed_key = hashlib.blake2b(secret, digest_size=32, person=b"tutti-seedkey").digest()
        self._context = bytes(context)

    def bound(self, context: bytes | str) -> "SegmentMac":
        """This tagger, with tags bound to `context` (a namespace digest)."""
        out = object.__new__(SegmentMac)
        out._key, out._seed_key = self._key, self._seed_key
        out._context = context.encode() if isinstance(context, str) else bytes(context)
        return out

    def seed(self, seed: bytes) -> bytes:
        """A chunk-key seed nobody without the secret can compute (keys are unguessable)."""
        return hashlib.blake2b(seed, digest_size=len(seed), key=self._seed_key, person=b"tutti-seed").digest()

    def tag(self, key: bytes, layer: int, data) -> int:
        h = hashlib.blake2b(digest_size=8, key=self._key, person=b"tutti-seg")
        h.update(len(self._context).to_bytes(2, "little"))
        h.update(self._context)
        h.update(key)
        h.update(layer.to_bytes(4, "little"))
        h.update(data)  # hashlib releases the GIL for large buffers
        return int.from_bytes(h.digest(), "little")
