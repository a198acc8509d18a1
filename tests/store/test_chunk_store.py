"""ChunkStore on real files: layout, namespaces, the writer lock, crashes and a full disk."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from tutti.store.fingerprint import Fingerprint
from tutti.store.chunk_store import (
    ChunkStore,
    ManifestMismatchError,
    StoreLockedError,
    StoreRootError,
    list_namespaces,
    namespace_dir,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEG = 2 * 4096


def make_fp(**over) -> Fingerprint:
    base = dict(
        model="tiny-model",
        cache_dtype="bfloat16",
        format_version=1,
        chunk_tokens=16,
        num_layers=3,
        num_heads=2,
        content_bytes=SEG - 100,
        segment_bytes=SEG,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
    )
    base.update(over)
    return Fingerprint(**base)


def chunk_key(i: int) -> bytes:
    return zlib.crc32(str(i).encode()).to_bytes(4, "little") * 8


def layer_bytes(key: bytes, layer: int, size: int) -> bytes:
    return random.Random(key + bytes([layer])).randbytes(size)


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def store_chunk(store: ChunkStore, slot: int, key: bytes) -> None:
    """The engine's protocol: free, write, sync data, put, sync journal."""
    store.record_free([slot])
    store.sync_journal()
    sums = []
    for layer in range(store.num_layers):
        fd, off = store.location(slot, layer)
        data = layer_bytes(key, layer, store.segment_bytes)
        pwrite_all(fd, data, off)
        sums.append(zlib.crc32(data))
    store.sync_data([slot])
    store.record_put(key, slot, sums)
    store.sync_journal()


def verify_all(store: ChunkStore) -> dict[int, bytes]:
    """Every visible chunk: every byte matches its checksum and what was written for its key."""
    seen = {}
    for slot, entry in store.entries().items():
        assert len(entry.checksums) == store.num_layers
        for layer, crc in enumerate(entry.checksums):
            fd, off = store.location(slot, layer)
            data = os.pread(fd, store.segment_bytes, off)
            assert zlib.crc32(data) == crc, f"slot {slot} layer {layer}: checksum mismatch"
            assert data == layer_bytes(entry.key, layer, store.segment_bytes)
        seen[slot] = entry.key
    return seen


# ---- layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("nroots", [1, 3])
def test_round_trip_and_layout(tmp_path, nroots):
    fp = make_fp()
    roots = [str(tmp_path / f"drive{i}") for i in range(nroots)]
    slot_bytes = fp.num_layers * SEG
    with ChunkStore(roots if nroots > 1 else roots[0], fp, capacity_bytes=20 * slot_bytes + 5, writer=True, slots_per_slab=4) as st:
        assert st.slot_bytes == slot_bytes and st.num_slots == 20
        for s in range(st.num_slots):
            for layer in range(st.num_layers):
                fd, off = st.location(s, layer)
                local = s // nroots
                assert off == (local % 4) * slot_bytes + layer * SEG
                path = os.readlink(f"/proc/self/fd/{fd}")
                assert path == os.path.join(roots[s % nroots], f"tutti-{fp.digest()}", f"slab-{local // 4}.bin")
        for s in (0, 7, 19, 3):
            store_chunk(st, s, chunk_key(s))
        assert verify_all(st) == {s: chunk_key(s) for s in (0, 7, 19, 3)}
        stats = st.stats()
        assert stats.slots_used == 4 and stats.slots_total == 20
        assert stats.bytes_used == 4 * slot_bytes and stats.capacity_bytes == 20 * slot_bytes
        assert stats.journal_bytes == os.path.getsize(stats.journal_path) > 0
        assert all(s.size_bytes % SEG == 0 for s in stats.slabs) and len(stats.slabs) >= 1
    with ChunkStore(roots, fp, capacity_bytes=20 * slot_bytes, writer=False) as rd:
        assert rd.slots_per_slab == 4  # taken from the manifest
        assert verify_all(rd) == {s: chunk_key(s) for s in (0, 7, 19, 3)}
    # no file per chunk: only slab files, a manifest, a lock and the journal
    names = set(os.listdir(namespace_dir(roots[0], fp)))
    assert {n for n in names if not n.startswith("slab-")} == {"manifest.json", "LOCK", "journal.bin"}


