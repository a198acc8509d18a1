"""Tensor parallelism at the engine level: one WorkerPipeline per rank over real files, the
planner counting ranks, and MLA's latent cache stored once (by TP rank 0) and read by every rank.

vLLM's CPU build runs no MLA model here, so the MLA half drives the engine directly, the way
the connector does: one build_worker per rank, the same StepPlan to each, reports merged.
"""

import pickle

import torch

from tutti.engine.keys import chunk_keys
from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk, WorkerReport
from tutti.engine.build import Geometry, build_planner, build_worker
from tutti.store.chunk_store import list_namespaces
from tutti.kernels import PagedLayout

from worker_helpers import run_step

L, B, N, D = 2, 16, 16, 32  # layers, blocks, tokens/block, head size (MHA) / latent size (MLA)
H = 1  # KV heads per rank (a 2-head model split over TP=2)
T = 32  # chunk tokens: 2 blocks


def mha_geom(tp_rank=0, tp_size=2):
    return Geometry(model="tiny", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L,
                    num_heads=H, content_bytes=2 * D * 4, tp_rank=tp_rank, tp_size=tp_size)


def mla_geom(tp_rank=0, tp_size=2):
    return Geometry(model="tiny-mla", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L,
                    num_heads=1, content_bytes=D * 4, tp_rank=tp_rank, tp_size=tp_size, kv_replicated=True)


def config(root, geom, **kw):
    cfg = {"root": str(root), "capacity_bytes": 16 * geom.slot_bytes, "chunk_tokens": T,
           "staging_bytes": 8 * 8192, "staging_slots": 8, "max_inflight_stores": 4, "lookahead": 1}
    cfg.update(kw)
    return cfg


def mha_caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, 2 * D, generator=g) for _ in range(L)]  # vLLM CPU: [B, H, N, K|V rows]


def mla_caches(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, D, generator=g) for _ in range(L)]  # one latent row per token


def mha_worker(root, geom, caches, **kw):
    v = [c.as_strided((B, H, 2, N, D), (c.stride(0), c.stride(1), N * D, D, 1)) for c in caches]
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    return build_worker(config(root, geom, **kw), geom, caches=v, layout=layout, rank=geom.tp_rank)


def mla_worker(root, geom, caches, **kw):
    layout = PagedLayout.from_tensor(caches[0], ("block", "token", "dim"))
    return build_worker(config(root, geom, **kw), geom, caches=caches, layout=layout, rank=geom.tp_rank)


def step_all(workers, plan):
    """What vLLM does with TP: every rank gets the same (pickled) plan; reports are merged."""
    for w in workers:
        run_step(w, pickle.loads(pickle.dumps(plan)))
    for w in workers:
        w.flush()
    rep = WorkerReport(workers=0)
    for w in workers:
        rep = rep.merge(w.take_report())
    return rep


def plan_request(planner, req_id, tokens, blocks):
    """Drive the planner like the connector: lookup, allocation, one step computing every token."""
    n = planner.match(req_id, tokens, 0)
    planner.on_alloc(req_id, blocks, n)
    planner.update_request(req_id, tokens=tokens, all_block_ids=blocks)
    return planner.build_step({req_id: len(tokens) - n}, {req_id: n}), n


