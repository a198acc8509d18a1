import time

import pytest

from tutti.engine.keys import namespace_seed
from tutti.engine.plan import WorkerReport
from tutti.engine.sched.planner import Planner, rebuild_entries

T, BS = 64, 32  # chunk tokens, vLLM block size: 2 blocks a chunk


def planner(num_slots=16, workers=1):
    return Planner(num_slots=num_slots, chunk_tokens=T, block_size=BS, seed=namespace_seed("t"),
                   num_workers=workers, slot_bytes=4096)


def run_prefill(p, req, tokens, blocks, computed=0):
    p.match(req, tokens, computed)
    p.on_alloc(req, blocks, 0)
    p.update_request(req, tokens=tokens, all_block_ids=blocks)
    return p.build_step({req: len(tokens) - computed}, {req: computed})


def test_store_only_full_chunks_then_commit_on_every_worker():
    p = planner(workers=2)
    toks = list(range(200))  # 3 full chunks + 8 tokens
    plan = run_prefill(p, "a", toks, list(range(10, 17)))
    assert [s.block_ids for s in plan.stores] == [(10, 11), (12, 13), (14, 15)]
    tickets = [s.ticket for s in plan.stores]
    p.on_report(WorkerReport(stored=tickets))  # one worker of two
    assert p.match("b", toks, 0) == 0
    p.on_report(WorkerReport(stored=tickets))  # the second
    assert p.match("c", toks, 0) == 3 * T  # 3 chunks, still 8 tokens left to compute
    assert p.stats.stores_committed == 3


def test_hit_leaves_at_least_one_token_and_is_chunk_aligned():
    p = planner()
    toks = list(range(128))  # exactly 2 chunks
    plan = run_prefill(p, "a", toks, [1, 2, 3, 4])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    # the last chunk would leave nothing to compute: all of it but its last block (the tail)
    assert p.match("b", toks, 0) == 2 * T - BS
    assert p.match("c", toks + [5], 0) == 2 * T
    assert p.match("d", toks + [5], 96) == 32  # local prefix cache already has 96 tokens
    assert p.match("e", toks + [5], 128) == 0


def test_loads_skip_locally_cached_blocks_and_pin():
    p = planner(num_slots=2)
    toks = list(range(129))
    plan = run_prefill(p, "a", toks, [1, 2, 3, 4, 5])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    n = p.match("b", toks, 32)
    assert n == 96
    p.on_alloc("b", [1, 7, 8, 9, 6], n)
    plan = p.build_step({"b": 1}, {"b": 128})
    assert [(ld.block_ids, ld.skip_blocks) for ld in plan.loads] == [((1, 7), 1), ((8, 9), 0)]
    assert not plan.stores  # loaded chunks are not stored again
    # pinned: a new chunk cannot evict them while the load is in flight
    other = list(range(1000, 1129))
    plan2 = run_prefill(p, "c", other, [20, 21, 22, 23, 24])
    assert not plan2.stores and p.stats.stores_declined == 2
    p.on_report(WorkerReport(steps_done=[plan.step]))
    plan3 = p.build_step({"c": 1}, {"c": 128})  # chunks already passed: not re-planned
    assert not plan3.stores


def test_failed_store_aborts_and_failed_load_drops_chunk():
    p = planner()
    toks = list(range(129))
    plan = run_prefill(p, "a", toks, [1, 2, 3, 4, 5])
    p.on_report(WorkerReport(stored=[plan.stores[0].ticket], store_failed=[plan.stores[1].ticket]))
    assert p.match("b", toks, 0) == T
    p.on_alloc("b", [1, 2, 3, 4, 5], T)
    lp = p.build_step({"b": 65}, {"b": 64})
    p.on_report(WorkerReport(load_failed=[lp.loads[0].key]))  # pinned until the step is done
    assert p.index.slot_of(lp.loads[0].key) is not None
    p.on_report(WorkerReport(steps_done=[lp.step]))
    assert p.match("c", toks, 0) == 0


def test_finished_keeps_blocks_only_when_stores_were_planned():
    p = planner()
    run_prefill(p, "a", list(range(100)), [1, 2, 3, 4])
    assert p.finished("a") is True
    run_prefill(p, "b", list(range(500, 530)), [5])
    assert p.finished("b") is False
    assert p.finished("unknown") is False


def test_chunked_prefill_stores_each_chunk_once_when_complete():
    p = planner()
    toks = list(range(300))
    p.match("a", toks, 0)
    p.on_alloc("a", list(range(10)), 0)
    p.update_request("a", tokens=toks, all_block_ids=list(range(10)))
    s1 = p.build_step({"a": 100}, {"a": 0})
    s2 = p.build_step({"a": 100}, {"a": 100})
    s3 = p.build_step({"a": 100}, {"a": 200})
    assert [len(s.stores) for s in (s1, s2, s3)] == [1, 2, 1]
    assert len({st.key for s in (s1, s2, s3) for st in s.stores}) == 4


