"""Hybrid models (several KV cache groups: full and sliding-window attention) through the real
worker pipeline: each layer's blocks come from its group's block list, a sliding-window group's
blocks before the window (vLLM's null block, id 0) are never written, and a failed load reports
every group's real blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk
from tutti.engine.sched.planner import Planner
from tutti.engine.build import build_worker
from tutti.kernels import PagedLayout

from worker_helpers import B, L, config, geometry, make_caches, run_step, views

GROUPS = "0:sw64,1:full,0:sw64"  # layers 0 and 2 in a sliding-window group, layer 1 full attention


def hybrid_geometry():
    return replace(geometry(), groups=GROUPS)


def worker(root, caches, **kw):
    v = views(caches)
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    return build_worker(config(root, **kw), hybrid_geometry(), caches=v, layout=layout)


def test_each_layer_moves_its_groups_blocks_and_never_the_null_block(tmp_path):
    assert L == 3 and hybrid_geometry().group_of_layer == [0, 1, 0]
    src = make_caches(0)
    w = worker(tmp_path, src)
    # chunk blocks: group 0 (2, 3), then group 1 (10, 11)
    run_step(w, StepPlan(1, stores=[StoreChunk("r", b"k" * 32, 4, (2, 3, 10, 11), ticket=1)]))
    w.flush()
    assert w.take_report().stored == [1]
    w.close()
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst)
    # the sliding-window group lost the chunk's first block (null block 0); full attention has both
    run_step(w, StepPlan(2, loads=[LoadChunk("q", b"k" * 32, 4, (0, 5, 12, 13))]))
    assert w.take_failed_blocks() == set()
    for layer in (0, 2):
        assert torch.equal(dst[layer][5], src[layer][3])  # the window's block, from group 0's list
        assert torch.equal(dst[layer][0], before[layer][0])  # the null block is never written
        assert torch.equal(dst[layer][[12, 13]], before[layer][[12, 13]])  # group 1's blocks: not this layer's
    assert torch.equal(dst[1][[12, 13]], src[1][[10, 11]])
    assert torch.equal(dst[1][[0, 5]], before[1][[0, 5]])
    w.close()


def test_a_failed_hybrid_load_reports_every_groups_real_blocks(tmp_path):
    w = worker(tmp_path, make_caches(1))
    run_step(w, StepPlan(2, loads=[LoadChunk("q", b"missing" * 4 + b"0000", 7, (0, 5, 12, 13))]))
    assert w.take_failed_blocks() == {5, 12, 13}
    w.close()


def test_the_planner_keeps_one_block_list_per_group_and_stores_only_whole_chunks(tmp_path):
    p = Planner(num_slots=16, chunk_tokens=32, block_size=16, seed=b"s" * 32, num_groups=2)
    toks = list(range(100, 100 + 3 * 32 + 1))
    assert p.match("r", toks, 0) == 0
    p.on_alloc("r", ([1, 2, 3, 4], [20, 21, 22, 23]), 0)
    plan = p.build_step({"r": 64}, {"r": 0})
    assert [st.block_ids for st in plan.stores] == [(1, 2, 20, 21), (3, 4, 22, 23)]
    # the next chunk: its sliding-window blocks were already dropped (null): not stored
    p.update_request("r", new_block_ids=([0, 0], [24, 25]))
    p.update_request("r", all_block_ids=([0, 0, 0, 0, 0, 6], [20, 21, 22, 23, 24, 25]))
    plan = p.build_step({"r": 33}, {"r": 64})
    assert plan.stores == [] and p.stats.stores_declined == 1
    with pytest.raises(ValueError, match="block ids for 1 KV cache groups; this planner has 2"):
        p.on_alloc("r", [1, 2], 0)


def store_two_chunks(root):
    """Chunks a (slot 1) and b (slot 2), each with two blocks per group; returns the caches."""
    src = make_caches(0)
    w = worker(root, src)
    run_step(w, StepPlan(1, stores=[StoreChunk("r", b"a" * 32, 1, (2, 3, 10, 11), ticket=1),
                                    StoreChunk("r", b"b" * 32, 2, (4, 5, 14, 15), ticket=2)]))
    w.flush()
    w.close()
    return src


def test_a_sliding_window_layer_reads_only_the_chunks_inside_its_window(tmp_path):
    """Two chunks hit; the sliding-window group holds only the second one's blocks: its layers read
    one segment each, the full-attention layer both (4 reads, not 6)."""
    from worker_helpers import RecordingQueue

    src = store_two_chunks(tmp_path)
    dst = make_caches(1)
    w = worker(tmp_path, dst, staging_bytes=16 * 4096, staging_slots=16)  # one segment a slot: one read a segment
    w.queue = RecordingQueue(w.queue)
    loads = [LoadChunk("q", b"a" * 32, 1, (0, 0, 12, 13)), LoadChunk("q", b"b" * 32, 2, (6, 7, 16, 17))]
    run_step(w, StepPlan(2, loads=loads))
    assert w.take_failed_blocks() == set() and w.queue.reads == 4
    for layer in (0, 2):
        assert torch.equal(dst[layer][[6, 7]], src[layer][[4, 5]])
    assert torch.equal(dst[1][[12, 13, 16, 17]], src[1][[10, 11, 14, 15]])
    w.close()


def test_asynchronous_loads_report_each_request_received_or_failed(tmp_path):
    """Hybrid hits load asynchronously: on their own thread and stream, the outcome per request
    (vLLM recomputes a failed one); their pins are released under the plan's async step."""
    src = store_two_chunks(tmp_path)
    slab = next(tmp_path.rglob("slab-*.bin"))
    with open(slab, "r+b") as f:  # damage chunk b (slot 2), layer 1
        off = 2 * hybrid_geometry().slot_bytes + hybrid_geometry().segment_bytes + 7
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0x20]))
    dst = make_caches(1)
    w = worker(tmp_path, dst)
    plan = StepPlan(2, async_step=3, async_loads=[LoadChunk("ok", b"a" * 32, 1, (6, 7, 12, 13)),
                                                 LoadChunk("bad", b"b" * 32, 2, (8, 9, 16, 17))])
    run_step(w, plan)
    w.flush()
    assert w.received_requests() == ({"ok"}, {"bad"}, {8, 9, 16, 17})  # the blocks the bad chunk writes
    assert w.take_failed_blocks() == set()  # the step's own loads: none (the connector reports these per request)
    rep = w.take_report()
    assert 3 in rep.steps_done and rep.load_failed == [b"b" * 32]
    for layer in (0, 2):
        assert torch.equal(dst[layer][[6, 7]], src[layer][[2, 3]])
    assert torch.equal(dst[1][[12, 13]], src[1][[10, 11]])
    w.close()


