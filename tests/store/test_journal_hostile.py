"""A journal that survives hostile or damaged files.

Replay never raises on content: invalid records (bad counts, slots out of range, no checksums,
damaged bytes) are skipped, counted and logged, and the records after them are kept; only a torn
tail is dropped (and only it is ever truncated). The file is opened like a storage engine opens
its files (no links, no FIFOs, only a private regular file of ours), read in bounded blocks, and a
writer whose file is replaced or resized under it stops with JournalReplacedError.

Exceptions and parameters are looked up inside each test, so each case fails on its own against
a journal without them (rather than the whole module failing to import).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import zlib

import pytest

from tutti.store import journal as jmod
from tutti.store.journal import Entry, Journal, decode, encode_free, encode_put
from tutti.io.safefs import UnsafeFileError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L = 3  # checksums a put carries (layers)
OTHER_UID = 4242


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def sums(i: int, n: int = L) -> list[int]:
    return [(i * 1000003 + j) % 2**64 for j in range(n)]


def frame(rtype: int, payload: bytes) -> bytes:
    """A record with a valid CRC around any payload (what a forger with the format can write)."""
    body = b"TJR1" + struct.pack("<IB", len(payload), rtype) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def raw_put(slot: int, k: bytes, checksums: list[int]) -> bytes:
    payload = struct.pack("<QB", slot, len(k)) + k + struct.pack("<H", len(checksums))
    return frame(1, payload + struct.pack(f"<{len(checksums)}Q", *checksums))


def raw_free(slots: list[int]) -> bytes:
    return frame(2, struct.pack("<I", len(slots)) + struct.pack(f"<{len(slots)}Q", *slots))


def write(path, data: bytes) -> str:
    path = str(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(fd, data)
    os.close(fd)
    return path


def run_py(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


# ---- records with a valid CRC that the writer could not have written -------------------------
def test_put_with_too_few_checksums_is_skipped_and_counted(tmp_path, caplog):
    recs = [encode_put(key(0), 0, sums(0)), encode_put(key(1), 1, sums(1, 2)),  # one layer short
            encode_put(key(2), 2, sums(2)), encode_free([0]), encode_put(key(3), 3, sums(3))]
    path = write(tmp_path / "journal.bin", b"".join(recs))
    with caplog.at_level(logging.WARNING, logger="tutti.io"):
        r = Journal(path, writer=False, expected_checksums=L)
    assert r.entries == {2: Entry(key(2), tuple(sums(2))), 3: Entry(key(3), tuple(sums(3)))}
    assert r.skipped_records == 1 and r.dropped_tail_bytes == 0
    offset = len(recs[0])
    assert r.skipped_details == [(offset, r.skipped_details[0][1])] and "2 checksums, expected 3" in r.skipped_details[0][1]
    logged = [m for m in caplog.records if m.name == "tutti.io" and m.levelno == logging.WARNING]
    assert len(logged) == 1 and path in logged[0].getMessage() and str(offset) in logged[0].getMessage()
    # the writer keeps every byte (the skipped record is whole, not a tail) and appends after it
    w = Journal(path, writer=True, expected_checksums=L)
    assert w.entries == r.entries and w.skipped_records == 1
    assert os.path.getsize(path) == w.size_bytes == sum(map(len, recs))
    with pytest.raises(ValueError, match="expected 3"):
        w.append_put(key(9), 9, sums(9, 2))  # nor can this writer write such a record
    w.append_put(key(9), 9, sums(9))
    w.sync()
    w.close()
    assert set(Journal(path, writer=False, expected_checksums=L).entries) == {2, 3, 9}
    # the same bytes through decode()
    state, end = decode(b"".join(recs), expected_checksums=L)
    assert set(state) == {2, 3} and end == sum(map(len, recs))


def test_a_skipped_put_forgets_what_its_slot_held(tmp_path):
    # the record says the slot was rewritten: its older entry is no longer trustworthy
    data = encode_put(key(0), 4, sums(0)) + encode_put(key(1), 4, sums(1, 5)) + encode_put(key(2), 5, sums(2))
    state, _ = decode(data, expected_checksums=L)
    assert state == {5: Entry(key(2), tuple(sums(2)))}


@pytest.mark.parametrize("slot,max_slot", [(64, 64), (10**6, 64), (2**63, None), (2**64 - 1, None), (2**63, 64)])
def test_put_of_a_slot_out_of_range_is_skipped(tmp_path, slot, max_slot):
    recs = [encode_put(key(0), 0, sums(0)), raw_put(slot, key(1), sums(1)), encode_put(key(2), 63, sums(2))]
    path = write(tmp_path / "journal.bin", b"".join(recs))
    kw = {} if max_slot is None else {"max_slot": max_slot}
    r = Journal(path, writer=False, **kw)
    assert set(r.entries) == {0, 63}
    assert r.skipped_records == 1 and r.skipped_details[0][0] == len(recs[0])
    assert ("2**63" if slot >= 2**63 else "max_slot") in r.skipped_details[0][1]
    w = Journal(path, writer=True, **kw)
    assert set(w.entries) == {0, 63} and os.path.getsize(path) == sum(map(len, recs))
    if max_slot is not None:
        with pytest.raises(ValueError, match="max_slot"):
            w.append_put(key(3), max_slot, sums(3))
    w.close()


def test_put_with_zero_checksums_is_skipped(tmp_path):
    recs = [raw_put(1, key(1), []), encode_put(key(2), 2, sums(2))]
    path = write(tmp_path / "journal.bin", b"".join(recs))
    for r in (Journal(path, writer=False), Journal(path, writer=False, expected_checksums=L)):
        assert r.entries == {2: Entry(key(2), tuple(sums(2)))}
        assert r.skipped_records == 1 and r.skipped_details[0][0] == 0 and "no checksums" in r.skipped_details[0][1]


def test_malformed_payloads_and_unknown_types_are_skipped(tmp_path):
    good = encode_put(key(5), 5, sums(5))
    bad = [
        frame(1, b"\x00" * 3),  # put too short to hold its head
        frame(1, struct.pack("<QB", 1, 0) + struct.pack("<H", 1) + b"\x00" * 8),  # empty key
        frame(1, struct.pack("<QB", 1, 200) + b"k" * 200 + struct.pack("<H", 0)),  # key > 64 B
        frame(1, raw_put(1, key(1), sums(1))[9:-4][:-3]),  # checksums that do not fill the payload
        frame(2, struct.pack("<I", 3) + b"\x00" * 8),  # free: count says 3, one slot present
        frame(2, b"\x01"),  # free without a count
        frame(7, b"whatever"),  # a type this version does not know
    ]
    data = b"".join(bad) + good
    state, end = decode(data)
    assert state == {5: Entry(key(5), tuple(sums(5)))} and end == len(data)
    path = write(tmp_path / "journal.bin", data)
    r = Journal(path, writer=False)
    assert r.skipped_records == len(bad) and len(r.skipped_details) == min(len(bad), jmod.MAX_SKIP_DETAILS)


def test_free_of_slots_past_max_slot_still_frees_the_others(tmp_path):
    # a store reopened smaller journals frees of slots it no longer has: legitimate history
    data = encode_put(key(1), 1, sums(1)) + encode_put(key(2), 2, sums(2)) + encode_free([1, 500])
    assert decode(data, max_slot=64)[0] == {2: Entry(key(2), tuple(sums(2)))}
    # but a free of a slot >= 2**63 was never written by a writer: skipped, counted
    data += raw_free([2, 2**63])
    path = write(tmp_path / "journal.bin", data)
    r = Journal(path, writer=False, max_slot=64)
    assert set(r.entries) == {2} and r.skipped_records == 1 and "2**63" in r.skipped_details[0][1]


def test_skipped_records_are_capped_in_details_and_logs(tmp_path, caplog):
    recs = []
    for i in range(40):
        recs.append(raw_put(i, key(i), []))  # 40 invalid
        recs.append(encode_put(key(i), 100 + i, sums(i)))
    path = write(tmp_path / "journal.bin", b"".join(recs))
    with caplog.at_level(logging.WARNING, logger="tutti.io"):
        r = Journal(path, writer=False)
        r.reload()  # a reader following a writer replays again: the same records are not logged again
    assert len(r.entries) == 40 and r.skipped_records == 40
    assert len(r.skipped_details) == jmod.MAX_SKIP_DETAILS
    logged = [m for m in caplog.records if m.name == "tutti.io" and m.levelno >= logging.WARNING]
    assert jmod.MAX_SKIP_DETAILS <= len(logged) <= jmod.MAX_SKIP_DETAILS + 1
    assert any("40" in m.getMessage() for m in logged)


# ---- damaged bytes: resynchronise, and tell a damaged middle from a torn tail -----------------
@pytest.mark.parametrize("where", [0, 3, 4, 7, 8, 20, -1])  # magic, length (low, high), type, payload, crc
def test_one_flipped_bit_costs_one_record_of_a_thousand(tmp_path, where):
    recs = [encode_put(key(i), i, sums(i)) for i in range(1000)]
    data = bytearray(b"".join(recs))
    at = len(recs[0]) + (where % len(recs[1]))  # inside record 1
    data[at] ^= 0x10
    path = write(tmp_path / "journal.bin", bytes(data))
    r = Journal(path, writer=False)
    assert len(r.entries) == 999 and 1 not in r.entries
    assert r.entries == {i: Entry(key(i), tuple(sums(i))) for i in range(1000) if i != 1}
    assert r.skipped_records == 1 and r.skipped_details[0][0] == len(recs[0]) and r.dropped_tail_bytes == 0
    w = Journal(path, writer=True)  # must not truncate them away
    assert len(w.entries) == 999
    assert os.path.getsize(path) == len(data) == w.size_bytes
    w.append_put(key(1), 1, sums(1))
    w.sync()
    w.close()
    again = Journal(path, writer=False, expected_checksums=L, max_slot=1000)
    assert len(again.entries) == 1000 and again.skipped_records == 1


def test_damaged_middle_and_torn_tail_together(tmp_path):
    recs = [encode_put(key(i), i, sums(i)) for i in range(6)]
    middle = bytearray(recs[2])
    middle[12] ^= 1
    tail = recs[5][:-7]  # a crash mid-append
    data = b"".join(recs[:2]) + bytes(middle) + b"".join(recs[3:5]) + tail
    path = write(tmp_path / "journal.bin", data)
    r = Journal(path, writer=False)
    assert sorted(r.entries) == [0, 1, 3, 4] and r.skipped_records == 1
    assert r.dropped_tail_bytes == len(tail) and os.path.getsize(path) == len(data)
    w = Journal(path, writer=True)
    assert sorted(w.entries) == [0, 1, 3, 4]
    assert os.path.getsize(path) == len(data) - len(tail) == w.size_bytes  # only the tail was cut
    w.close()


def test_garbage_between_records_is_skipped_as_one_region(tmp_path):
    recs = [encode_put(key(i), i, sums(i)) for i in range(3)]
    junk = os.urandom(5000).replace(b"TJR1", b"XXXX") + b"TJR1" + b"\xff" * 20  # a false magic too
    data = recs[0] + junk + recs[1] + recs[2]
    r = Journal(write(tmp_path / "journal.bin", data), writer=False)
    assert sorted(r.entries) == [0, 1, 2] and r.skipped_records == 1 and r.skipped_details[0][0] == len(recs[0])


# ---- opening: only a private regular file of ours, never through a link or a FIFO -------------
def test_a_fifo_journal_is_refused_without_blocking(tmp_path):
    path = str(tmp_path / "journal.bin")
    os.mkfifo(path, 0o600)
    out = run_py(f"""
        import time
        from tutti.store.journal import Journal
        from tutti.io.safefs import UnsafeFileError
        for writer in (False, True):
            t = time.monotonic()
            try:
                Journal({path!r}, writer=writer)
                print("opened", writer)
            except UnsafeFileError as exc:
                print("refused", writer, round(time.monotonic() - t, 3), exc)
        """, timeout=30)  # a blocking open would hang: subprocess.run raises TimeoutExpired
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [ln.split()[:2] for ln in lines] == [["refused", "False"], ["refused", "True"]], out.stdout
    assert all(path in ln and "FIFO" in ln for ln in lines)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("writer", [False, True])
def test_a_symlinked_journal_is_refused_and_its_target_untouched(tmp_path, writer):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 100)
    os.chmod(victim, 0o600)
    path = str(tmp_path / "journal.bin")
    os.symlink(victim, path)
    with pytest.raises(UnsafeFileError, match="journal.bin.*link"):
        Journal(path, writer=writer)
    assert victim.read_bytes() == b"precious" * 100 and stat.S_IMODE(os.stat(victim).st_mode) == 0o600
    assert os.path.islink(path)


def test_a_dangling_symlink_is_refused_and_nothing_is_created(tmp_path):
    path = str(tmp_path / "journal.bin")
    os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(UnsafeFileError, match="link"):
        Journal(path, writer=True)
    assert not os.path.exists(tmp_path / "elsewhere")


@pytest.mark.parametrize("writer", [False, True])
def test_a_hard_linked_journal_is_refused(tmp_path, writer):
    path = write(tmp_path / "journal.bin", encode_put(key(1), 1, sums(1)))
    os.link(path, tmp_path / "other-name")
    with pytest.raises(UnsafeFileError, match="2 hard links"):
        Journal(path, writer=writer)
    assert os.path.getsize(path) == len(encode_put(key(1), 1, sums(1)))


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
@pytest.mark.parametrize("writer", [False, True])
def test_a_group_or_world_writable_journal_is_refused(tmp_path, writer, mode):
    path = write(tmp_path / "journal.bin", encode_put(key(1), 1, sums(1)))
    os.chmod(path, mode)
    with pytest.raises(UnsafeFileError, match="writable by group or others"):
        Journal(path, writer=writer)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a file to another uid")
@pytest.mark.parametrize("writer", [False, True])
def test_a_journal_owned_by_another_user_is_refused(tmp_path, writer):
    path = write(tmp_path / "journal.bin", encode_put(key(1), 1, sums(1)))
    os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeFileError, match=f"owned by uid {OTHER_UID}"):
        Journal(path, writer=writer)


def test_a_directory_named_journal_is_refused(tmp_path):
    os.mkdir(tmp_path / "journal.bin")
    for writer in (False, True):
        with pytest.raises(OSError):
            Journal(str(tmp_path / "journal.bin"), writer=writer)


def test_created_files_are_private_and_file_mode_is_honoured(tmp_path):
    old = os.umask(0o022)
    try:
        j = Journal(str(tmp_path / "a"), writer=True)
        j.append_put(key(1), 1, sums(1))
        j.sync()
        assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o600
        assert j.compact()  # the compacted file (the former temp) is private too
        assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o600
        j.close()
        Journal(str(tmp_path / "b"), writer=True, file_mode=0o640).close()
        assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o640
    finally:
        os.umask(old)
    with pytest.raises(ValueError, match="file_mode"):
        Journal(str(tmp_path / "c"), writer=True, file_mode=0o666)
    assert not os.path.exists(tmp_path / "c")


def test_dir_fd_opens_and_compacts_relative_to_the_directory(tmp_path):
    d = tmp_path / "ns"
    d.mkdir()
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        j = Journal(str(d / "journal.bin"), writer=True, dir_fd=dfd, compact_min_bytes=0)
        os.rename(d, tmp_path / "moved")  # the descriptor follows the directory, a path would not
        model = {}
        for i in range(50):
            j.append_put(key(i), i % 4, sums(i))
            model[i % 4] = Entry(key(i), tuple(sums(i)))
            j.sync()
        assert j.compactions > 0 and j.entries == model
        j.close()
        assert sorted(os.listdir(tmp_path / "moved")) == ["journal.bin"]
        r = Journal("/nonexistent/anywhere/journal.bin", writer=False, dir_fd=dfd)
        assert r.entries == model and not r.changed()
    finally:
        os.close(dfd)


def test_a_planted_compaction_temp_link_is_removed_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = str(tmp_path / "journal.bin")
    j = Journal(path, writer=True)
    j.append_put(key(1), 1, sums(1))
    j.sync()
    os.symlink(victim, path + ".compact")  # planted while the writer runs
    assert j.compact()
    assert victim.read_bytes() == b"precious"
    assert not os.path.lexists(path + ".compact") and not os.path.islink(path)
    j.close()
    assert Journal(path, writer=False).entries == {1: Entry(key(1), tuple(sums(1)))}
    os.symlink(victim, path + ".compact")  # and at open
    Journal(path, writer=True).close()
    assert victim.read_bytes() == b"precious" and not os.path.lexists(path + ".compact")


# ---- a live writer notices its file replaced or resized ---------------------------------------
def _live_writer(tmp_path) -> tuple[str, Journal]:
    path = str(tmp_path / "journal.bin")
    j = Journal(path, writer=True)
    j.append_put(key(1), 1, sums(1))
    j.sync()
    j.append_put(key(2), 2, sums(2))
    return path, j


def _replace_with_copy(path: str) -> None:
    shutil.copyfile(path, path + ".copy")
    os.rename(path + ".copy", path)


def _append_garbage(path: str) -> None:
    with open(path, "ab") as f:
        f.write(b"x" * 10)


@pytest.mark.parametrize("tamper", [_replace_with_copy, lambda p: os.truncate(p, 5), lambda p: os.truncate(p, 0),
                                    os.unlink, _append_garbage],
                         ids=["renamed-over", "truncated", "emptied", "unlinked", "extended"])
def test_a_writer_stops_when_its_journal_is_replaced_or_resized(tmp_path, tamper):
    path, j = _live_writer(tmp_path)
    tamper(path)
    before = open(path, "rb").read() if os.path.exists(path) else None
    with pytest.raises(jmod.JournalReplacedError, match="journal.bin.*stopped recording"):
        j.sync()
    assert isinstance(jmod.JournalReplacedError("x"), (OSError, RuntimeError))
    with pytest.raises(jmod.JournalReplacedError):  # and it stays stopped
        j.sync()
    with pytest.raises(jmod.JournalReplacedError):
        j.compact()
    after = open(path, "rb").read() if os.path.exists(path) else None
    assert after == before  # nothing was written into whatever is there now
    j.close()


def test_a_writer_after_its_own_compaction_and_cut_back_goes_on(tmp_path):
    path = str(tmp_path / "journal.bin")
    j = Journal(path, writer=True, compact_min_bytes=0)
    for i in range(100):
        j.append_put(key(i), i % 3, sums(i))
        j.sync()  # no false alarm after each compaction (a new inode) or append
    assert j.compactions > 5
    j.close()


# ---- bounded memory ---------------------------------------------------------------------------
def test_a_sparse_3gib_journal_replays_in_bounded_memory(tmp_path):
    path = str(tmp_path / "journal.bin")
    torn = str(tmp_path / "torn.bin")
    head = b"".join(encode_put(key(i), i, sums(i)) for i in range(4))
    tail = b"".join(encode_put(key(i), i, sums(i)) for i in range(4, 8))
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + (3 << 30))  # a 3 GiB hole of zeros in the middle
        f.seek(0, os.SEEK_END)
        f.write(tail)
    with open(torn, "wb") as f:
        f.write(head)
        f.truncate(len(head) + (3 << 30))  # and one at the end: a (very) torn tail
    os.chmod(path, 0o600)
    os.chmod(torn, 0o600)
    size = os.path.getsize(path)
    out = run_py(f"""
        import json, os, resource, tracemalloc
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # reading it whole cannot work
        from tutti.store.journal import Journal
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        r = Journal({path!r}, writer=False)
        w = Journal({path!r}, writer=True)
        t = Journal({torn!r}, writer=True)
        peak = tracemalloc.get_traced_memory()[1]
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps(dict(reader=sorted(r.entries), writer=sorted(w.entries), skipped=r.skipped_records,
                              tail=r.dropped_tail_bytes, size=w.size_bytes, peak=peak, rss_kib=rss1 - rss0,
                              torn=sorted(t.entries), torn_tail=t.dropped_tail_bytes,
                              torn_size=os.path.getsize({torn!r}))))
        """, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["reader"] == got["writer"] == list(range(8))
    assert got["skipped"] == 1 and got["tail"] == 0 and got["size"] == size == os.path.getsize(path)
    assert got["torn"] == list(range(4)) and got["torn_tail"] == 3 << 30 and got["torn_size"] == len(head)
    assert got["peak"] < 16 << 20, got
    assert got["rss_kib"] < 64 << 10, got


@pytest.mark.parametrize("holes", [True, False], ids=["seek-data", "no-seek-data"])
def test_replay_reads_in_bounded_blocks(tmp_path, monkeypatch, holes):
    """80 MiB of non-zero garbage behind a header that claims a 60 MiB record: read block by block
    (the CRC of the claimed record too), never whole; the record after it is found."""
    import tracemalloc

    if not holes:  # a filesystem without SEEK_DATA: every byte is read
        monkeypatch.setattr(jmod.os, "SEEK_DATA", None, raising=False)
    path = str(tmp_path / "journal.bin")
    first, last = encode_put(key(1), 1, sums(1)), encode_put(key(2), 2, sums(2))
    with open(path, "wb") as f:
        f.write(first + b"TJR1" + struct.pack("<IB", 60 << 20, 2))
        block = b"\xab" * (1 << 20)
        for _ in range(80):
            f.write(block)
        f.write(last)
    del block
    os.chmod(path, 0o600)
    tracemalloc.start()
    try:
        r = Journal(path, writer=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sorted(r.entries) == [1, 2] and r.skipped_records == 1 and r.dropped_tail_bytes == 0
    assert peak < 8 << 20, peak