def test_capacity_is_a_hard_cap(tmp_path):
    fp = make_fp()
    with pytest.raises(ValueError, match=f"pass at least {3 * SEG}"):
        ChunkStore(str(tmp_path), fp, capacity_bytes=3 * SEG - 1, writer=True)
    assert not os.path.exists(namespace_dir(str(tmp_path), fp)), "bad input must fail before any IO"
    with ChunkStore(str(tmp_path), fp, capacity_bytes=2 * 3 * SEG, writer=True) as st:
        st.location(1, 2)
        for bad in [(2, 0), (-1, 0), (0, 3), (True, 0)]:
            with pytest.raises(ValueError, match="slot|layer"):
                st.location(*bad)
        with pytest.raises(ValueError, match="slot"):
            st.record_put(chunk_key(1), 2, [1, 2, 3])
        with pytest.raises(ValueError, match="one per layer"):
            st.record_put(chunk_key(1), 0, [1, 2])


def test_reopen_smaller_forgets_slots_it_no_longer_has(tmp_path):
    fp, root = make_fp(), str(tmp_path)
    with ChunkStore(root, fp, capacity_bytes=8 * 3 * SEG, writer=True) as st:
        for s in (1, 6):
            store_chunk(st, s, chunk_key(s))
    with ChunkStore(root, fp, capacity_bytes=4 * 3 * SEG, writer=False) as rd:
        assert sorted(rd.entries()) == [1]
    with ChunkStore(root, fp, capacity_bytes=4 * 3 * SEG, writer=True) as st:
        assert sorted(st.entries()) == [1]
    with ChunkStore(root, fp, capacity_bytes=8 * 3 * SEG, writer=True) as st:
        assert sorted(st.entries()) == [1]  # the forgotten chunk stays forgotten


def test_opener_hook_and_direct_io(tmp_path):
    fp = make_fp()
    opened = []

    def direct(name: str, write: bool, dir_fd: int) -> int:
        opened.append((name, write))  # a name relative to the namespace's descriptor, never a path
        flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_CLOEXEC | os.O_NOFOLLOW | getattr(os, "O_DIRECT", 0)
        return os.open(name, flags, dir_fd=dir_fd)

    try:
        st = ChunkStore(str(tmp_path), fp, capacity_bytes=4 * 3 * SEG, writer=True, open_file=direct)
        buf = mmap.mmap(-1, SEG)  # page aligned, as direct IO demands
        buf[:] = layer_bytes(b"k", 0, SEG)
        fd, off = st.location(2, 1)
        assert os.pwrite(fd, buf, off) == SEG
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            pytest.skip(f"{tmp_path} does not support O_DIRECT")
        raise
    st.sync_data()
    assert opened == [("slab-0.bin", True)]
    st.close()
    rd = ChunkStore(str(tmp_path), fp, capacity_bytes=4 * 3 * SEG, writer=False, open_file=direct)
    back = mmap.mmap(-1, SEG)
    fd, off = rd.location(2, 1)
    assert os.preadv(fd, [back], off) == SEG and back[:] == buf[:]
    assert opened[-1][1] is False
    rd.close()


def test_allocate_backs_slots_with_written_zeros(tmp_path):
    fp, root = make_fp(), str(tmp_path)
    with ChunkStore(root, fp, capacity_bytes=8 * 3 * SEG, writer=True, slots_per_slab=8) as st:
        store_chunk(st, 5, chunk_key(5))  # written past the end: slots 0..4 are a hole
        fd, _ = st.location(0)
        assert os.lseek(fd, 0, os.SEEK_HOLE) == 0
        st.allocate([0, 1, 6])
        size = os.fstat(fd).st_size
        assert size == 7 * st.slot_bytes
        for s in (0, 1, 6):
            start = st.location(s)[1]
            assert os.lseek(fd, start, os.SEEK_HOLE) >= start + st.slot_bytes, f"slot {s} still has a hole"
            assert os.pread(fd, st.slot_bytes, start) == bytes(st.slot_bytes)
        assert verify_all(st) == {5: chunk_key(5)}  # the live neighbour is untouched
        with pytest.raises(ValueError, match="record_free"):
            st.allocate([5])