def test_state_groups_store_a_state_only_where_a_step_ends_on_a_chunk_boundary(tmp_path):
    """Group 0: a Mamba state group ('align': column i holds the state after block i), group 1
    full attention; chunks of 2 blocks. A chunk entry carries the attention blocks (the state
    group's null), a state entry only the state column at the chunk's end."""
    from tutti.engine.keys import state_key
    from tutti.engine.plan import NULL_BLOCK as N

    p = Planner(num_slots=32, chunk_tokens=32, block_size=16, seed=b"s" * 32, num_groups=2, state_groups=[0])
    toks = list(range(100, 100 + 3 * 32 + 5))
    assert p.match("r", toks, 0) == 0
    p.on_alloc("r", ([N, 7, N, 8, N, 9, N], [1, 2, 3, 4, 5, 6, 10]), 0)
    plan = p.build_step({"r": 32}, {"r": 0})  # ends on chunk 0's end: chunk 0 and its state
    keys = p._reqs["r"].keys
    assert [(st.key, st.block_ids) for st in plan.stores] == [(keys[0], (N, N, 1, 2)),
                                                              (state_key(keys[0]), (N, 7, N, N))]
    plan = p.build_step({"r": 40}, {"r": 32})  # ends at 72, inside chunk 2: chunk 1, no state
    assert [(st.key, st.block_ids) for st in plan.stores] == [(keys[1], (N, N, 3, 4))]
    plan = p.build_step({"r": 24}, {"r": 72})  # ends at 96 = chunk 2's end: chunk 2 and its state
    assert [st.key for st in plan.stores] == [keys[2], state_key(keys[2])]
    assert plan.stores[1].block_ids == (N, 9, N, N)
    from tutti.engine.plan import WorkerReport

    p.on_report(WorkerReport(stored=list(range(1, 6))))
    assert p.stats.stores_committed == 5
    # a hit ends on the last chunk whose state is stored: 3 chunks (state at 96)...
    assert p.match("s", toks, 0) == 96
    p.on_alloc("s", ([N, N, N, N, N, 31, N], [21, 22, 23, 24, 25, 26, 27]), 96, async_load=True)
    plan = p.build_step({}, {})
    assert [(ld.key, ld.block_ids) for ld in plan.async_loads] == [
        (keys[0], (N, N, 21, 22)), (keys[1], (N, N, 23, 24)), (keys[2], (N, N, 25, 26)),
        (state_key(keys[2]), (N, 31, N, N))]
    # ...and without the state at 96 it falls back to the one at 32, never to chunk 1 (no state)
    p2 = Planner(num_slots=8, chunk_tokens=32, block_size=16, seed=b"s" * 32, num_groups=2, state_groups=[0])
    p2.rebuild({i: k for i, k in enumerate(keys[:3] + [state_key(keys[0])])})
    assert p2.match("t", toks, 0) == 32
    p3 = Planner(num_slots=8, chunk_tokens=32, block_size=16, seed=b"s" * 32, num_groups=2, state_groups=[0])
    p3.rebuild({i: k for i, k in enumerate(keys[:3])})  # chunks without any state: no hit at all
    assert p3.match("u", toks, 0) == 0


