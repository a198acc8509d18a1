"""The secret behind keyed integrity: where it may come from, and what its tags bind."""

from __future__ import annotations

import os

import pytest

from tutti.store.integrity import SecretError, SegmentMac, load_secret

SECRET = "correct horse battery staple"


def test_secret_sources_and_refusals(tmp_path, monkeypatch):
    assert load_secret() is None
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    os.chmod(f, 0o600)
    assert load_secret(file=str(f)) == SECRET.encode()
    os.chmod(f, 0o640)
    with pytest.raises(SecretError, match="no group or world access") as info:
        load_secret(file=str(f))
    assert SECRET not in str(info.value)  # errors name the source, never the value
    os.chmod(f, 0o600)
    os.symlink(f, tmp_path / "link")
    with pytest.raises(SecretError, match="not a link"):
        load_secret(file=str(tmp_path / "link"))
    monkeypatch.setenv("T_SECRET", "short")
    with pytest.raises(SecretError, match="at least 16"):
        load_secret(env="T_SECRET")
    with pytest.raises(SecretError, match="not set"):
        load_secret(env="T_SECRET_MISSING")
    with pytest.raises(SecretError, match="not both"):
        load_secret(file=str(f), env="T_SECRET")


def test_tags_bind_secret_chunk_layer_and_bytes():
    a, b = SegmentMac(b"x" * 32), SegmentMac(b"y" * 32)
    data = bytes(range(256)) * 16
    t = a.tag(b"k" * 32, 3, data)
    assert t == a.tag(b"k" * 32, 3, bytearray(data))
    assert t != b.tag(b"k" * 32, 3, data)  # another secret
    assert t != a.tag(b"q" * 32, 3, data)  # another chunk
    assert t != a.tag(b"k" * 32, 4, data)  # another layer
    assert t != a.tag(b"k" * 32, 3, data[:-1] + b"\x01")  # one byte
    assert a.seed(b"s" * 32) != b.seed(b"s" * 32) != b"s" * 32


def test_a_bound_tag_is_right_for_its_namespace_only():
    mac = SegmentMac(b"k" * 32)
    a, b = mac.bound("namespace-a"), mac.bound("namespace-b")
    data = b"\x01" * 4096
    assert a.tag(b"key", 0, data) == mac.bound(b"namespace-a").tag(b"key", 0, data)
    assert len({a.tag(b"key", 0, data), b.tag(b"key", 0, data), mac.tag(b"key", 0, data)}) == 3
    assert a.seed(b"s" * 32) == mac.seed(b"s" * 32)  # chunk keys do not depend on the rank
