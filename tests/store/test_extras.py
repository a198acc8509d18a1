"""Per-chunk extras beside a writer's journal: appended, followed by readers, compacted, hostile
lines skipped, and opened as store files are."""

import os

from tutti.store.extras import EXTRAS, MAX_LINE, ExtrasReader, ExtrasWriter


def test_a_reader_follows_appends_and_rewrites(tmp_path):
    w = ExtrasWriter(str(tmp_path))
    r = ExtrasReader(str(tmp_path))
    assert list(r.poll()) == []
    assert w.append([(b"\x01" * 16, {"h": [1, 2]}), (b"\x02" * 16, {"h": [3]})]) == 2
    assert list(r.poll()) == [(b"\x01" * 16, {"h": [1, 2]}), (b"\x02" * 16, {"h": [3]})]
    assert list(r.poll()) == []  # nothing new
    w.append([(b"\x03" * 16, {"t": [7]})])
    assert list(r.poll()) == [(b"\x03" * 16, {"t": [7]})]
    w.forget([b"\x01" * 16])
    w.compact()  # rewritten with the live keys: a reader starts over
    assert sorted(k for k, _ in r.poll()) == [b"\x02" * 16, b"\x03" * 16]
    assert w.lookup(b"\x03" * 16) == {"t": [7]} and w.lookup(b"\x01" * 16) is None
    w.close()


def test_a_restart_keeps_the_lines_of_live_chunks_only(tmp_path):
    w = ExtrasWriter(str(tmp_path))
    w.append([(b"a" * 16, {"n": 1}), (b"b" * 16, {"n": 2})])
    w.close()
    w = ExtrasWriter(str(tmp_path), live=[b"b" * 16])
    assert w.lookup(b"b" * 16) == {"n": 2} and w.lookup(b"a" * 16) is None
    assert [k for k, _ in ExtrasReader(str(tmp_path)).poll()] == [b"b" * 16]
    w.close()


def test_hostile_lines_are_skipped_never_raised(tmp_path):
    w = ExtrasWriter(str(tmp_path))
    w.append([(b"k" * 16, {"ok": True})])
    with open(tmp_path / EXTRAS, "ab") as f:
        f.write(b"not json\n{\"k\": 5, \"x\": {}}\n{\"k\": \"zz\", \"x\": {}}\n{\"k\": \"00\", \"x\": []}\n")
        f.write(b"[1,2]\n{\"k\": \"0a\", \"x\": {\"fine\": 1}}\n")
        f.write(b"x" * (MAX_LINE + 10) + b"\n")
        f.write(b"{\"k\": \"0b\", \"x\": {}")  # a line still being written: kept for the next poll
    r = ExtrasReader(str(tmp_path))
    got = list(r.poll())
    assert got == [(b"k" * 16, {"ok": True}), (b"\x0a", {"fine": 1})] and r.skipped == 6
    with open(tmp_path / EXTRAS, "ab") as f:
        f.write(b"}\n")
    assert list(r.poll()) == [(b"\x0b", {})]
    assert w.append([(b"big", {"t": "y" * MAX_LINE})]) == 0  # too long to write
    w.close()


def test_links_and_fifos_are_refused(tmp_path):
    d = tmp_path / "w"
    d.mkdir(mode=0o700)
    target = tmp_path / "elsewhere.jsonl"
    target.write_text('{"k": "01", "x": {}}\n')
    os.symlink(target, d / EXTRAS)
    assert list(ExtrasReader(str(d)).poll()) == []  # a reader never follows it
    ExtrasWriter(str(d)).close()  # a writer replaces the link (a rename), never writes through it
    assert not (d / EXTRAS).is_symlink() and target.read_text() == '{"k": "01", "x": {}}\n'
    os.unlink(d / EXTRAS)
    os.mkfifo(d / EXTRAS)
    assert list(ExtrasReader(str(d)).poll()) == []  # and never blocks on a FIFO
    os.unlink(d / EXTRAS)
    (d / (EXTRAS + ".tmp")).symlink_to(target)  # a planted temporary: removed, never written through
    w = ExtrasWriter(str(d))
    w.append([(b"\x01", {"a": 1})])
    w.compact()
    assert target.read_text() == '{"k": "01", "x": {}}\n'
    w.close()
    os.chmod(d / EXTRAS, 0o666)  # writable by others: a reader refuses it
    assert list(ExtrasReader(str(d)).poll()) == []
    w = ExtrasWriter(str(d), live=[b"\x01"])  # and a writer's restart replaces it, unread
    assert w.lookup(b"\x01") is None and (os.stat(d / EXTRAS).st_mode & 0o777) == 0o600
    w.close()


def test_a_deeply_nested_line_in_a_writers_own_extras_never_stops_its_start(tmp_path):
    """Hardening round three, item 6: `''`'s extras are group-writable in share_group mode, and
    a line nested deeper than the JSON parser's recursion limit raised RecursionError out of the
    writer's start-up (and out of every follower's poll); it is a hostile line, skipped."""
    w = ExtrasWriter(str(tmp_path))
    w.append([(b"k" * 16, {"ok": True})])
    w.close()
    deep = b'{"k": "6b6b", "x": ' + b"[" * 30000 + b"]" * 30000 + b"}\n"
    assert len(deep) < MAX_LINE
    with open(tmp_path / EXTRAS, "ab") as f:
        f.write(deep)
    w = ExtrasWriter(str(tmp_path), live=[b"k" * 16, bytes.fromhex("6b6b")])
    assert w.lookup(b"k" * 16) == {"ok": True}
    w.close()
    r = ExtrasReader(str(tmp_path))
    assert [k for k, _ in r.poll()] == [b"k" * 16]


def test_a_huge_extras_file_is_read_in_bounded_steps_and_a_restart_still_reads_it_all(tmp_path):
    """Round three, item 5: one poll reads at most 1 MiB, whatever the file holds (so a refresh
    parses a bounded amount beside the scheduler); the writer's own start-up still reads the
    whole file step by step, keeping only its live chunks' lines."""
    w = ExtrasWriter(str(tmp_path))
    keys = [i.to_bytes(16, "little") for i in range(80000)]  # ~4.5 MiB of lines
    w.append([(k, {"n": 1}) for k in keys])
    w.close()
    assert os.path.getsize(tmp_path / EXTRAS) > 4 << 20
    r = ExtrasReader(str(tmp_path))
    first = list(r.poll())
    assert 0 < len(first) < len(keys) and r.offset <= 1 << 20
    w = ExtrasWriter(str(tmp_path), live=[keys[0], keys[-1]])
    assert w.lookup(keys[-1]) == {"n": 1} and w.lookup(keys[0]) == {"n": 1} and len(w.items()) == 2
    w.close()
