"""Journal: replay semantics, torn and garbled tails, compaction, short writes and a full disk."""

from __future__ import annotations

import errno
import os
import random

import pytest

from tutti.store import journal as jmod
from tutti.store.journal import Entry, Journal, decode, encode_free, encode_put


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes


def sums(i: int, n: int = 3) -> list[int]:
    return [(i * 1000003 + j) % 2**64 for j in range(n)]


def apply_model(model: dict, op) -> None:
    if op[0] == "put":
        _, k, s, c = op
        model[s] = Entry(k, tuple(c))
    else:
        for s in op[1]:
            model.pop(s, None)


def random_ops(seed: int, n: int, slots: int = 8) -> list:
    rng = random.Random(seed)
    ops = []
    for i in range(n):
        if rng.random() < 0.6:
            ops.append(("put", key(i)[: rng.randint(1, 32)] + b"\x00" * rng.randint(0, 32), rng.randrange(slots), sums(i, rng.randint(1, 5))))
        else:
            ops.append(("free", rng.sample(range(slots), rng.randint(0, min(3, slots)))))
    return ops


def run_ops(j: Journal, ops, model: dict) -> None:
    for op in ops:
        if op[0] == "put":
            j.append_put(op[1], op[2], op[3])
        else:
            j.append_free(op[1])
        apply_model(model, op)


def test_decode_replay_semantics():
    data = (
        encode_put(key(1), 5, [1, 2])
        + encode_put(key(2), 6, [3, 4])
        + encode_put(key(3), 5, [5, 6])  # replaces slot 5
        + encode_free([6, 99])  # frees 6; 99 was never used
        + encode_put(b"k" * 64, 7, [2**64 - 1])
    )
    state, end = decode(data)
    assert end == len(data)
    assert state == {5: Entry(key(3), (5, 6)), 7: Entry(b"k" * 64, (2**64 - 1,))}


@pytest.mark.parametrize("seed", range(4))
def test_random_ops_survive_reopen(tmp_path, seed):
    path = str(tmp_path / "journal.bin")
    model: dict = {}
    j = Journal(path, writer=True)
    ops = random_ops(seed, 200)
    for start in range(0, len(ops), 37):  # sync in uneven batches
        run_ops(j, ops[start : start + 37], model)
        assert j.entries == model
        j.sync()
    j.close()
    again = Journal(path, writer=False)
    assert again.entries == model
    assert again.dropped_tail_bytes == 0


def test_unsynced_records_are_not_durable(tmp_path):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True)
    j.append_put(key(1), 0, [1])
    j.sync()
    j.append_put(key(2), 1, [2])
    assert j.pending_records == 1 and 1 in j.entries
    j.close()  # as if killed before sync
    assert Journal(path, writer=False).entries == {0: Entry(key(1), (1,))}


def _journal_with_tail(tmp_path) -> tuple[str, dict, int]:
    path = str(tmp_path / "j")
    j = Journal(path, writer=True)
    j.append_put(key(1), 0, sums(1))
    j.append_free([3])
    j.append_put(key(2), 1, sums(2))
    j.sync()
    good = j.entries.copy()
    good_size = j.size_bytes
    j.append_put(key(3), 2, sums(3))
    j.sync()
    j.close()
    return path, good, good_size


def test_torn_tail_is_ignored_and_truncated(tmp_path):
    path, good, good_size = _journal_with_tail(tmp_path)
    full = open(path, "rb").read()
    for cut in range(good_size, len(full)):  # every possible tear inside the last record
        with open(path, "wb") as f:
            f.write(full[:cut])
        reader = Journal(path, writer=False)
        assert reader.entries == good
        assert os.path.getsize(path) == cut, "a reader must never truncate"
        writer = Journal(path, writer=True)
        assert writer.entries == good
        assert os.path.getsize(path) == good_size
        # appends after a truncated tail replay normally
        writer.append_put(key(9), 4, [9])
        writer.sync()
        writer.close()
        assert Journal(path, writer=False).entries == {**good, 4: Entry(key(9), (9,))}


def test_garbled_tail_is_ignored(tmp_path):
    path, good, good_size = _journal_with_tail(tmp_path)
    full = open(path, "rb").read()
    for pos in range(good_size, len(full)):  # flip each byte of the last record in turn
        bad = bytearray(full)
        bad[pos] ^= 0x5A
        with open(path, "wb") as f:
            f.write(bad)
        assert Journal(path, writer=False).entries == good, pos
        w = Journal(path, writer=True)
        assert w.entries == good
        assert os.path.getsize(path) == good_size
        w.close()