def test_state_entries_move_only_their_layers(tmp_path):
    """Groups: layers 0 and 2 a Mamba state group, layer 1 full attention. A chunk entry writes
    only layer 1's segment, a state entry only layers 0 and 2 (the state in the last block
    position); unwritten segments are journaled 0; a state load writes only the state block."""
    geom = replace(geometry(), groups="0:state,1:full,0:state")
    src = make_caches(0)
    v = views(src)
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    w = build_worker(config(tmp_path), geom, caches=v, layout=layout)
    # chunk entry: state group null, attention blocks 10, 11; state entry: state in block 3
    run_step(w, StepPlan(1, stores=[StoreChunk("r", b"c" * 32, 1, (0, 0, 10, 11), ticket=1),
                                    StoreChunk("r", b"s" * 32, 2, (0, 3, 0, 0), ticket=2)]))
    w.flush()
    rep = w.take_report()
    assert sorted(rep.stored) == [1, 2] and rep.bytes_stored == 3 * w.ctx.seg  # 1 + 2 segments, not 6
    sums = {s: e.checksums for s, e in w.store.entries().items()}
    assert sums[1][0] == sums[1][2] == 0 and sums[1][1] != 0
    assert sums[2][1] == 0 and sums[2][0] != 0 and sums[2][2] != 0
    w.close()
    dst = make_caches(1)
    before = [c.clone() for c in dst]
    w = build_worker(config(tmp_path), geom, caches=views(dst), layout=layout)
    run_step(w, StepPlan(2, loads=[LoadChunk("q", b"c" * 32, 1, (0, 0, 20, 21)),
                                   LoadChunk("q", b"s" * 32, 2, (0, 7, 0, 0))]))
    assert w.take_failed_blocks() == set()
    assert torch.equal(dst[1][[20, 21]], src[1][[10, 11]])
    for layer in (0, 2):
        assert torch.equal(dst[layer][7], src[layer][3])  # the state, into the column vLLM reads
        others = [b for b in range(B) if b != 7]
        assert torch.equal(dst[layer][others], before[layer][others])  # nothing else written
    assert torch.equal(dst[1][[0, 7]], before[1][[0, 7]])
    w.close()
