"""What tutti relies on from a file system, checked on a real GlusterFS volume through two FUSE
mounts (two nodes): the writer's LOCK flock excludes the other node and dies with its holder,
fcntl locks too, a rename replaces a file atomically for the other node's readers, O_DIRECT
opens (or open_direct falls back), tutti's threads and io_uring queues read the other node's
writes bit-exact, and a journal append made durable on one node is followed on the other."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import gluster

# a fresh process holds the lock, as another server would (locks of one process are its own)
HOLD = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
(fcntl.flock if sys.argv[2] == "flock" else fcntl.lockf)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("HELD", flush=True)
time.sleep(600)
"""


def _try_lock(path, kind: str) -> bool:
    fd = os.open(path, os.O_RDWR)
    try:
        (fcntl.flock if kind == "flock" else fcntl.lockf)(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        assert exc.errno in (errno.EAGAIN, errno.EACCES), exc
        return False
    finally:
        os.close(fd)


def test_the_volume_is_up_on_both_nodes(cluster, on_volume):
    a, b = on_volume
    assert gluster.fs_type_of(cluster.mounts["a"]) == gluster.fs_type_of(cluster.mounts["b"]) == "fuse.glusterfs"
    (a / "hello").write_bytes(b"from a")
    assert (b / "hello").read_bytes() == b"from a"
    assert cluster.bringup_s["total"] < 60, cluster.bringup_s


@pytest.mark.parametrize("kind", ["flock", "fcntl"])
def test_a_lock_held_on_one_node_excludes_the_other_and_dies_with_its_holder(on_volume, kind):
    """tutti's writer LOCK is an flock (tutti.store.namespace): a second server with the same
    writer id on another node must be refused, and a server killed with -9 must not keep it."""
    a, b = on_volume
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(a / "LOCK"), kind], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        assert not _try_lock(b / "LOCK", kind), f"{kind}: node b took the lock node a holds"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        t0 = time.monotonic()
        while not _try_lock(b / "LOCK", kind):
            assert time.monotonic() - t0 < 10, f"{kind}: the killed holder's lock was not released within 10 s"
            time.sleep(0.05)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_tutti_refuses_a_second_writer_of_one_slot_on_the_other_node(on_volume):
    from tutti.store.chunk_store import ChunkStore, StoreLockedError
    from tutti.store.fingerprint import Fingerprint

    a, b = on_volume
    fp = Fingerprint(model="m", cache_dtype="bfloat16", format_version=1, chunk_tokens=16, num_layers=2,
                     num_heads=2, content_bytes=4096, segment_bytes=8192, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    with ChunkStore(str(a), fp, capacity_bytes=1 << 20, writer=True):
        with pytest.raises(StoreLockedError):
            ChunkStore(str(b), fp, capacity_bytes=1 << 20, writer=True)
        with ChunkStore(str(b), fp, capacity_bytes=1 << 20, writer=True, writer_id="other") as other:
            assert other.entries() == {}
    # released with its store; the release reaches the other node's client a moment later (the
    # same lag the killed holder's release shows above), so the second writer retries within 10 s
    t0 = time.monotonic()
    while True:
        try:
            with ChunkStore(str(b), fp, capacity_bytes=1 << 20, writer=True):
                break
        except StoreLockedError:
            assert time.monotonic() - t0 < 10, "the closed store's lock was not released within 10 s"
            time.sleep(0.05)


def test_a_rename_replaces_the_file_atomically_for_the_other_nodes_readers(on_volume):
    """Journal compaction and manifests rename a finished temp over the live name: a reader on the
    other node opening that name sees the old file or the new one, whole, never a mix. Not at once:
    its client caches the name's inode (entry-timeout, 1 s by default), so it may open the file the
    rename replaced (still whole) until then; the newest is read within a few seconds. And not
    always: on a distributed volume an open racing a rename can find no file at all (rarely: about
    one open in several thousand here); tutti's journal follower takes that as an empty journal
    until its next follow (a missed hit, never a wrong one: the next test)."""
    a, b = on_volume
    n, size = 150, 64 << 10
    (a / "journal.bin").write_bytes(bytes([0]) * size)
    stop = threading.Event()
    seen: dict[str, int] = {"whole": 0, "missing": 0, "torn": 0}

    def read_loop():
        while not stop.is_set():
            try:
                data = (b / "journal.bin").read_bytes()
            except FileNotFoundError:
                seen["missing"] += 1
                continue
            seen["whole" if len(data) == size and data == data[:1] * size else "torn"] += 1

    t = threading.Thread(target=read_loop)
    t.start()
    try:
        for i in range(1, n + 1):
            tmp = a / "journal.bin.compact"
            with open(tmp, "wb") as f:
                f.write(bytes([i % 256]) * size)
                os.fsync(f.fileno())
            os.rename(tmp, a / "journal.bin")
    finally:
        stop.set()
        t.join()
    assert seen["whole"] > 0 and seen["torn"] == 0, seen
    t0 = time.monotonic()
    while True:
        try:
            if (b / "journal.bin").read_bytes() == bytes([n % 256]) * size:
                break
        except FileNotFoundError:
            seen["missing"] += 1
        assert time.monotonic() - t0 < 5, "node b still reads a replaced file 5 s after the rename"
        time.sleep(0.02)
    print(f"\nnode b read the renamed file {time.monotonic() - t0:.2f} s after the last rename; during {n} renames "
          f"{seen['whole']} whole reads, {seen['missing']} found no file, none torn")


def _queue_roundtrip(backend: str, a, b) -> bool:
    """Write 8 MiB through the backend on node a, read it back through node b; returns whether the
    files were opened with O_DIRECT."""
    from tutti.io.buffers import aligned_buffer
    from tutti.io.queue import IORequest, open_queue, submit_all, wait_all

    size, io = 8 << 20, 1 << 20
    q = open_queue(backend)
    try:
        src = aligned_buffer(size, pin=False)
        src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))
        fd = q.open_file(a / f"slab-{backend}.bin", write=True, create=True)
        wait_all(submit_all(q, [IORequest(fd, o, src, o, io, op="write") for o in range(0, size, io)]))
        os.fdatasync(fd)
        os.close(fd)
        dst = aligned_buffer(size, pin=False)
        fd = q.open_file(b / f"slab-{backend}.bin")
        wait_all(submit_all(q, [IORequest(fd, o, dst, o, io) for o in range(0, size, io)]))
        os.close(fd)
        assert torch.equal(src, dst), f"{backend}: node b read other bytes than node a wrote"
        return q.caps().direct_io
    finally:
        q.close()


