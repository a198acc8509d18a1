"""The store admission seam: which computed chunks the store takes (tutti.engine.admission)."""
from __future__ import annotations

import pytest

from tutti.engine.admission import AdmitAll, SeenTwice, StoreCandidate, get_admission, register_admission
from tutti.engine.config import ConfigError, EngineConfig
from tutti.engine.plan import WorkerReport
from tutti.engine.planner import Planner


def cand(key: bytes, chunk: int = 0) -> StoreCandidate:
    return StoreCandidate(key=key, req_id="r", chunk=chunk, prompt_chunks=4, state=False, resident=0, capacity=8)


def test_seen_twice_admits_a_chunk_the_second_time_within_its_memory():
    p = SeenTwice(memory=2)
    assert not p.admit(cand(b"a")) and p.admit(cand(b"a"))
    assert not p.admit(cand(b"a"))  # admitted once: counted again from zero
    for k in (b"b", b"c", b"d"):  # b falls out of a memory of 2
        assert not p.admit(cand(k))
    assert not p.admit(cand(b"b")) and p.admit(cand(b"d"))


def planner(admission) -> Planner:
    return Planner(num_slots=16, chunk_tokens=32, block_size=16, seed=b"s" * 32, slot_bytes=1000, admission=admission)


def run(p: Planner, req: str, tokens: list[int]) -> int:
    """One request computed whole; returns the chunks the step stored."""
    p.match(req, tokens, 0)
    p.on_alloc(req, list(range(len(tokens) // 16 + 1)), 0)
    plan = p.build_step({req: len(tokens)}, {req: 0})
    p.on_report(WorkerReport(stored=[st.ticket for st in plan.stores], steps_done=[plan.step]))
    p.finished(req)
    return len(plan.stores)


def test_the_planner_stores_what_admission_admits_and_counts_the_rest():
    toks = list(range(1, 100))  # 3 whole chunks
    p = planner(get_admission("seen_twice"))
    assert run(p, "a", toks) == 0 and p.stats.stores_declined == 3  # seen once: declined, counted
    assert p.match("b", toks + [1], 0) == 0  # a miss
    p.finished("b")
    assert run(p, "c", toks) == 3  # the second time: stored
    assert p.match("d", toks + [1], 0) == 96
    assert run(planner(None), "a", toks) == 3  # the default takes every chunk


class Evens:
    def admit(self, c):
        return c.chunk % 2 == 0


class Broken:
    def admit(self, c):
        raise RuntimeError("bug")


def test_policies_by_name_module_attr_registry_and_a_broken_one():
    register_admission("evens", Evens)
    assert isinstance(get_admission("evens"), Evens)
    assert type(get_admission("tests.engine.test_admission:Evens")).__name__ == "Evens"  # imported by its path
    assert isinstance(get_admission("all"), AdmitAll)
    assert run(planner(Evens()), "a", list(range(1, 100))) == 2  # chunks 0 and 2
    assert run(planner(Broken()), "a", list(range(1, 100))) == 3  # a failing policy stores, never stops the step


def test_a_bad_store_admission_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="store_admission"):
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "store_admission": "nope"})
    assert EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB",
                                   "store_admission": "seen_twice"}).store_admission == "seen_twice"
