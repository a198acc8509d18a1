"""Journal.follow: a reader catching up with a live writer reads only what was appended, and
replays the whole file when the writer replaced it (compaction)."""

from __future__ import annotations

import os

from tutti.store.journal import Journal


def key(i: int) -> bytes:
    return bytes([i % 256]) * 32


def test_follow_reads_only_what_was_appended_and_replays_a_replaced_file(tmp_path):
    path = os.path.join(tmp_path, "journal.bin")
    w = Journal(path, writer=True, expected_checksums=2)
    r = Journal(path, writer=False, expected_checksums=2)
    assert not r.follow() and r.entries == {}
    for i in range(30):
        before = os.path.getsize(path)
        w.append_put(key(i), i, [i, i + 1])
        if i % 5 == 4:
            w.append_free([i - 4])
        w.sync()
        if i == 20:  # the writer replaces the file with its live records: followed by a full replay
            w.compact()
            assert r.follow() and r.followed_bytes == os.path.getsize(path)
        else:
            assert r.follow() and r.followed_bytes == os.path.getsize(path) - before  # only the new records
        assert r.entries == w.entries, i
    assert not r.follow() and r.followed_bytes == 0  # nothing changed: one stat, nothing read
    w.close()


def test_a_journal_missing_for_one_follow_keeps_its_entries_and_gone_for_two_drops_them(tmp_path):
    """On a distributed file system an open racing the writer's rename can find no file for an
    instant: one miss keeps what was followed (loads in flight still find their checksums);
    missing again, the writer's journal is gone and so are its entries."""
    path = os.path.join(tmp_path, "journal.bin")
    w = Journal(path, writer=True, expected_checksums=2)
    for i in range(3):
        w.append_put(key(i), i, [i, i])
    w.sync()
    r = Journal(path, writer=False, expected_checksums=2)
    assert r.entries == w.entries
    os.rename(path, path + ".away")  # the instant the file is not there
    assert not r.follow() and r.entries == w.entries
    os.rename(path + ".away", path)
    w.append_put(key(9), 9, [9, 9])
    w.sync()
    assert r.follow() and r.entries == w.entries  # back, and followed on
    os.rename(path, path + ".away")
    assert not r.follow() and r.entries  # one miss: kept
    assert r.follow() and r.entries == {}  # two: gone
    w.close()


def test_closing_a_journal_whose_descriptor_is_already_gone_never_raises(tmp_path):
    """A close that fails (a FUSE client that died answers ENOTCONN; here EBADF) still lets the
    store close everything else, and never closes the descriptor twice."""
    path = os.path.join(tmp_path, "journal.bin")
    w = Journal(path, writer=True, expected_checksums=2)
    os.close(w._fd)  # the descriptor's close will fail
    w.close()
    w.close()
    assert w._fd is None
