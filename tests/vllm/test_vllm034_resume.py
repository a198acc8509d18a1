"""vLLM 0.34 dropped CachedRequestData.resumed_req_ids: a request resumed after preemption is
re-sent in full among the step's new requests (NewRequestData, with the blocks it holds now). The
scheduler half's build_step, fed scheduler outputs of both shapes (0.33's and 0.34's, as plain
objects with those fields), plans the resumed request's loads into its new blocks only, and a
running request's new blocks still extend its old ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler_half_kit import T, half, planner, prompt, store

TOKS = prompt(1, 3 * T + 3)


def new_req(req_id, blocks, computed=0):
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(TOKS), block_ids=(list(blocks),),
                           num_computed_tokens=computed, prefill_token_ids=list(TOKS))


def output(new=(), cached=(), preempted=(), scheduled=None, resumed=None):
    """A SchedulerOutput: `cached` as (req_id, new block ids, computed); `resumed` set: 0.33's shape."""
    c = SimpleNamespace(req_ids=[r for r, _, _ in cached], new_block_ids=[(list(b),) if b is not None else None
                                                                          for _, b, _ in cached],
                        num_computed_tokens=[n for _, _, n in cached], new_token_ids=[], num_output_tokens=[])
    if resumed is not None:
        c.resumed_req_ids, c.all_token_ids = set(resumed), {}
    return SimpleNamespace(preempted_req_ids=set(preempted), scheduled_new_reqs=list(new), scheduled_cached_reqs=c,
                           num_scheduled_tokens=dict(scheduled or {}))


@pytest.fixture
def sched():
    p = planner()
    store(p, TOKS)  # the prompt's 3 chunks are in the store
    h = half(p)
    h._events = SimpleNamespace(planned=lambda stores: None)
    # "a" hits its 3 chunks, runs, then is preempted
    assert p.match("a", TOKS, 0) == 3 * T
    p.on_alloc("a", [1, 2, 3, 4], 3 * T)
    plan = h.build_step(output(new=[new_req("a", [1, 2, 3, 4])], scheduled={"a": 3}))
    assert sorted(b for ld in plan.loads for b in ld.block_ids) == [1, 2, 3]
    h.build_step(output(preempted=["a"]))
    assert p.match("a", TOKS, 0) == 3 * T  # looked up again on resumption, new blocks allocated
    p.on_alloc("a", [7, 8, 9, 10], 3 * T)
    return h


def loaded_blocks(plan):
    return sorted(b for ld in plan.loads + plan.async_loads for b in ld.block_ids)


def test_034_a_resumed_request_comes_back_as_new_and_loads_into_its_new_blocks(sched):
    plan = sched.build_step(output(new=[new_req("a", [7, 8, 9, 10])], scheduled={"a": 3}))
    assert loaded_blocks(plan) == [7, 8, 9]


def test_033_a_resumed_request_among_the_cached_ones_loads_into_its_new_blocks(sched):
    plan = sched.build_step(output(cached=[("a", [7, 8, 9, 10], 0)], resumed={"a"}, scheduled={"a": 3}))
    assert loaded_blocks(plan) == [7, 8, 9]


def test_a_running_requests_new_blocks_extend_its_old_ones():
    from tutti.vllm import compat

    p = planner()
    h = half(p)
    h._events = SimpleNamespace(planned=lambda stores: None)
    toks = prompt(2, 2 * T + 3)
    p.match("b", toks, 0)
    p.on_alloc("b", [1, 2], 0)
    h.build_step(output(new=[SimpleNamespace(req_id="b", prompt_token_ids=toks, block_ids=([1, 2],),
                                             num_computed_tokens=0)], scheduled={"b": 2 * T}))
    for shape in ({}, {"resumed": set()}):  # 0.34 (no resumed_req_ids), 0.33 (empty)
        assert compat.resumed_requests(output(**shape).scheduled_cached_reqs) == set()
    h.build_step(output(cached=[("b", [3], 2 * T)], scheduled={"b": 3}))
    assert p._reqs["b"].block_ids == [[1, 2, 3]]