def test_chunk_is_resident_only_once_every_rank_committed(tmp_path):
    caches = [mha_caches(0), mha_caches(1)]  # each rank holds a different shard
    w0 = mha_worker(tmp_path, mha_geom(0), caches[0])
    # rank 1's store staging is full (another store still in flight): this step's stores are skipped there
    w1 = mha_worker(tmp_path, mha_geom(1), caches[1])
    busy = w1.stores.arena.take(w1.store_regions)
    planner = build_planner(config(tmp_path, mha_geom()), mha_geom())
    assert planner.num_workers == planner.num_writers == 2
    tokens = list(range(4, 4 + 2 * T + 1))
    keys = chunk_keys(tokens, T, planner.seed)
    plan, hit = plan_request(planner, "r", tokens, list(range(5)))
    assert hit == 0 and len(plan.stores) == 2
    # ranks report in separate steps: one rank's success alone must not make a chunk resident
    run_step(w0, pickle.loads(pickle.dumps(plan)))
    w0.flush()
    rep0 = w0.take_report()
    assert len(rep0.stored) == 2
    planner.on_report(rep0)
    assert len(planner.index) == 0 and planner.stats.stores_committed == 0
    run_step(w1, pickle.loads(pickle.dumps(plan)))
    w1.flush()
    for first, count in busy:
        w1.stores.arena.release(first, count)
    rep1 = w1.take_report()
    assert rep1.stored == [] and len(rep1.store_failed) == 2 and rep1.stores_skipped == 2
    planner.on_report(rep1)
    assert len(planner.index) == 0 and planner.stats.stores_failed == 2
    # every rank reports the request finished (vLLM frees its blocks once all ranks did),
    # including the rank that skipped its stores
    assert planner.finished("r") is True
    assert w0.finished_requests({"r"}) == {"r"} and w1.finished_requests({"r"}) == {"r"}
    w1.close()
    # with room on both ranks the same chunks become resident once both committed
    w1 = mha_worker(tmp_path, mha_geom(1), caches[1])
    plan, hit = plan_request(planner, "s", tokens, list(range(5)))
    assert hit == 0 and len(plan.stores) == 2
    planner.on_report(step_all([w0, w1], plan))
    assert planner.index.lookup_prefix(keys[:2]) == 2 and planner.stats.stores_committed == 2
    w0.close(), w1.close()
    # restart: the rebuilt index keeps only what both ranks' journals hold
    again = build_planner(config(tmp_path, mha_geom()), mha_geom())
    assert again.index.lookup_prefix(keys[:2]) == 2 and len(again.index) == 2
    assert sorted(ns.manifest["fingerprint"]["tp_rank"] for ns in list_namespaces(str(tmp_path))) == [0, 1]


def test_a_load_failure_on_one_rank_drops_the_chunk(tmp_path):
    src = [mha_caches(0), mha_caches(1)]
    ws = [mha_worker(tmp_path, mha_geom(r), src[r]) for r in range(2)]
    planner = build_planner(config(tmp_path, mha_geom()), mha_geom())
    tokens = list(range(4, 4 + 2 * T + 1))
    plan, _ = plan_request(planner, "a", tokens, list(range(5)))
    planner.on_report(step_all(ws, plan))
    planner.finished("a")
    assert len(planner.index) == 2
    # corrupt layer 1 of the first chunk on rank 1 only
    slot = plan.stores[0].slot
    _, off = ws[1].store.location(slot, 1)
    with open(ws[1].store.slab_path(slot), "r+b") as f:
        f.seek(off + 100)
        f.write(b"\xff" * 64)
    for w in ws:
        w.close()
    dst = [mha_caches(2), mha_caches(3)]
    ws = [mha_worker(tmp_path, mha_geom(r), dst[r]) for r in range(2)]
    plan, hit = plan_request(planner, "b", tokens, list(range(8, 13)))
    assert hit == 2 * T and len(plan.loads) == 2
    for w in ws:
        run_step(w, plan)
    failed = [w.take_failed_blocks() for w in ws]
    # rank 0 loaded good data, rank 1 found the corruption: vLLM unions the ranks' invalid blocks
    # and recomputes them everywhere, so rank 0 overwriting its good copy is harmless
    assert failed[0] == set() and failed[1] == {8, 9}
    for r in range(2):
        assert torch.equal(dst[r][0][[10, 11]], src[r][0][[2, 3]])  # the second chunk loaded on both
    rep = WorkerReport(workers=0)
    for w in ws:
        rep = rep.merge(w.take_report())
    planner.on_report(rep)
    assert planner.stats.loads_failed == 1
    keys = chunk_keys(tokens, T, planner.seed)
    assert keys[0] not in planner.index and keys[1] in planner.index  # dropped on every rank
    assert ("removed", [keys[0]]) in planner.take_events()
    for w in ws:
        w.close()
    # rank 1 journaled the slot free; rank 0 still holds it, but a rank alone is not a hit
    assert keys[0] not in build_planner(config(tmp_path, mha_geom()), mha_geom()).index