def test_garbage_in_the_middle_costs_only_that_record(tmp_path):
    # (was: "keeps only the prefix"; replay now resynchronises at the next valid record, and a
    # writer keeps the records after the damaged one: tests/store/test_journal_hostile.py)
    path = str(tmp_path / "j")
    recs = [encode_put(key(i), i, [i]) for i in range(5)]
    bad = bytearray(recs[2])
    bad[-1] ^= 1
    with open(path, "wb") as f:
        f.write(b"".join(recs[:2]) + bytes(bad) + b"".join(recs[3:]))
    reader = Journal(path, writer=False)
    assert sorted(reader.entries) == [0, 1, 3, 4]
    assert reader.skipped_records == 1 and reader.skipped_details[0][0] == len(recs[0]) * 2
    assert reader.dropped_tail_bytes == 0
    w = Journal(path, writer=True)
    assert sorted(w.entries) == [0, 1, 3, 4]
    assert os.path.getsize(path) == w.size_bytes == sum(map(len, recs))
    w.close()


def test_compaction_keeps_exactly_the_live_state(tmp_path):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True, compact_ratio=4.0, compact_min_bytes=0)
    model: dict = {}
    ops = random_ops(7, 2000, slots=6)
    for start in range(0, len(ops), 10):
        run_ops(j, ops[start : start + 10], model)
        j.sync()
        assert j.size_bytes == os.path.getsize(path) <= 4 * j.live_bytes
    assert j.compactions > 10
    assert j.entries == model
    j.close()
    assert Journal(path, writer=False).entries == model
    # an explicit compaction leaves exactly one put per live slot
    j = Journal(path, writer=True)
    assert j.compact()
    assert os.path.getsize(path) == j.live_bytes == sum(len(encode_put(e.key, s, e.checksums)) for s, e in model.items())
    j.close()
    assert Journal(path, writer=False).entries == model


def test_replay_and_compaction_keep_the_order_chunks_were_stored_in(tmp_path):
    """The index rebuilds its recency from the journal's order (a prefix stored tail first is
    given up from its end after a restart too), so a replay and a compaction keep it."""
    path = str(tmp_path / "j")
    j = Journal(path, writer=True)
    for slot in (5, 2, 7, 0):
        j.append_put(key(slot), slot, sums(slot))
    j.append_free([5])
    j.append_put(key(50), 5, sums(50))  # a freed slot put again: the newest
    j.sync()
    assert list(j.entries) == [2, 7, 0, 5]
    j.close()
    assert list(Journal(path, writer=False).entries) == [2, 7, 0, 5]
    j = Journal(path, writer=True)
    assert j.compact()
    j.close()
    assert list(Journal(path, writer=False).entries) == [2, 7, 0, 5]


@pytest.mark.parametrize("leftover", [b"", b"garbage", "partial"])
def test_compaction_killed_before_rename(tmp_path, leftover):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True)
    model: dict = {}
    run_ops(j, random_ops(3, 100), model)
    j.sync()
    j.close()
    if leftover == "partial":  # half of a real compacted file
        data = b"".join(encode_put(e.key, s, e.checksums) for s, e in sorted(model.items()))
        leftover = data[: len(data) // 2]
    with open(path + ".compact", "wb") as f:
        f.write(leftover)
    assert Journal(path, writer=False).entries == model
    assert os.path.exists(path + ".compact"), "a reader must not clean up"
    w = Journal(path, writer=True)
    assert w.entries == model
    assert not os.path.exists(path + ".compact")
    w.close()


def test_short_writes_are_completed(tmp_path, monkeypatch):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True)
    real = os.pwrite
    calls = []

    def dribble(fd, data, offset):
        calls.append(1)
        return real(fd, bytes(memoryview(data)[:7]), offset)

    monkeypatch.setattr(jmod.os, "pwrite", dribble)
    model: dict = {}
    run_ops(j, random_ops(1, 20), model)
    j.sync()
    monkeypatch.setattr(jmod.os, "pwrite", real)
    j.close()
    assert len(calls) > 20
    assert Journal(path, writer=False).entries == model


