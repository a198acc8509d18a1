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
