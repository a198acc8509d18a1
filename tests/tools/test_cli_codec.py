"""`tutti verify` and `tutti inspect` on a namespace written with a codec (tutti.codec): checksums
cover the raw segments, so verify decodes the stored bytes with the codec of the namespace's name
(given with --codec, or registered in this process) before it checks them; without one it says
so and checks nothing there, never reporting a segment corrupt it could not read."""

from __future__ import annotations

import json

import pytest

from tutti import codec as codec_mod
from tutti.tools import cli

from tests.codec_example import HEADER, ZlibCodec
from tests.test_codec import L, ZLIB, geometry, make_caches, store

CODED = geometry().with_codec(ZlibCodec())


@pytest.fixture
def coded_root(tmp_path):
    """Three chunks stored through the real worker with the framed-zlib example codec."""
    rep = store(tmp_path, make_caches(0), [(3, [0, 1]), (7, [4, 5]), (8, [10, 11])])
    assert sorted(rep.stored) == [1, 2, 3]
    return tmp_path


def run_cli(capsys, *argv):
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def slab_of(root):
    return next(root.rglob("slab-*.bin"))


def test_verify_decodes_with_the_codec_given(coded_root, capsys):
    rc, out, err = run_cli(capsys, "verify", "--no-progress", "--codec", ZLIB, str(coded_root))
    assert rc == 0, out + err
    assert out.startswith(f"OK: {3 * L} segments in 3 chunks of 1 namespace(s)")


def test_without_the_codec_verify_says_so_and_reports_nothing_corrupt(coded_root, capsys, monkeypatch):
    # a process whose registry names no codec (another test file of this worker may have registered one)
    monkeypatch.setattr(codec_mod._REGISTRY, "registered", {})
    rc, out, err = run_cli(capsys, "verify", "--no-progress", str(coded_root))
    assert rc == 2, out + err  # incomplete: not checked, not corrupt
    assert "FAILED" not in out and "bad segment" not in out and "mismatch" not in out
    assert out.startswith("INCOMPLETE: 0 segments in 0 chunks")
    assert "written with codec 'zlib1': pass --codec package.module:attr" in err


def test_a_codec_registered_in_the_process_is_found_by_its_name(coded_root, monkeypatch):
    from tutti.tools.storetools import verify_store

    monkeypatch.setitem(codec_mod._REGISTRY.registered, "zlib-for-verify", ZlibCodec)  # named otherwise: by .name
    res = verify_store([str(coded_root)], progress=False)
    assert res.segments == 3 * L and not res.mismatches and not res.errors


def test_another_codec_of_the_same_name_but_another_stride_is_not_used(coded_root, capsys, monkeypatch):
    class Wider(ZlibCodec):  # the same name, a different framing: a stride of its own
        def max_encoded_bytes(self, nbytes):
            return 4 * nbytes

    monkeypatch.setattr("tests.codec_example.Wider", Wider, raising=False)
    rc, out, err = run_cli(capsys, "verify", "--no-progress", "--codec", "tests.codec_example:Wider", str(coded_root))
    assert rc == 2 and "FAILED" not in out and "at a stride of 8192 B" in err, out + err


def test_verify_with_the_codec_finds_a_damaged_stored_segment(coded_root, capsys):
    path = slab_of(coded_root)
    at = 7 * CODED.slot_bytes + 1 * CODED.stored_segment_bytes  # slot 7, layer 1: inside its zlib stream
    data = bytearray(path.read_bytes())
    data[at + HEADER + 10] ^= 0xFF
    # slot 3, layer 0: a valid stream of other raw bytes (zeros), which decodes but mismatches
    stride, other = CODED.stored_segment_bytes, bytearray(CODED.stored_segment_bytes)
    ZlibCodec().encode(memoryview(bytearray(CODED.segment_bytes)), memoryview(other)[:ZlibCodec().max_encoded_bytes(
        CODED.segment_bytes)])
    data[3 * CODED.slot_bytes:3 * CODED.slot_bytes + stride] = other
    path.write_bytes(bytes(data))
    rc, out, err = run_cli(capsys, "verify", "--no-progress", "--codec", ZLIB, str(coded_root))
    assert rc == 1, out + err
    assert "FAILED: 2 bad segment(s) in 3 chunk(s)" in out
    assert "slot 7 layer 1: does not decode with codec 'zlib1'" in out
    assert "slot 3 layer 0: checksum mismatch" in out
    assert "slot 8" not in out and "slot 3 layer 1" not in out


def test_an_unknown_codec_given_is_a_usage_error(coded_root, capsys):
    rc, _, err = run_cli(capsys, "verify", "--no-progress", "--codec", "no_such_module_x:Codec", str(coded_root))
    assert rc == 2 and "--codec 'no_such_module_x:Codec'" in err


def test_inspect_names_the_codec(coded_root, capsys):
    rc, out, _ = run_cli(capsys, "inspect", str(coded_root))
    assert rc == 0 and "codec zlib1" in out
    rc, out, _ = run_cli(capsys, "inspect", "--json", str(coded_root))
    (ns,) = json.loads(out)
    assert rc == 0 and ns["codec"] == "zlib1" and ns["chunks"] == 3
    assert ns["fingerprint"]["segment_bytes"] == CODED.stored_segment_bytes