def test_enospc_cuts_back_and_retry_succeeds(tmp_path, monkeypatch):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True)
    j.append_put(key(1), 0, [1])
    j.sync()
    durable = j.size_bytes
    real = os.pwrite

    def full_disk(fd, data, offset):
        n = real(fd, bytes(memoryview(data)[:10]), offset)  # some bytes land, then the disk is full
        assert n == 10
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(jmod.os, "pwrite", full_disk)
    j.append_free([0])
    j.append_put(key(2), 1, [2])
    with pytest.raises(OSError) as info:
        j.sync()
    assert info.value.errno == errno.ENOSPC
    assert os.path.getsize(path) == durable  # the partial record was cut away
    assert Journal(path, writer=False).entries == {0: Entry(key(1), (1,))}
    monkeypatch.setattr(jmod.os, "pwrite", real)
    j.sync()  # the same records are written again once there is room
    j.close()
    assert Journal(path, writer=False).entries == {1: Entry(key(2), (2,))}


def test_compaction_on_full_disk_keeps_the_old_file(tmp_path, monkeypatch):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True, compact_min_bytes=0)
    model: dict = {}
    run_ops(j, random_ops(5, 50, slots=6), model)
    assert model and j.live_bytes * 4 < sum(map(len, j._pending))
    real = os.pwrite

    def refuse_tmp(fd, data, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".compact"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(jmod.os, "pwrite", refuse_tmp)
    with pytest.warns(UserWarning, match="postponed"):
        j.sync()
    assert not os.path.exists(path + ".compact")
    monkeypatch.setattr(jmod.os, "pwrite", real)
    j.close()
    assert Journal(path, writer=False).entries == model


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda j: j.append_put(b"", 0, [1]), "key"),
        (lambda j: j.append_put(b"x" * 65, 0, [1]), "1..64"),
        (lambda j: j.append_put("str", 0, [1]), "bytes"),
        (lambda j: j.append_put(b"k", -1, [1]), "slot"),
        (lambda j: j.append_put(b"k", 0, []), "checksums"),
        (lambda j: j.append_put(b"k", 0, [2**64]), "64-bit"),
        (lambda j: j.append_free([1, "2"]), "slots"),
    ],
)
def test_bad_records_are_refused_before_any_change(tmp_path, call, words):
    j = Journal(str(tmp_path / "j"), writer=True)
    with pytest.raises(ValueError, match=words):
        call(j)
    assert j.pending_records == 0 and j.entries == {}
    j.close()


def test_reader_cannot_append(tmp_path):
    j = Journal(str(tmp_path / "missing"), writer=False)
    assert j.entries == {}
    assert not os.path.exists(tmp_path / "missing")
    with pytest.raises(RuntimeError, match="read-only"):
        j.append_free([1])


class Crash(BaseException):
    """Stands for SIGKILL: no cleanup code may run, the page cache (what was written) survives."""


@pytest.mark.parametrize("point", ["mid-write", "before-rename", "before-dir-fsync"])
def test_compaction_crash_at_each_step(tmp_path, monkeypatch, point):
    path = str(tmp_path / "j")
    j = Journal(path, writer=True, compact_min_bytes=1 << 30)  # no automatic compaction yet
    model: dict = {}
    run_ops(j, random_ops(11, 300, slots=10), model)
    j.sync()
    assert len(model) >= 3
    real_write, real_rename = jmod._write_all, os.rename

    def half_then_crash(fd, data, offset):
        real_write(fd, bytes(memoryview(data)[: len(data) // 2]), offset)
        raise Crash

    def crash(*a, **k):
        raise Crash

    if point == "mid-write":
        monkeypatch.setattr(jmod, "_write_all", half_then_crash)
    elif point == "before-rename":
        monkeypatch.setattr(jmod.os, "rename", crash)
    else:
        monkeypatch.setattr(jmod, "fsync_dir", crash)
    with pytest.raises(Crash):
        j.compact()
    monkeypatch.setattr(jmod, "_write_all", real_write)
    monkeypatch.setattr(jmod.os, "rename", real_rename)
    monkeypatch.undo()
    assert Journal(path, writer=False).entries == model
    again = Journal(path, writer=True)
    assert again.entries == model
    again.append_put(key(1000), 0, [1])
    again.sync()
    again.close()
    model[0] = Entry(key(1000), (1,))
    assert Journal(path, writer=False).entries == model