def test_reader_follows_the_writer_and_close_syncs(tmp_path):
    fp, root, cap = make_fp(), str(tmp_path), 6 * 3 * SEG
    st = ChunkStore(root, fp, capacity_bytes=cap, writer=True)
    store_chunk(st, 2, chunk_key(2))
    rd = ChunkStore(root, fp, capacity_bytes=cap, writer=False)
    assert list(rd.entries()) == [2]
    store_chunk(st, 4, chunk_key(4))
    st.record_free([2])
    assert list(rd.entries()) == [2]  # a reader sees nothing until it replays again
    rd.refresh()
    assert sorted(rd.entries()) == [2, 4]  # the free is not synced yet: not durable, not visible
    st.close()  # a clean close makes the pending free durable
    rd.refresh()
    assert list(rd.entries()) == [4]
    verify_all(rd)
    with pytest.raises(RuntimeError, match="closed"):
        st.location(0)
    rd.close()


# ---- namespaces and manifests ---------------------------------------------------------------
def test_two_fingerprints_never_see_each_other(tmp_path):
    root = str(tmp_path)
    a, b = make_fp(), make_fp(cache_dtype="fp8_e4m3")
    cap = 4 * 3 * SEG
    with ChunkStore(root, a, capacity_bytes=cap, writer=True) as sa, ChunkStore(root, b, capacity_bytes=cap, writer=True) as sb:
        store_chunk(sa, 0, b"A" * 32)
        store_chunk(sb, 1, b"B" * 32)
        assert sa.location(0)[0] != sb.location(0)[0]
    with ChunkStore(root, a, capacity_bytes=cap, writer=False) as ra, ChunkStore(root, b, capacity_bytes=cap, writer=False) as rb:
        assert ra.entries() == {0: ra.entries()[0]} and ra.entries()[0].key == b"A" * 32
        assert list(rb.entries()) == [1] and rb.entries()[1].key == b"B" * 32
        verify_all(ra), verify_all(rb)
    infos = {i.digest: i for i in list_namespaces(root)}
    assert set(infos) == {a.digest(), b.digest()}
    assert Fingerprint.from_dict(infos[b.digest()].manifest["fingerprint"]) == b


def _edit_manifest(root: str, fp: Fingerprint, edit) -> str:
    path = os.path.join(namespace_dir(root, fp), "manifest.json")
    data = json.load(open(path))
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f)
    return path


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda m: m["fingerprint"].update(num_heads=99), "num_heads"),
        (lambda m: m.update(digest="0" * 16), "digest"),
        (lambda m: m.update(slot_bytes=4096), "slot_bytes"),
        (lambda m: m.update(format="something-else"), "not a tutti-chunk-store"),
    ],
)
def test_edited_manifest_is_refused(tmp_path, edit, words):
    root, fp = str(tmp_path), make_fp()
    with ChunkStore(root, fp, capacity_bytes=3 * SEG, writer=True) as st:
        store_chunk(st, 0, chunk_key(0))
    path = _edit_manifest(root, fp, edit)
    for writer in (True, False):
        with pytest.raises(ManifestMismatchError) as info:
            ChunkStore(root, fp, capacity_bytes=3 * SEG, writer=writer)
        assert words in str(info.value) and path in str(info.value) and "aside" in str(info.value)