def test_rebuild_needs_every_rank():
    a, b = b"a" * 32, b"b" * 32
    assert rebuild_entries([{0: a, 1: b}, {0: a, 1: a}]) == {0: a}
    assert rebuild_entries([]) == {}


def test_identity_changes_keys_and_unkeyable_requests_are_neither_served_nor_stored():
    from tutti.engine.keys import UnkeyableError, canonical, chunk_keys

    toks = list(range(100, 100 + 3 * 16 + 1))
    plain = chunk_keys(toks, 16, b"s" * 32)
    salted = chunk_keys(toks, 16, b"s" * 32, identity=lambda lo, hi: canonical(["salt" if lo == 0 else None]))
    assert plain != salted and all(a != b for a, b in zip(plain, salted))  # the chain carries it on
    assert canonical([("lora", "a", "/p")]) != canonical([("lora", "a/", "p")])  # unambiguous
    with pytest.raises(UnkeyableError):
        canonical([object()])

    def bad(lo, hi):
        raise UnkeyableError("an identity tutti cannot encode")

    p = Planner(num_slots=8, chunk_tokens=16, block_size=16, seed=b"s" * 32)
    p.update_request("a", tokens=toks, all_block_ids=list(range(4)))
    plan = p.build_step({"a": len(toks)}, {"a": 0})
    assert len(plan.stores) == 3
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert p.match("b", toks, 0) == 48  # same tokens, no identity: a hit
    assert p.match("c", toks, 0, identity=bad) == 0 and p.stats.unkeyed_requests == 1
    p.update_request("c", all_block_ids=list(range(4, 8)))
    assert not p.build_step({"c": len(toks)}, {"c": 0}).stores  # and never stored


def test_a_full_store_gives_up_a_prefix_from_its_end():
    """A hit needs every chunk before the ones it loads, so a full store must evict a prefix from
    its end: with its first chunk gone, the rest stays resident and no hit reaches it (LRU used to
    take a prompt's first chunk first: it was stored and touched first)."""
    p = planner(num_slots=6)
    a, b, c = list(range(4 * T + 1)), list(range(1000, 1000 + 2 * T + 1)), list(range(2000, 2000 + 2 * T + 1))
    plan = run_prefill(p, "a", a, list(range(1, 10)))
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    plan = run_prefill(p, "b", b, list(range(20, 25)))
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert len(p.index) == 6
    plan = run_prefill(p, "c", c, list(range(30, 35)))  # two more chunks: two evicted
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert p.match("a2", a, 0) == 2 * T  # a's first two chunks kept, its last two given up
    assert p.match("b2", b, 0) == 2 * T and p.match("c2", c, 0) == 2 * T
    # a hit makes its prefix the most recent, head last: the next eviction takes the tail of the
    # least recently hit prefix (b), never a head
    assert p.match("a3", a, 0) == 2 * T
    plan = run_prefill(p, "d", list(range(3000, 3000 + T + 1)), [40, 41, 42])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert p.match("b3", b, 0) == T and p.match("a4", a, 0) == 2 * T and p.match("c3", c, 0) == 2 * T
    p.index.check_invariants()


def test_no_store_is_planned_after_a_chunk_of_its_request_failed():
    """A store the worker skipped (or that failed) leaves a hole no hit can pass: the request's
    later chunks are not planned, so no resident chunk is evicted to make room for them."""
    p = planner(num_slots=4)
    full = list(range(5000, 5000 + 2 * T + 1))
    plan = run_prefill(p, "x", full, [50, 51, 52, 53, 54])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))  # two resident chunks
    toks = list(range(4 * T + 1))
    p.match("a", toks, 0)
    p.on_alloc("a", list(range(1, 10)), 0)
    p.update_request("a", tokens=toks, all_block_ids=list(range(1, 10)))
    plan = p.build_step({"a": 2 * T}, {"a": 0})  # a's first two chunks
    assert len(plan.stores) == 2
    p.on_report(WorkerReport(store_failed=[plan.stores[0].ticket], stored=[plan.stores[1].ticket]))
    before = p.stats.copy()
    plan = p.build_step({"a": 2 * T + 1}, {"a": 2 * T})  # its last two
    d = p.stats.since(before)
    assert not plan.stores and d["stores_declined"] == 2 and d["evictions"] == 0
    assert p.match("x2", full, 0) == 2 * T  # x's chunks were not evicted for them