def test_mla_latent_is_stored_once_and_every_rank_reads_it(tmp_path):
    geoms = [mla_geom(0), mla_geom(1)]
    assert geoms[0].fingerprint() == geoms[1].fingerprint()  # no tp_rank: one shared namespace
    assert (geoms[0].writes, geoms[1].writes, geoms[0].num_writers) == (True, False, 1)
    src = mla_caches(0)
    # the reader starts first: the writer's namespace does not exist yet
    r1 = mla_worker(tmp_path, geoms[1], [c.clone() for c in src])
    w0 = mla_worker(tmp_path, geoms[0], src)
    planner = build_planner(config(tmp_path, geoms[0]), geoms[0])
    assert planner.num_workers == 2 and planner.num_writers == 1
    tokens = list(range(4, 4 + 2 * T + 1))
    plan, _ = plan_request(planner, "a", tokens, list(range(5)))
    rep = step_all([w0, r1], plan)
    assert len(rep.stored) == 2 and rep.steps_done == [plan.step, plan.step]  # stores from rank 0 only
    planner.on_report(rep)
    assert len(planner.index) == 2 and planner.stats.stores_committed == 2
    assert planner.finished("a")
    assert w0.finished_requests({"a"}) == {"a"} and r1.finished_requests({"a"}) == {"a"}
    nss = list_namespaces(str(tmp_path))
    assert len(nss) == 1 and nss[0].manifest["fingerprint"]["tp_rank"] == 0
    # both ranks load from rank 0's namespace into fresh blocks (the reader follows the journal)
    dst = [mla_caches(1), mla_caches(2)]
    w0.caches[:], r1.caches[:] = dst  # rebind the pipelines to fresh caches of the same shape
    plan, hit = plan_request(planner, "b", tokens, list(range(8, 13)))
    assert hit == 2 * T
    rep = step_all([w0, r1], plan)
    assert not rep.load_failed and w0.take_failed_blocks() == set() == r1.take_failed_blocks()
    for d in dst:
        for layer in range(L):
            assert torch.equal(d[layer][8:12], src[layer][0:4])
    w0.close(), r1.close()
    # restart: the index is rebuilt from the one writer namespace
    assert len(build_planner(config(tmp_path, geoms[0]), geoms[0]).index) == 2


def test_mla_reader_follows_a_chunk_stored_again_in_the_same_slot(tmp_path):
    """The writer evicted a chunk and stored the same key in the same slot with other bytes:
    a reader whose journal copy is stale must re-read it, not report a checksum failure."""
    geoms = [mla_geom(0), mla_geom(1)]
    a, b = mla_caches(0), mla_caches(5)
    w0 = mla_worker(tmp_path, geoms[0], a)
    r1 = mla_worker(tmp_path, geoms[1], mla_caches(9))
    key = bytes(range(32))
    run_step(w0, StepPlan(1, stores=[StoreChunk("x", key, 3, (0, 1), ticket=1)]))
    w0.flush()
    run_step(r1, StepPlan(2, loads=[LoadChunk("y", key, 3, (4, 5))]))  # the reader learns checksums
    assert r1.take_failed_blocks() == set()
    w0.caches[:] = b
    run_step(w0, StepPlan(3, stores=[StoreChunk("x", key, 3, (0, 1), ticket=2)]))
    w0.flush()
    assert w0.take_report().stored == [1, 2]
    run_step(r1, StepPlan(4, loads=[LoadChunk("y", key, 3, (6, 7))]))
    assert r1.take_failed_blocks() == set() and not r1.take_report().load_failed
    for layer in range(L):
        assert torch.equal(r1.caches[layer][6:8], b[layer][0:2])
    w0.close(), r1.close()


def test_plans_and_reports_pickle():
    plan = StepPlan(7, loads=[LoadChunk("r", b"k" * 32, 1, (1, 2), 1)],
                    stores=[StoreChunk("r", b"q" * 32, 2, (3, 4), ticket=9)], preempted=["z"])
    assert pickle.loads(pickle.dumps(plan)) == plan
    rep = WorkerReport(stored=[9], load_failed=[b"k" * 32], steps_done=[7], bytes_loaded=5)
    assert pickle.loads(pickle.dumps(rep)) == rep
