"""What goes into a namespace's fingerprint and key seed (tutti.engine.build.Geometry)."""

from __future__ import annotations

import dataclasses

from tutti.engine.keys import KEY_VERSION
from tutti.engine.build import Geometry


def geom(**kw) -> Geometry:
    base = dict(model="m", cache_dtype="bfloat16", chunk_tokens=64, block_size=32, num_layers=2, num_heads=2,
                content_bytes=256)
    base.update(kw)
    return Geometry(**base)


def test_key_version_and_integrity_make_their_own_namespace():
    g = geom()
    assert ("key_version", str(KEY_VERSION)) in g.fingerprint().extra
    # a store whose keys were derived the v1 way (token ids only) has another digest: never served now
    old = dataclasses.replace(g.fingerprint(), extra=tuple(e for e in g.fingerprint().extra if e[0] != "key_version"))
    assert old.digest() != g.fingerprint().digest()
    keyed = dataclasses.replace(g, integrity="blake2b-mac-64")
    assert keyed.fingerprint().digest() != g.fingerprint().digest() and keyed.seed() != g.seed()
