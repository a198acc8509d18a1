"""The medium seam (tutti.store.medium): a store whose slabs live in memory (memory_medium.py)
keeps the store's contract: the bytes written are the bytes read, nothing reaches a slab file,
and the namespace, lock and journal stay on the root. A real worker stores and loads through it
bit exact; an unknown medium is refused by the config before any IO."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.store.chunk_store import ChunkStore

from memory_medium import MemoryMedium
from test_chunk_store import SEG, chunk_key, layer_bytes, make_fp, pwrite_all

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "worker"))


def test_a_store_over_a_memory_medium_round_trips_and_writes_no_slab_file(tmp_path):
    with ChunkStore(str(tmp_path), make_fp(), capacity_bytes=8 * 3 * SEG, writer=True, medium=MemoryMedium()) as st:
        key = chunk_key(5)
        for layer in range(3):
            fd, off = st.location(5, layer)
            pwrite_all(fd, layer_bytes(key, layer, SEG), off)
        st.record_free([5])
        st.sync_journal()
        st.sync_data([5])
        st.record_put(key, 5, [1, 2, 3])
        st.sync_journal()
        for layer in range(3):
            fd, off = st.location(5, layer)
            assert os.pread(fd, SEG, off) == layer_bytes(key, layer, SEG)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert "journal.bin" in files and "manifest.json" in files
    assert not [f for f in files if f.startswith("slab-")]


def test_a_worker_stores_and_loads_bit_exact_through_a_medium_named_in_the_config(tmp_path):
    from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk
    from worker_helpers import make_caches, run_step, worker

    src, dst = make_caches(0), make_caches(1)
    w = worker(tmp_path, src, medium="tests.store.memory_medium:MemoryMedium")
    try:
        run_step(w, StepPlan(1, stores=[StoreChunk("r", bytes([7]) * 32, 3, (0, 1), ticket=1)]))
        w.flush()
        assert w.take_report().stored == [1]
        for c in src:
            c.zero_()
        run_step(w, StepPlan(2, loads=[LoadChunk("q", bytes([7]) * 32, 3, (4, 5))]))
        assert w.take_failed_blocks() == set()
    finally:
        w.close()
    assert not list(tmp_path.rglob("slab-*.bin"))
    ref = make_caches(0)
    for s, r in zip(src, ref):
        assert torch.equal(s[[4, 5]], r[[0, 1]])


def test_an_unknown_medium_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="medium='tape'"):
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "medium": "tape"})