# -- a hit reaching the prompt's last block (the tail) ---------------------------------------
TB = 16  # a smaller block: 4 blocks a chunk, so a tail load keeps 3 and may skip some


def tail_planner(**kw):
    return Planner(num_slots=16, chunk_tokens=T, block_size=TB, seed=namespace_seed("t"), slot_bytes=4096, **kw)


def stored(p, tokens, req="a"):
    """`tokens` prefilled and every whole chunk of them committed."""
    blocks = list(range(100, 100 + -(-len(tokens) // TB)))
    plan = run_prefill(p, req, tokens, blocks)
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    return plan


class Takes:
    """A hit policy that loads a fixed number of tokens."""

    def __init__(self, n):
        self.n = n

    def decide(self, q, rates):
        return self.n


def test_exact_repeat_loads_the_last_chunk_but_its_last_block():
    p = tail_planner()
    toks = list(range(3 * T))  # exactly 3 chunks
    stored(p, toks)
    assert p.match("b", toks, 0) == 3 * T - TB
    blocks = list(range(1, 13))
    p.on_alloc("b", blocks, 3 * T - TB)
    p.update_request("b", tokens=toks, all_block_ids=blocks)
    plan = p.build_step({"b": TB}, {"b": 3 * T - TB})
    assert [(ld.block_ids, ld.skip_blocks, ld.keep_blocks) for ld in plan.loads] == [
        ((1, 2, 3, 4), 0, None), ((5, 6, 7, 8), 0, None), ((9, 10, 11, 12), 0, 3)]
    assert plan.loads[2].key == p._reqs["b"].keys[2]
    assert all(p.index.is_pinned(ld.key) for ld in plan.loads)
    assert not plan.stores  # the tail chunk is stored already: never again
    assert p.stats.hit_tokens == 3 * T - TB
    # the load's bytes: 2 chunks and 3 of the last chunk's 4 blocks
    assert p._step_load_bytes[plan.step] == 4096 * 2 + 4096 * 3 // 4
    p.on_report(WorkerReport(steps_done=[plan.step]))
    assert not any(p.index.is_pinned(ld.key) for ld in plan.loads)
    plan2 = p.build_step({"b": 1}, {"b": 3 * T})  # decoding: nothing to store
    assert not plan2.stores and not plan2.loads


def test_one_token_past_whole_chunks_keeps_whole_chunks():
    p = tail_planner()
    toks = list(range(3 * T + 1))
    stored(p, toks)
    assert p.match("b", toks, 0) == 3 * T
    p.on_alloc("b", list(range(1, 14)), 3 * T)
    plan = p.build_step({"b": 1}, {"b": 3 * T})
    assert [ld.keep_blocks for ld in plan.loads] == [None] * 3


def test_tail_respects_the_requests_cap():
    p = tail_planner()
    toks = list(range(3 * T))
    stored(p, toks)
    assert p.match("b", toks, 0, max_load_tokens=3 * T - TB) == 3 * T - TB
    assert p.match("c", toks, 0, max_load_tokens=3 * T - TB - 1) == 2 * T  # chunk boundaries only


def test_no_tail_when_the_policy_takes_fewer_chunks():
    p = tail_planner(hit_policy=Takes(T))
    toks = list(range(3 * T))
    stored(p, toks)
    assert p.match("b", toks, 0) == T
    p.on_alloc("b", list(range(1, 13)), T)
    plan = p.build_step({"b": 2 * T}, {"b": T})
    assert [ld.keep_blocks for ld in plan.loads] == [None]
    assert [s.block_ids for s in plan.stores] == []  # chunks 1, 2 are resident: not stored twice


def test_no_tail_when_the_last_chunk_is_not_stored():
    p = tail_planner()
    toks = list(range(3 * T))
    stored(p, toks[:2 * T + 5])  # two chunks stored
    assert p.match("b", toks, 0) == 2 * T
    p.on_alloc("b", list(range(1, 13)), 2 * T)
    plan = p.build_step({"b": T}, {"b": 2 * T})
    assert [ld.keep_blocks for ld in plan.loads] == [None, None]
    assert [s.block_ids for s in plan.stores] == [(9, 10, 11, 12)]  # the last chunk is stored once computed


def test_tail_with_vllms_own_cache_skips_and_keeps():
    p = tail_planner()
    toks = list(range(3 * T))
    stored(p, toks)
    n = p.match("b", toks, 2 * TB)  # vLLM's own prefix cache holds 2 blocks
    assert n == 3 * T - TB - 2 * TB
    blocks = [50, 51] + list(range(3, 13))
    p.on_alloc("b", blocks, n)
    plan = p.build_step({"b": TB}, {"b": 3 * T - TB})
    assert [(ld.block_ids, ld.skip_blocks, ld.keep_blocks) for ld in plan.loads] == [
        ((50, 51, 3, 4), 2, None), ((5, 6, 7, 8), 0, None), ((9, 10, 11, 12), 0, 3)]
    assert p.stats.hit_tokens == n
    # vLLM's cache reaching into the last chunk: its own hit, no tail (unchanged)
    assert p.match("c", toks, 2 * T + TB) == 0


def test_tail_loads_asynchronously_too():
    p = tail_planner(asynchronous=True)
    toks = list(range(2 * T))
    stored(p, toks)
    assert p.match("b", toks, 0) == 2 * T - TB
    # vLLM allocates an asynchronous load's blocks for its external tokens alone: 7 of 8
    p.on_alloc("b", list(range(1, 8)), 2 * T - TB, async_load=True)
    plan = p.build_step({}, {})
    assert [(ld.block_ids, ld.keep_blocks) for ld in plan.async_loads] == [((1, 2, 3, 4), None), ((5, 6, 7, 0), 3)]
    assert p.stats.async_hit_tokens == 2 * T - TB
    p.on_report(WorkerReport(steps_done=[plan.async_step]))
    assert not any(p.index.is_pinned(ld.key) for ld in plan.async_loads)


def test_an_asynchronous_hit_counts_its_wait_until_vllm_learns_it_was_received():
    """The wait outside the batch: from the blocks' allocation to the receipt vLLM passes on
    (finished_recving), once a hit; a layer-wise hit and a request never seen count nothing."""
    p = tail_planner(asynchronous=True)
    toks = list(range(2 * T))
    stored(p, toks)
    assert p.match("b", toks, 0) == 2 * T - TB
    p.on_alloc("b", list(range(1, 8)), 2 * T - TB, async_load=True)
    p.build_step({}, {})
    time.sleep(0.02)
    p.received(["b", "never-seen"])
    p.received(["b"])  # reported again: counted once
    assert p.stats.async_waits == 1 and 0.02 <= p.stats.async_wait_seconds < 5
    q = tail_planner()
    stored(q, toks)
    q.match("c", toks, 0)
    q.on_alloc("c", list(range(1, 9)), 2 * T - TB)
    q.received(["c"])
    assert q.stats.async_waits == 0 and q.stats.async_wait_seconds == 0


def test_a_failed_tail_load_drops_its_chunk():
    p = tail_planner()
    toks = list(range(2 * T))
    stored(p, toks)
    p.on_alloc("b", list(range(1, 9)), p.match("b", toks, 0))
    plan = p.build_step({"b": TB}, {"b": 2 * T - TB})
    tail = plan.loads[-1]
    p.on_report(WorkerReport(load_failed=[tail.key], steps_done=[plan.step]))
    assert p.index.slot_of(tail.key) is None
    assert p.match("c", toks, 0) == T  # the first chunk only: the tail is gone


def test_no_tail_for_one_block_chunks_or_hybrid_models():
    p = Planner(num_slots=16, chunk_tokens=T, block_size=T, seed=namespace_seed("t"), slot_bytes=4096)
    toks = list(range(3 * T))
    plan = run_prefill(p, "a", toks, [1, 2, 3])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert p.match("b", toks, 0) == 2 * T
    h = Planner(num_slots=16, chunk_tokens=T, block_size=TB, seed=namespace_seed("t"), slot_bytes=4096,
                num_groups=2)
    groups = [list(range(1, 13)), list(range(21, 33))]
    h.match("a", toks, 0)
    h.on_alloc("a", groups, 0)
    h.update_request("a", tokens=toks, all_block_ids=groups)
    plan = h.build_step({"a": 3 * T}, {"a": 0})
    h.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert len(plan.stores) == 3 and h.match("b", toks, 0) == 2 * T


def test_a_prompt_is_counted_once_however_often_vllm_asks_while_it_waits():
    """vLLM looks a waiting request up again at every step its blocks do not fit: its prompt
    counts once in queried_tokens (so hit_tokens / queried_tokens is a hit rate), and again
    after a preemption, whose next lookup is a new one."""
    p = planner()
    toks = list(range(200))
    plan = run_prefill(p, "a", toks, list(range(10, 17)))
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    before = p.stats.queried_tokens
    for _ in range(5):  # no blocks yet: asked again at every step
        assert p.match("b", toks, 0) == 3 * T
    assert p.stats.queried_tokens == before + len(toks)
    p.on_alloc("b", list(range(20, 27)), 3 * T)
    assert p.stats.hit_tokens == 3 * T
    p.preempted("b")
    assert p.match("b", toks, 0) == 3 * T
    assert p.stats.queried_tokens == before + 2 * len(toks)
    p.match("c", toks, 0)
    assert p.stats.queried_tokens == before + 3 * len(toks)
