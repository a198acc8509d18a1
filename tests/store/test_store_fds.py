"""Slab descriptors: bounded, never closed under IO that holds them, synced after a close."""

from __future__ import annotations

import os

import pytest

from tutti.store.chunk_store import ChunkStore

from test_chunk_store import SEG, chunk_key, make_fp


def open_store(root, **kw):
    fp = make_fp()
    return ChunkStore(str(root), fp, capacity_bytes=16 * 3 * SEG, writer=True, slots_per_slab=1, **kw)


def test_descriptors_are_bounded_least_recently_used_first(tmp_path):
    with open_store(tmp_path, max_open_slabs=3) as st:
        for s in range(10):
            st.location(s, 0)
        assert st.open_slabs == 3 and st.slabs_closed == 7
        fd9 = st.location(9, 0)[0]
        st.location(0, 0)  # reopens slab 0 and closes the least recently used (7), not 9
        assert st.location(9, 0)[0] == fd9 and st.slabs_closed == 8


def test_an_acquired_descriptor_is_never_closed_until_released(tmp_path):
    with open_store(tmp_path, max_open_slabs=1) as st:
        fd, off = st.acquire(0, 1)
        ino = os.fstat(fd).st_ino
        for s in range(1, 8):
            st.location(s, 0)
        # still slab 0's descriptor: the number was not closed and reused by another slab
        assert os.fstat(fd).st_ino == ino == os.stat(st.slab_path(0)).st_ino
        assert st.open_slabs == 2
        closed = st.slabs_closed
        st.release(0)  # now it may go
        assert st.open_slabs == 1 and st.slabs_closed == closed + 1


def test_data_written_through_a_closed_descriptor_is_synced(tmp_path, monkeypatch):
    synced = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd))[1])
    with open_store(tmp_path, max_open_slabs=1) as st:
        fd, off = st.acquire(0, 0)
        os.pwrite(fd, b"x" * SEG, off)
        st.release(0)
        st.location(1, 0)  # closes slab 0's descriptor
        assert st.slabs_closed == 1
        st.sync_data([0])  # opens slab 0 again to sync it
        assert os.stat(st.slab_path(0)).st_ino in synced
        st.record_put(chunk_key(0), 0, [1, 2, 3])
        st.sync_journal()


def test_max_open_slabs_is_validated(tmp_path):
    with pytest.raises(ValueError, match="max_open_slabs=0"):
        open_store(tmp_path, max_open_slabs=0)