def test_garbled_manifest_and_wrong_root_order(tmp_path):
    fp = make_fp()
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    ChunkStore(roots, fp, capacity_bytes=4 * 3 * SEG, writer=True, slots_per_slab=2).close()
    with pytest.raises(ManifestMismatchError, match="same order"):
        ChunkStore(roots[::-1], fp, capacity_bytes=4 * 3 * SEG, writer=False)
    with pytest.raises(ManifestMismatchError, match="same order"):
        ChunkStore(roots[:1], fp, capacity_bytes=4 * 3 * SEG, writer=True)
    with pytest.raises(ValueError, match="slots_per_slab=2"):
        ChunkStore(roots, fp, capacity_bytes=4 * 3 * SEG, writer=True, slots_per_slab=64)
    with open(os.path.join(namespace_dir(roots[1], fp), "manifest.json"), "w") as f:
        f.write('{"format": "tutti-chunk-st')
    with pytest.raises(ManifestMismatchError, match="not valid JSON"):
        ChunkStore(roots, fp, capacity_bytes=4 * 3 * SEG, writer=True)
    assert [i.error is not None for i in list_namespaces(roots[1])] == [True]


# ---- the writer lock ------------------------------------------------------------------------
def test_second_writer_in_this_process(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    fp = make_fp()
    first = ChunkStore(roots, fp, capacity_bytes=3 * SEG, writer=True)
    with pytest.raises(StoreLockedError) as info:
        ChunkStore(roots, fp, capacity_bytes=3 * SEG, writer=True)
    msg = str(info.value)
    assert roots[0] in msg and os.path.join(namespace_dir(roots[0], fp), "LOCK") in msg
    assert f"pid {os.getpid()}" in msg and "writer=False" in msg
    with ChunkStore(roots, fp, capacity_bytes=3 * SEG, writer=False) as rd:  # readers take no lock
        assert rd.entries() == {}
        with pytest.raises(RuntimeError, match="writer=False"):
            rd.record_free([0])
    first.close()
    ChunkStore(roots, fp, capacity_bytes=3 * SEG, writer=True).close()


HOLD_LOCK = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from tutti.store.fingerprint import Fingerprint
    from tutti.store.chunk_store import ChunkStore
    st = ChunkStore(sys.argv[2], Fingerprint.from_dict(json.loads(sys.argv[3])), capacity_bytes=int(sys.argv[4]), writer=True)
    print("locked", flush=True)
    sys.stdin.read()
    st.close()
    """
)


def test_second_writer_in_another_process(tmp_path):
    fp, root = make_fp(), str(tmp_path / "root")
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, REPO, root, json.dumps(fp.to_dict()), str(3 * SEG)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError) as info:
            ChunkStore(root, fp, capacity_bytes=3 * SEG, writer=True)
        assert f"pid {child.pid}" in str(info.value) and root in str(info.value)
    finally:
        child.stdin.close()
        child.wait(10)
    assert child.returncode == 0
    ChunkStore(root, fp, capacity_bytes=3 * SEG, writer=True).close()


# ---- bad roots ------------------------------------------------------------------------------
def test_bad_roots_are_named(tmp_path):
    fp = make_fp()
    missing = str(tmp_path / "no" / "such")
    with pytest.raises(StoreRootError, match="parent directory .* does not exist") as info:
        ChunkStore(missing, fp, capacity_bytes=3 * SEG, writer=True)
    assert missing in str(info.value)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(StoreRootError, match="not a directory"):
        ChunkStore(str(afile), fp, capacity_bytes=3 * SEG, writer=False)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / f"tutti-{fp.digest()}").write_text("x")
    with pytest.raises(StoreRootError, match="namespace .* not a directory"):
        ChunkStore(str(blocked), fp, capacity_bytes=3 * SEG, writer=True)
    with pytest.raises(ValueError, match="appears twice"):
        ChunkStore([str(tmp_path), str(tmp_path) + "/."], fp, capacity_bytes=3 * SEG, writer=True)
    # a missing root whose parent exists: a writer creates it, a reader creates nothing
    fresh = str(tmp_path / "fresh")
    with ChunkStore(fresh, fp, capacity_bytes=3 * SEG, writer=False) as rd:
        assert rd.entries() == {} and rd.stats().slots_used == 0
    assert not os.path.exists(fresh)
    ChunkStore(fresh, fp, capacity_bytes=3 * SEG, writer=True).close()
    assert os.path.isfile(os.path.join(namespace_dir(fresh, fp), "manifest.json"))


def test_unwritable_root(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: permission bits do not stop root, so there is nothing to refuse")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(StoreRootError, match="permission"):
        ChunkStore(str(ro), make_fp(), capacity_bytes=3 * SEG, writer=True)


# ---- crashes --------------------------------------------------------------------------------
CRASH_CHILD = textwrap.dedent(
    """
    import json, os, random, sys, zlib
    sys.path.insert(0, sys.argv[1])
    from tutti.store.fingerprint import Fingerprint
    from tutti.store.chunk_store import ChunkStore
    fp = Fingerprint.from_dict(json.loads(sys.argv[3]))
    nslots = int(sys.argv[4])
    st = ChunkStore(sys.argv[2], fp, capacity_bytes=nslots * fp.num_layers * fp.segment_bytes, writer=True,
                    slots_per_slab=2, journal_compact_min_bytes=0)
    i = 0
    while True:
        slot, key = i % nslots, zlib.crc32(str(i).encode()).to_bytes(4, "little") * 8
        st.record_free([slot]); st.sync_journal()
        os.write(1, b"F %d\\n" % i)  # one syscall: a kill never leaves half a line
        sums = []
        for layer in range(fp.num_layers):
            fd, off = st.location(slot, layer)
            data = random.Random(key + bytes([layer])).randbytes(fp.segment_bytes)
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view[:4096], off)  # small writes: a kill can land mid-segment
                view, off = view[n:], off + n
            sums.append(zlib.crc32(data))
        st.sync_data([slot])
        st.record_put(key, slot, sums); st.sync_journal()
        os.write(1, b"P %d\\n" % i)
        i += 1
    """
)


@pytest.mark.parametrize("target,delay", [(2, 0.0), (11, 0.0007), (29, 0.002), (60, 0.0035)])
def test_sigkill_leaves_only_whole_chunks(tmp_path, target, delay):
    """Kill the writer after `target` announced steps plus `delay` seconds, then check the store."""
    info = crash_and_check(str(tmp_path / "root"), target, delay)
    assert info["compactions"] or target < 20


def crash_and_check(root: str, target: int, delay: float) -> dict:
    fp, nslots = make_fp(), 5
    child = subprocess.Popen(
        [sys.executable, "-c", CRASH_CHILD, REPO, root, json.dumps(fp.to_dict()), str(nslots)],
        stdout=subprocess.PIPE, text=True,
    )
    lines = []
    try:
        while len(lines) < target:
            line = child.stdout.readline()
            assert line, f"child died early (rc={child.poll()})"
            lines.append(line.split())
        time.sleep(delay)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        lines += [ln.split() for ln in child.stdout.read().splitlines(keepends=True) if ln.endswith("\n")]
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    # What the child announced is durable; only the one step after the last announcement is unknown.
    expected: dict[int, bytes | None] = {s: None for s in range(nslots)}
    assert all(len(ln) == 2 for ln in lines), lines[-5:]
    for kind, i in ((k, int(i)) for k, i in lines):
        expected[i % nslots] = chunk_key(i) if kind == "P" else None
    kind, last = lines[-1][0], int(lines[-1][1])
    if kind == "F":  # killed while writing or putting iteration `last`
        open_slot, allowed = last % nslots, {None, chunk_key(last)}
    else:  # killed while freeing iteration last + 1's slot
        open_slot, allowed = (last + 1) % nslots, {None, expected[(last + 1) % nslots]}

    ns = namespace_dir(root, fp)
    before = {n: os.stat(os.path.join(ns, n)) for n in os.listdir(ns)}
    for writer in (False, True):  # the reader first: it must cope with the torn tail untouched
        if writer:
            after = {n: os.stat(os.path.join(ns, n)) for n in os.listdir(ns)}
            assert {n: (st.st_size, st.st_mtime_ns) for n, st in after.items()} == {
                n: (st.st_size, st.st_mtime_ns) for n, st in before.items()
            }, "a reader changed the namespace"
        with ChunkStore(root, fp, capacity_bytes=nslots * 3 * SEG, writer=writer) as st:
            seen = verify_all(st)
            for s in range(nslots):
                if s == open_slot:
                    assert seen.get(s) in allowed
                else:
                    assert seen.get(s) == expected[s], f"slot {s}: durable chunk lost or stale"
    # and the store keeps working after the crash
    with ChunkStore(root, fp, capacity_bytes=nslots * 3 * SEG, writer=True) as st:
        store_chunk(st, open_slot, b"after-crash")
        assert verify_all(st)[open_slot] == b"after-crash"
    # journal_compact_min_bytes=0 in the child: its journal must have been compacted along the way
    steps = sum(1 for k, _ in lines if k == "P")
    return {"steps": steps, "compactions": _journal_was_compacted(root, fp, steps)}


def _journal_was_compacted(root: str, fp: Fingerprint, steps: int) -> bool:
    size = os.path.getsize(os.path.join(namespace_dir(root, fp), "journal.bin"))
    return size < steps * 100  # one put + one free per step is > 100 B: a smaller file was compacted


# ---- a full disk ----------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill up (needs root/CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: str) -> None:
    """Take every free block of the filesystem."""
    block = bytes(4096)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return


def test_full_disk_fails_cleanly_and_recovers(small_fs):
    fp = make_fp(segment_bytes=16 * 4096, content_bytes=16 * 4096)  # 192 KiB slots
    root = os.path.join(small_fs, "store")
    cap = 16 * fp.num_layers * fp.segment_bytes
    ballast = os.path.join(small_fs, "ballast")
    with open(ballast, "wb") as f:
        f.write(bytes(400 << 10))  # room we can give back later
    st = ChunkStore(root, fp, capacity_bytes=cap, writer=True, slots_per_slab=4)
    stored = []
    with pytest.raises(OSError) as info:
        for s in range(st.num_slots):
            store_chunk(st, s, chunk_key(s))
            stored.append(s)
    assert info.value.errno == errno.ENOSPC
    failed = len(stored)
    assert 1 <= failed < st.num_slots
    assert sorted(st.entries()) == stored  # the slot whose data did not fit has no put
    verify_all(st)
    with ChunkStore(root, fp, capacity_bytes=cap, writer=False) as rd:
        assert verify_all(rd) == {s: chunk_key(s) for s in stored}

    # rewriting an existing slot in place needs no new blocks: stores continue on a full disk
    store_chunk(st, 0, chunk_key(100))
    assert verify_all(st)[0] == chunk_key(100)
    durable_state = {s: k for s, k in verify_all(st).items()}

    # now the journal itself hits the full disk
    filler = os.path.join(small_fs, "filler")
    _fill(filler)
    with pytest.raises(OSError) as info:
        for i in range(400):  # each free record is ~25 B: the journal soon needs a new block
            st.record_free([0])
            st.sync_journal()
            durable_state.pop(0, None)
    assert info.value.errno == errno.ENOSPC
    jpath = st.stats().journal_path
    assert os.path.getsize(jpath) == st.stats().journal_bytes  # nothing half-written is left
    with ChunkStore(root, fp, capacity_bytes=cap, writer=False) as rd:
        assert verify_all(rd) == durable_state

    # give space back: the pending record lands and new slots are stored again
    os.unlink(filler)
    os.unlink(ballast)
    st.sync_journal()
    durable_state.pop(0, None)
    for s in (failed, failed + 1):
        store_chunk(st, s, chunk_key(s))
        durable_state[s] = chunk_key(s)
    assert verify_all(st) == durable_state
    st.close()
    with ChunkStore(root, fp, capacity_bytes=cap, writer=True) as st:
        assert verify_all(st) == durable_state