def test_o_direct_through_the_mount_or_the_buffered_fallback(on_volume):
    """open_direct (tutti.io.buffers) asks for O_DIRECT and opens buffered where the file system
    refuses it with EINVAL; either way an aligned write on one node reads back on the other."""
    from tutti.io.buffers import open_direct

    a, b = on_volume
    fd, direct = open_direct(a / "d.bin", write=True, create=True)
    os.close(fd)
    print(f"\nO_DIRECT through the GlusterFS FUSE mount: {'accepted' if direct else 'refused (buffered fallback)'}")
    assert _queue_roundtrip("threads", a, b) in (True, False)


def test_io_uring_reads_through_the_mount(on_volume):
    a, b = on_volume
    from tutti.io.queue import open_queue

    try:
        open_queue("uring").close()
    except Exception as exc:  # noqa: BLE001: no io_uring on this kernel: nothing to check here
        pytest.skip(f"io_uring is not available here ({exc})")
    _queue_roundtrip("uring", a, b)


def test_a_journal_append_on_one_node_is_followed_on_the_other(on_volume):
    """The durable order tutti keeps (append, fsync) and the follower's open-stat-read of the
    journal: every record node a synced is read on node b; the delay is the client's attribute
    cache (1 s by default)."""
    from tutti.store.journal import Journal

    a, b = on_volume
    w = Journal(str(a / "journal.bin"), writer=True, expected_checksums=2)
    r = Journal(str(b / "journal.bin"), writer=False, expected_checksums=2)
    delays = []
    try:
        for i in range(4):
            w.append_put(bytes([i]) * 32, i, [i, i + 1])
            w.sync()
            t0 = time.monotonic()
            while i not in r.entries:
                r.follow()
                assert time.monotonic() - t0 < 5, f"record {i} not seen on node b within 5 s"
                time.sleep(0.01)
            delays.append(time.monotonic() - t0)
            assert r.entries[i].key == bytes([i]) * 32 and r.entries[i].checksums == (i, i + 1)
        w.append_free([0])
        w.sync()
        t0 = time.monotonic()
        while 0 in r.entries:
            r.follow()
            assert time.monotonic() - t0 < 5
            time.sleep(0.01)
        assert sorted(r.entries) == [1, 2, 3] and r.skipped_records == 0 and r.dropped_tail_bytes == 0
    finally:
        w.close()
        r.close()
    print(f"\njournal append on node a seen on node b after {', '.join(f'{d:.2f}' for d in delays)} s")


def test_the_other_nodes_follower_survives_compactions(on_volume):
    """A writer on node a that compacts its journal (a rename over journal.bin) on nearly every
    sync, a follower on node b following it all along: the follower never reads a torn or foreign
    record, and ends with the writer's entries."""
    from tutti.store.journal import Journal

    a, b = on_volume
    w = Journal(str(a / "journal.bin"), writer=True, expected_checksums=1, compact_ratio=1.5, compact_min_bytes=0)
    r = Journal(str(b / "journal.bin"), writer=False, expected_checksums=1)
    stop = threading.Event()
    bad: list[str] = []
    follows = [0]

    def follow_loop():
        while not stop.is_set():
            r.follow()
            follows[0] += 1
            if r.skipped_records or r.dropped_tail_bytes:
                bad.append(f"skipped {r.skipped_records}, torn {r.dropped_tail_bytes} B: {r.skipped_details}")
            for slot, e in r.entries.items():
                if e.key[:1] != bytes([slot]) or e.checksums != (int.from_bytes(e.key[1:3], "little"),):
                    bad.append(f"slot {slot}: {e}")

    t = threading.Thread(target=follow_loop)
    t.start()
    try:
        for i in range(120):
            slot = i % 4
            if slot in w.entries:
                w.append_free([slot])
            w.append_put(bytes([slot]) + i.to_bytes(2, "little") + bytes(29), slot, [i])
            w.sync()
    finally:
        stop.set()
        t.join()
    assert w.compactions >= 10, w.compactions
    t0 = time.monotonic()
    while r.entries != w.entries:
        assert time.monotonic() - t0 < 5, "node b's follower did not reach the writer's entries within 5 s"
        time.sleep(0.05)
        r.follow()
    assert not bad, bad[:5]
    print(f"\n{w.compactions} compactions on node a, {follows[0]} follows on node b, none read wrong")
    w.close()
    r.close()
