"""TuttiConnectorV1.may_load_async (vLLM 0.34's KVConnectorBase_V1.may_load_async, asked under
--max-num-inflight-kv-loads when a request enters a waiting queue): the scheduler half's answer,
on the CPU, over a planner built without an engine (scheduler_half_kit). That vLLM 0.34 consults
it is test_api_check.py::test_vllm_034_consults_may_load_async (0.34's own scheduler code)."""

from __future__ import annotations

import inspect

import pytest

from scheduler_half_kit import SLOT, T, half, planner, prompt, request, store


@pytest.fixture
def stored():
    """A planner holding the 5 chunks of a prompt (and what the prompt is)."""
    def make(**kw):
        p = planner(**kw)
        toks = prompt(1, 5 * T + 3)
        store(p, toks)
        assert len(p.index) == 5
        return p, toks
    return make


def test_where_every_hit_loads_asynchronously_a_stored_first_chunk_says_yes(stored):
    p, toks = stored(asynchronous=True)
    h = half(p, async_loads=True)
    assert h.may_load_async(request("a", toks))
    assert h.may_load_async(request("b", toks[:T + 1]))  # one chunk and a token to compute
    assert not h.may_load_async(request("c", toks[:T]))  # the one chunk is all of it: nothing to load
    assert not h.may_load_async(request("d", prompt(2, 5 * T)))  # nothing stored
    assert not h.may_load_async(request("e", toks, cache_salt="other"))  # another identity: other keys
    assert not h.may_load_async(request("f", []))


def test_where_hits_load_layer_wise_up_to_a_budget_only_a_hit_past_it_says_yes(stored):
    for chunks in range(1, 6):
        p, toks = stored(sync_budget=2 * SLOT, can_load_async=True)  # two chunks a step load layer-wise
        h = half(p, budgeted=True)
        prefix = toks[:chunks * T + 1]
        guess = h.may_load_async(request(f"g{chunks}", prefix))
        assert guess == (chunks > 2), chunks
        # and the lookup (the first of its step) agrees: the hit policy chose an asynchronous load
        # exactly there (later lookups of one step share its budget: vLLM asks before any of them)
        assert p.match(f"l{chunks}", prefix, 0) == chunks * T
        assert p.wants_async(f"l{chunks}") == guess, chunks


def test_an_unmeasured_budget_or_layer_wise_hits_say_no(stored):
    p, toks = stored(sync_budget="auto", can_load_async=True)
    assert p.sync_budget_bytes() is None  # no read or prefill rate measured yet
    assert not half(p, budgeted=True).may_load_async(request("a", toks))
    p, toks = stored()
    assert not half(p).may_load_async(request("a", toks))  # every hit loads inside its step


def test_the_answer_is_the_lookups_choice_once_there_was_one(stored):
    p, toks = stored(sync_budget=2 * SLOT, can_load_async=True)
    h = half(p, budgeted=True)
    p.match("a", toks, 0)
    assert p.wants_async("a") and h.may_load_async(request("a", toks))
    p.match("b", toks[:T + 1], 0)
    assert not p.wants_async("b") and not h.may_load_async(request("b", toks[:T + 1]))


def test_asking_is_a_peek(stored):
    """vLLM asks whenever a request enters a waiting queue: nothing is counted, touched or kept."""
    p, toks = stored(asynchronous=True)
    h = half(p, async_loads=True)
    before = (vars(p.stats).copy(), list(p.index.eviction.order()), set(p._reqs))
    for i in range(3):
        assert h.may_load_async(request(f"r{i}", toks))
    assert (vars(p.stats), list(p.index.eviction.order()), set(p._reqs)) == before


def test_the_connector_forwards_to_its_scheduler_half(stored):
    from tutti.vllm.connector import TuttiConnectorV1

    p, toks = stored(asynchronous=True)
    conn = TuttiConnectorV1.__new__(TuttiConnectorV1)
    conn._sched, conn._work = half(p, async_loads=True), None
    assert conn.may_load_async(request("a", toks)) and not conn.may_load_async(request("b", prompt(3, 80)))
    conn._sched = None  # a worker's instance
    assert conn.may_load_async(request("a", toks)) is False
    assert list(inspect.signature(TuttiConnectorV1.may_load_async).parameters) == ["self", "request"]


def test_a_vllm_without_the_knob_never_asks():
    """Before 0.34 neither the connector base nor the scheduler knows may_load_async: tutti's answer
    goes unused and nothing changes."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from tutti.vllm import compat

    if compat.HAS_MAY_LOAD_ASYNC:
        pytest.skip("this vLLM has may_load_async (0.34+): test_api_check.py covers it")
    from vllm.v1.core.sched import scheduler

    assert not hasattr(KVConnectorBase_V1, "may_load_async")
    assert "may_load_async" not in inspect.getsource(scheduler)
    assert compat.max_inflight_kv_loads(object()) is None
