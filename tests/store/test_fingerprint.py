"""Fingerprint: stable digests, one namespace per layout, clear errors on bad values."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from tutti.store.fingerprint import Fingerprint

BASE = dict(
    model="meta-llama/Llama-3.1-8B",
    cache_dtype="bfloat16",
    format_version=1,
    chunk_tokens=256,
    num_layers=32,
    num_heads=8,
    content_bytes=256 * 8 * 128 * 2 * 2,
    segment_bytes=256 * 8 * 128 * 2 * 2,
    tp_rank=0,
    tp_size=1,
    pp_rank=0,
    pp_size=1,
)


def make(**over) -> Fingerprint:
    return Fingerprint(**{**BASE, **over})


def test_canonical_json_and_digest_are_pinned():
    # The digest names directories on disk: it must not drift between releases.
    fp = make(extra=(("kv_layout", "NHD"), ("block_size", "16")))
    expected_json = (
        '{"cache_dtype":"bfloat16","chunk_tokens":256,"content_bytes":1048576,'
        '"extra":[["block_size","16"],["kv_layout","NHD"]],"format_version":1,'
        '"model":"meta-llama/Llama-3.1-8B","num_heads":8,"num_layers":32,"pp_rank":0,"pp_size":1,'
        '"segment_bytes":1048576,"tp_rank":0,"tp_size":1}'
    )
    assert fp.canonical_json() == expected_json
    assert fp.digest() == hashlib.sha256(expected_json.encode()).hexdigest()[:16]
    assert len(fp.digest()) == 16 and int(fp.digest(), 16) >= 0


def test_every_field_changes_the_digest():
    base = make()
    changed = dict(
        model="other",
        cache_dtype="fp8_e4m3",
        format_version=2,
        chunk_tokens=128,
        num_layers=16,
        num_heads=4,
        content_bytes=4096,
        segment_bytes=2 * 1048576,
        tp_rank=1,
        tp_size=2,
        pp_rank=1,
        pp_size=2,
        extra=(("k", "v"),),
    )
    digests = {base.digest()}
    for name, value in changed.items():
        over = {name: value}
        if name == "tp_rank":
            over["tp_size"] = 2
        if name == "pp_rank":
            over["pp_size"] = 2
        d = make(**over).digest()
        assert d not in digests, name
        digests.add(d)


def test_extra_order_and_form_do_not_matter():
    a = make(extra={"b": "2", "a": "1"})
    b = make(extra=[("a", "1"), ("b", "2")])
    assert a == b and a.digest() == b.digest()
    assert a.extra == (("a", "1"), ("b", "2"))


def test_dict_round_trip_through_json():
    fp = make(cache_dtype="fp8_e5m2", extra=(("x", "y"),))
    again = Fingerprint.from_dict(json.loads(json.dumps(fp.to_dict())))
    assert again == fp and again.digest() == fp.digest()
    assert dataclasses.asdict(again)["extra"] == (("x", "y"),)


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("model", "", "model"),
        ("cache_dtype", "auto", "cache_dtype"),
        ("cache_dtype", "torch.bfloat16", "torch."),
        ("chunk_tokens", 0, "chunk_tokens"),
        ("num_layers", -1, "num_layers"),
        ("num_heads", 2.0, "num_heads"),
        ("segment_bytes", 1048576 + 512, "multiple of 4096"),
        ("content_bytes", 2 * 1048576, "content_bytes"),
        ("tp_rank", 1, "tp_rank"),
        ("pp_rank", -1, "pp_rank"),
        ("format_version", True, "format_version"),
        ("extra", (("a",),), "extra"),
        ("extra", (("a", "1"), ("a", "2")), "twice"),
    ],
)
def test_bad_values_are_named(field, value, words):
    with pytest.raises(ValueError) as info:
        make(**{field: value})
    assert words in str(info.value)
    assert repr(value) in str(info.value) or str(value) in str(info.value) or field == "extra"


def test_from_dict_rejects_unknown_and_missing_fields():
    d = make().to_dict()
    with pytest.raises(ValueError, match="unknown field"):
        Fingerprint.from_dict({**d, "colour": "red"})
    d.pop("num_heads")
    with pytest.raises(ValueError, match="missing field.*num_heads"):
        Fingerprint.from_dict(d)
