"""The store admission seam: which computed chunks the store takes (tutti.engine.sched.admission)."""
from __future__ import annotations

import pytest

from tutti.engine.sched.admission import AdmitAll, DriveShare, SeenTwice, StoreCandidate, get_admission, register_admission
from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.engine.plan import WorkerReport
from tutti.engine.sched.planner import Planner


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
    assert type(get_admission("tests.engine.sched.test_admission:Evens")).__name__ == "Evens"  # imported by its path
    assert isinstance(get_admission("all"), AdmitAll)
    assert run(planner(Evens()), "a", list(range(1, 100))) == 2  # chunks 0 and 2
    assert run(planner(Broken()), "a", list(range(1, 100))) == 3  # a failing policy stores, never stops the step


def test_a_bad_store_admission_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="store_admission"):
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "store_admission": "nope"})
    assert EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB",
                                   "store_admission": "seen_twice"}).store_admission == "seen_twice"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def key_at(pos: float) -> bytes:
    """A key whose prefix falls at `pos` in DriveShare's [0, 1)."""
    return int(pos * 2 ** 64).to_bytes(8, "little") + b"k" * 24


def shared(req: str, first: bytes, stats, chunk: int = 0) -> StoreCandidate:
    return StoreCandidate(key=bytes([chunk]) * 32, req_id=req, chunk=chunk, prompt_chunks=4, state=False,
                          resident=0, capacity=8, first_key=first, counters=stats)


def test_drive_share_admits_everything_while_the_drive_keeps_up():
    from tutti.engine.sched.planner import PlannerStats

    clock, stats = Clock(), PlannerStats()
    p = DriveShare(clock=clock)
    for i in range(50):
        clock.t += 0.5
        stats.stores_committed += 10
        assert p.admit(shared(f"r{i}", key_at(0.999), stats))
    assert p.share == 1.0


def test_drive_share_writes_fewer_whole_prefixes_under_pressure_and_recovers():
    from tutti.engine.sched.planner import PlannerStats

    clock, stats = Clock(), PlannerStats()
    p = DriveShare(floor=0.25, cut=0.5, rise=0.25, interval_s=1.0, clock=clock)
    lo, hi = key_at(0.1), key_at(0.6)
    assert p.admit(shared("a", lo, stats)) and p.admit(shared("b", hi, stats))  # share 1: both
    clock.t, stats.stores_skipped = 1.0, 3  # stores were skipped: the drive cannot keep up
    assert not p.admit(shared("c", hi, stats)) and p.share == 0.5
    assert p.admit(shared("d", lo, stats))  # the prefix below the share is still written
    clock.t, stats.stores_skipped = 2.0, 5  # skipped again
    assert p.admit(shared("d", lo, stats, chunk=1)) and p.share == 0.25
    clock.t, stats.declined_hit_tokens, stats.stores_committed = 3.0, 512, 4  # hits recomputed while writing,
    p.admit(shared("e", lo, stats))  # nothing skipped: the drive keeps up with the writes, the share climbs
    assert p.share == 0.5
    clock.t, stats.stores_committed = 10.0, 8  # quiet: the share climbs back
    p.admit(shared("f", lo, stats))
    assert p.share == 0.75
    assert p.admit(shared("g", hi, stats))  # 0.6 < 0.75: the prefix is written again


def test_drive_share_never_stores_a_chunk_after_one_it_declined():
    from tutti.engine.sched.planner import PlannerStats

    clock, stats = Clock(), PlannerStats()
    p = DriveShare(floor=0.25, cut=0.5, rise=0.5, interval_s=1.0, clock=clock)
    mid = key_at(0.7)
    assert p.admit(shared("r", mid, stats, chunk=0))
    clock.t, stats.stores_skipped = 1.0, 1
    assert not p.admit(shared("r", mid, stats, chunk=1)) and p.share == 0.5  # the request's tail is given up
    clock.t, stats.stores_committed = 2.0, 5
    assert p.share == 0.5 and not p.admit(shared("r", mid, stats, chunk=2))  # share back to 1: still declined
    assert p.share == 1.0 and p.admit(shared("s", mid, stats, chunk=0))  # a new request of the prefix: written


def test_drive_share_in_the_planner_stores_whole_prefixes_or_none():
    """Under pressure the planner stores some prefixes whole and declines the others whole; a later
    request hits an admitted prefix in full and misses a declined one."""
    clock = Clock()
    policy = DriveShare(floor=0.5, cut=0.5, interval_s=1.0, clock=clock)
    p = planner(policy)
    p.stats.stores_committed = 1
    policy.admit(shared("warm", key_at(0.0), p.stats))  # the first look marks the counters
    clock.t, p.stats.stores_skipped = 1.0, 1  # pressure: the share falls to 0.5
    stored, missed = {}, 0
    for i in range(12):
        toks = [1000 * (i + 1) + t for t in range(99)]  # 3 whole chunks, a prefix of its own
        n = run(p, f"q{i}", toks)
        assert n in (0, 3)  # whole prefixes or none
        stored[i] = n
        got = p.match(f"h{i}", toks + [1], 0)
        p.finished(f"h{i}")
        assert got == (96 if n else 0)
        missed += n == 0
    assert policy.share == 0.5 and 0 < missed < 12  # some prefixes declined, some written
    assert p.stats.stores_declined == 3 * missed
