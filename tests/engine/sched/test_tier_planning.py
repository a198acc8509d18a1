"""The planner's tiers (tutti.engine.sched.tiers): write-through copies down, hits served from the
fastest tier holding a chunk, promotions back up, pins that keep a chunk until its copy is down,
and events that say what a router may still find."""

from tutti.engine.keys import namespace_seed
from tutti.engine.plan import WorkerReport
from tutti.engine.sched.index import ChunkIndex
from tutti.engine.sched.planner import Planner
from tutti.engine.sched.tiers import LowerTier

T, BS = 64, 32  # chunk tokens, vLLM block size: 2 blocks a chunk


def tiered(ram=2, disk=8, workers=1, stage=False, **kw):
    return Planner(num_slots=ram, chunk_tokens=T, block_size=BS, seed=namespace_seed("t"), num_workers=workers,
                   slot_bytes=4096, lower=[LowerTier(ChunkIndex(disk), "disk")], stage=stage, **kw)


def prefill(p, req, tokens, blocks):
    p.match(req, tokens, 0)
    p.on_alloc(req, blocks, 0)
    p.update_request(req, tokens=tokens, all_block_ids=blocks)
    return p.build_step({req: len(tokens)}, {req: 0})


def stored(p, req, tokens, blocks):
    """Prefill `tokens`, commit its stores, and run the write-downs that follows to the end."""
    plan = prefill(p, req, tokens, blocks)
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    down = p.build_step({}, {})
    p.on_report(WorkerReport(stored=[c.ticket for c in down.copies]))
    return plan, down


def test_a_committed_chunk_is_written_down_and_stays_pinned_until_its_copy_is_reported():
    p = tiered(ram=2)
    toks = list(range(129))  # 2 chunks
    plan = prefill(p, "a", toks, [1, 2, 3, 4, 5])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    assert p.stats.stores_committed == 2 and p.take_events() == [("stored", [k]) for k in
                                                                 (plan.stores[0].key, plan.stores[1].key)]
    down = p.build_step({}, {})
    assert [(c.src, c.dst) for c in down.copies] == [(0, 1), (0, 1)]
    assert [c.src_slot for c in down.copies] == [s.slot for s in plan.stores]
    # while the copies are in flight, a new prompt cannot evict them from tier 0
    other = prefill(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    assert other.stores == [] and p.stats.stores_declined == 2
    p.on_report(WorkerReport(stored=[c.ticket for c in down.copies]))
    assert p.tier_stats.writedowns[1] == 2
    assert all(k in p.lower[0].index for k in (c.key for c in down.copies))
    assert p.take_events() == []  # written down: announced once, when tier 0 took them


def test_a_chunk_tier_0_evicted_is_served_from_tier_1_then_promoted():
    p = tiered(ram=2)
    a = list(range(129))
    first, _ = stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])  # evicts a's chunks from tier 0
    assert all(s.key not in p.index for s in first.stores)
    assert p.tier_stats.evictions[0] == 2 and p.take_events()[-1][0] == "stored"  # never "removed": tier 1 has them
    n = p.match("c", a, 0)
    assert n == 2 * T
    p.on_alloc("c", [11, 12, 13, 14, 15], n)
    plan = p.build_step({"c": 1}, {"c": 128})
    assert [ld.tier for ld in plan.loads] == [1, 1] and p.tier_stats.hit_tokens[1] == 2 * T
    assert all(p.lower[0].index.is_pinned(ld.key) for ld in plan.loads)
    p.on_report(WorkerReport(steps_done=[plan.step]))
    up = p.build_step({}, {})
    assert [(c.src, c.dst) for c in up.copies] == [(1, 0), (1, 0)]
    p.on_report(WorkerReport(stored=[c.ticket for c in up.copies]))
    assert p.tier_stats.promotions == 2 and all(s.key in p.index for s in first.stores)
    again = p.match("d", a, 0)
    p.on_alloc("d", [16, 17, 18, 19, 20], again)
    assert [ld.tier for ld in p.build_step({"d": 1}, {"d": 128}).loads] == [0, 0]


def test_promotions_yield_to_write_downs_waiting_or_in_flight():
    """A promotion takes a drive read and a first-tier slot that only a clean chunk leaves; while
    write-downs are queued or in flight the tier is short of both (bench/drive_sim.py: promoting
    then served up to 7% less), so the hit's promotion is let go; once they are reported a hit's
    chunk is promoted as before. Three slots: b's two chunks evict one of a's; a's other one is
    clean, so the promotion has a slot to take."""
    p = tiered(ram=3)
    a = list(range(129))
    stored(p, "a", a, [1, 2, 3, 4, 5])
    plan_b = prefill(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    p.on_report(WorkerReport(stored=[st.ticket for st in plan_b.stores]))
    down = p.build_step({}, {})
    assert [(c.src, c.dst) for c in down.copies] == [(0, 1), (0, 1)]  # b's write-downs, not reported yet

    def hit(req, blocks):
        n = p.match(req, a, 0)
        p.on_alloc(req, blocks, n)
        plan = p.build_step({req: 1}, {req: 128})
        assert sorted(ld.tier for ld in plan.loads) == [0, 1]  # one of a's chunks from the drive
        p.on_report(WorkerReport(steps_done=[plan.step]))
        copies = p.build_step({}, {}).copies
        p.finished(req)
        return copies

    assert hit("c", [11, 12, 13, 14, 15]) == [] and p.tier_stats.promotions == 0  # let go
    p.on_report(WorkerReport(stored=[c.ticket for c in down.copies]))  # the write-downs are done
    assert [(c.src, c.dst) for c in hit("d", [16, 17, 18, 19, 20])] == [(1, 0)]


def test_with_promote_off_a_hit_from_below_stays_below():
    """`promote: off`: the first tier is left to new chunks; a hit from tier 1 is loaded from there
    again (the control is the test above: the same hit, promoted)."""
    p = tiered(ram=2)
    p.promote = False
    a = list(range(129))
    first, _ = stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])  # evicts a's chunks from tier 0
    for req in ("c", "d"):
        n = p.match(req, a, 0)
        p.on_alloc(req, [11, 12, 13, 14, 15], n)
        plan = p.build_step({req: 1}, {req: 128})
        assert [ld.tier for ld in plan.loads] == [1, 1]
        p.on_report(WorkerReport(steps_done=[plan.step]))
        assert p.build_step({}, {}).copies == [] and p.tier_stats.promotions == 0
        p.finished(req)
    from tutti.engine.config.settings import EngineConfig

    assert EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "promote": "off"}).promote == "off"


def test_a_failed_load_from_below_is_not_promoted_and_is_dropped_from_every_tier():
    p = tiered(ram=2)
    a = list(range(129))
    first, _ = stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    n = p.match("c", a, 0)
    p.on_alloc("c", [11, 12, 13, 14, 15], n)
    plan = p.build_step({"c": 1}, {"c": 128})
    bad = plan.loads[0].key
    p.on_report(WorkerReport(steps_done=[plan.step], load_failed=[bad]))
    assert bad not in p.lower[0].index and ("removed", [bad]) in p.take_events()
    up = p.build_step({}, {})
    assert [c.key for c in up.copies] == [plan.loads[1].key]


def test_a_failed_copy_is_aborted_below_and_counted_as_dropped():
    p = tiered(ram=4, workers=2)
    plan = prefill(p, "a", list(range(129)), [1, 2, 3, 4, 5])
    tickets = [s.ticket for s in plan.stores]
    p.on_report(WorkerReport(stored=tickets + tickets))
    down = p.build_step({}, {})
    p.on_report(WorkerReport(stored=[down.copies[0].ticket], store_failed=[down.copies[1].ticket]))
    p.on_report(WorkerReport(stored=[down.copies[0].ticket]))  # the second rank's
    assert p.tier_stats.writedowns[1] == 1 and p.tier_stats.dropped == 1
    assert p.lower[0].index.used_slots == 1 and not p.index.is_pinned(down.copies[1].key)
    p.lower[0].index.check_invariants()


def test_an_eviction_from_the_last_tier_holding_a_chunk_withdraws_it():
    p = tiered(ram=1, disk=2)
    chunks = []
    for i in range(3):  # three one-chunk prompts: tier 1 holds two
        plan, _ = stored(p, f"r{i}", list(range(100 * i, 100 * i + 65)), [1, 2, 3])
        chunks.append(plan.stores[0].key)
    events = p.take_events()
    assert ("removed", [chunks[0]]) in events
    assert chunks[1] not in p.index and chunks[1] in p.lower[0].index
    assert not any(kind == "removed" and chunks[1] in keys for kind, keys in events)


HIT = list(range(2000, 2257))  # 4 chunks and a token


def ram_head_disk_all(disk_rate: float) -> Planner:
    """A planner whose RAM tier holds HIT's first 2 chunks and whose drive holds all 4; slot_bytes
    4096 per 64 tokens: 64 B a token. Prefill 1,000 tokens/s; RAM reads 1 GB/s, the drive
    `disk_rate` B/s."""
    from tutti.engine.sched.hit_policy import get_policy

    p = tiered(ram=2)
    p.hit_policy = get_policy("auto")
    keys = p._request("setup", HIT).keys[:4]
    for index, held in ((p.index, keys[:2]), (p.lower[0].index, keys)):
        index.plan_store(held)
        for k in held:
            index.commit(k)
    p.meter.seed(prefill_tokens_per_s=1000.0, step_s=0.05)
    p.meter.on_loads(1 << 30, 1.0)
    p.lower_meter.on_loads(int(disk_rate), 1.0)
    return p


def test_a_hit_loads_its_ram_part_and_prices_the_rest_by_the_lower_tiers_rate():
    """A drive at 1 MB/s (16k tokens/s) is worth loading; at 10 kB/s (160 tokens/s) it is not."""
    fast = ram_head_disk_all(1e6)
    assert [t for _, _, t in fast._locate(fast._reqs["setup"].keys[:4])] == [0, 0, 1, 1]
    assert fast.match("a", HIT, 0) == 4 * T
    slow = ram_head_disk_all(1e4)
    assert slow.match("a", HIT, 0) == 2 * T  # the RAM part only: the drive is slower than recomputing
    assert slow._reqs["a"].declined == 2 * T
    assert slow._reqs["a"].declined_by == {"rate": 2 * T}


def test_loads_queued_for_the_ram_tier_do_not_delay_the_drive_part_but_loads_queued_for_the_drive_do():
    """1 MiB of loads queued ahead: at the RAM's rate a millisecond, at the drive's a second, longer
    than recomputing the 129 tokens past the RAM part (0.13 s). Queued for the RAM tier, the drive
    part still loads (each tier reads from its own queue); queued for the drive, it is recomputed
    and counted as declined for the queue."""
    ram_queue = ram_head_disk_all(1e6)
    ram_queue._unsent_load_bytes = 1 << 20
    assert ram_queue.match("a", HIT, 0) == 4 * T
    drive_queue = ram_head_disk_all(1e6)
    drive_queue._unsent_load_bytes = drive_queue._unsent_lower_bytes = 1 << 20
    assert drive_queue.match("a", HIT, 0) == 2 * T
    assert drive_queue._reqs["a"].declined_by == {"queue": 2 * T}


def test_the_queue_of_drive_loads_is_counted_while_planned_and_in_flight_and_drains_when_reported():
    """A hit's loads from the drive count in the drive's queue from allocation until the step that
    carried them is reported done; RAM loads count only in the whole queue."""
    p = ram_head_disk_all(1e6)
    assert p.match("a", HIT, 0) == 4 * T
    blocks = list(range(10, 19))
    p.on_alloc("a", blocks, 4 * T)
    per_chunk = 4096
    assert p._queued_load_bytes() == 4 * per_chunk and p._queued_load_bytes(lower=True) == 2 * per_chunk
    p.update_request("a", tokens=HIT, all_block_ids=blocks)
    plan = p.build_step({"a": 1}, {"a": 4 * T})
    assert p._queued_load_bytes(lower=True) == 2 * per_chunk  # sent: in flight until the step is done
    p.on_report(WorkerReport(steps_done=[plan.async_step if plan.async_loads else plan.step]))
    assert p._queued_load_bytes() == 0 and p._queued_load_bytes(lower=True) == 0


def back(ram=16, disk=64):
    return Planner(num_slots=ram, chunk_tokens=T, block_size=BS, seed=namespace_seed("t"), num_workers=1,
                   slot_bytes=4096, lower=[LowerTier(ChunkIndex(disk), "disk")], write_policy="back")


def one_chunk(p, i, copies=True):
    """Store the one-chunk prompt i and report every copy the next step plans."""
    plan = prefill(p, f"r{i}", list(range(100 * i, 100 * i + 65)), [1, 2, 3])
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    nxt = p.build_step({}, {})
    if copies:
        p.on_report(WorkerReport(stored=[c.ticket for c in nxt.copies]))
    return plan.stores[0].key if plan.stores else None, nxt.copies


def test_write_back_writes_nothing_while_the_working_set_fits_the_first_tier():
    p = back(ram=16)
    for i in range(13):  # 13 of 16 slots: more left than two steps of stores (one chunk each)
        _, copies = one_chunk(p, i)
        assert copies == []
    assert len(p.lower[0].index) == 0 and p.tier_stats.writedowns[1] == 0


def test_write_back_writes_down_the_evicting_end_first_and_evicts_only_clean_chunks():
    p = back(ram=16)
    keys = [one_chunk(p, i)[0] for i in range(15)]  # the 15th leaves one slot: the oldest is written down
    assert keys[0] in p.lower[0].index and p.tier_stats.writedowns[1] >= 1
    for i in range(15, 40):  # a working set past the first tier: every eviction finds a clean chunk
        one_chunk(p, i)
    assert p.tier_stats.evictions[0] == 40 - 16 and p.tier_stats.dropped == 0
    assert all(k in p.index or k in p.lower[0].index for k in keys)  # nothing lost
    assert p.tier_stats.writedowns[1] < 40  # the chunks still in the first tier were never written


def test_write_back_counts_a_dirty_chunk_a_burst_evicts_unwritten_as_dropped():
    p = back(ram=8)
    for i in range(8):  # the drive refuses every write-down: the first tier fills with dirty chunks
        plan = prefill(p, f"r{i}", list(range(100 * i, 100 * i + 65)), [1, 2, 3])
        p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores],
                                 store_failed=[c.ticket for c in plan.copies]))
    assert p.tier_stats.dropped == 0 and len(p.lower[0].index) == 0  # a failed write-down alone loses nothing
    burst = prefill(p, "burst", list(range(5000, 5000 + 4 * 64 + 1)), list(range(10, 19)))
    # the burst's 4 stores evict 4 dirty chunks (the write-downs just planned hold theirs): dropped
    assert len(burst.stores) == 4 and p.tier_stats.evictions[0] == 4 and p.tier_stats.dropped == 4
    assert all(p.index.is_pinned(c.key) for c in burst.copies)


def test_after_a_restart_write_through_writes_down_what_the_first_tier_alone_holds():
    """A server killed before its write-downs were done: the rebuilt first tier holds chunks the
    disk tier does not; they are written down first, pinned, so nothing evicts them unwritten."""
    p = tiered(ram=2)
    keys = p._request("setup", list(range(129))).keys[:2]
    p.index.plan_store(keys)
    for k in keys:
        p.index.commit(k)
    p.lower[0].index.plan_store(keys[:1])
    p.lower[0].index.commit(keys[0])
    assert p.reconcile_tiers() == 1
    nxt = prefill(p, "new", list(range(7000, 7129)), [4, 5, 6, 7, 8])  # two new chunks want the two slots
    assert [(c.key, c.src, c.dst) for c in nxt.copies] == [(keys[1], 0, 1)]
    assert keys[1] in p.index and p.index.is_pinned(keys[1])  # held until its copy is down
    assert len(nxt.stores) == 1 and keys[0] not in p.index  # the clean one made room


def test_write_downs_in_flight_are_bounded_so_a_slow_drive_never_fills_the_first_tier_with_pins():
    """A tier of 256 slots pins at most 32 chunks (an eighth) for write-downs at once; the rest
    wait unpinned, oldest first, and new stores still find room."""
    p = tiered(ram=256, disk=512)
    keys = []
    for i in range(40):  # 40 one-chunk prompts committed, no copy reported (a slow drive)
        plan = prefill(p, f"r{i}", list(range(100 * i, 100 * i + 65)), [1, 2, 3])
        p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
        keys.append(plan.stores[0].key)
    # each prefill's step planned the write-down of the one before it, until 32 were in flight
    assert [k for k in keys if p.index.is_pinned(k)] == keys[:32]
    assert p.build_step({}, {}).copies == []  # none reported: nothing more is pinned
    p.on_report(WorkerReport(stored=[t for t, tk in p._tickets.items() if tk.copy]))
    nxt = p.build_step({}, {})
    assert [c.key for c in nxt.copies] == keys[32:40]  # the rest, oldest first
    assert p.tier_stats.writedowns[1] == 32


def test_write_through_keeps_chunks_waiting_for_their_write_down_and_declines_the_new_store(monkeypatch):
    """A drive so slow that no write-down is in flight yet: the first tier holds chunks whose only
    copy it is, and a new store finds nothing clean to evict. It is declined (counted), and the
    stored chunks stay until their write-downs come; a store then evicts the written one."""
    from tutti.engine.sched import tiers as tiers_mod

    monkeypatch.setattr(tiers_mod, "DOWN_IN_FLIGHT_MIN", 0)  # an eighth of 2 slots: none in flight
    p = tiered(ram=2, disk=8)
    keys = []
    for i, req in enumerate("ab"):
        plan = prefill(p, req, list(range(1000 * i, 1000 * i + 65)), [1 + 3 * i, 2 + 3 * i, 3 + 3 * i])
        p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
        assert plan.copies == []
        keys.append(plan.stores[0].key)
    c = prefill(p, "c", list(range(5000, 5065)), [7, 8, 9])
    assert c.stores == [] and p.stats.stores_declined == 1  # the new chunk, not a stored one
    assert all(k in p.index for k in keys) and p.tier_stats.evictions[0] == 0 and p.tier_stats.dropped == 0
    monkeypatch.setattr(tiers_mod, "DOWN_IN_FLIGHT_MIN", 16)  # the drive catches up
    down = p.build_step({}, {})
    assert [cp.key for cp in down.copies] == keys
    p.on_report(WorkerReport(stored=[cp.ticket for cp in down.copies]))
    d = prefill(p, "d", list(range(6000, 6065)), [10, 11, 12])
    assert len(d.stores) == 1 and p.tier_stats.evictions[0] == 1 and keys[0] not in p.index  # written: it may go
    assert keys[0] in p.lower[0].index and p.tier_stats.dropped == 0


def test_write_through_lets_a_chunk_whose_write_down_failed_go():
    """A failed write-down is not retried: the chunk no longer waits for one and may be evicted
    (its drop was counted when the write-down failed), so a failing drive never blocks the tier."""
    p = tiered(ram=2, disk=8)
    a = prefill(p, "a", list(range(65)), [1, 2, 3])
    p.on_report(WorkerReport(stored=[s.ticket for s in a.stores]))
    down = p.build_step({}, {})
    p.on_report(WorkerReport(store_failed=[c.ticket for c in down.copies]))
    assert p.tier_stats.dropped == 1
    b = prefill(p, "b", list(range(1000, 1065)), [4, 5, 6])
    p.on_report(WorkerReport(stored=[s.ticket for s in b.stores]))
    c = prefill(p, "c", list(range(2000, 2065)), [7, 8, 9])  # b waits for its write-down (planned now): a goes
    assert len(c.stores) == 1 and a.stores[0].key not in p.index and b.stores[0].key in p.index
    assert p.stats.stores_declined == 0


def test_a_promotion_never_evicts_a_chunk_no_tier_below_holds():
    """Promoting is optional (the chunk is below already): it takes the place of a clean chunk or
    none, never of one whose write-down has not come (its only copy)."""
    p = tiered(ram=2)
    keys = p._request("setup", list(range(129))).keys[:2]
    other = p._request("other", list(range(5000, 5065))).keys[0]
    p.index.plan_store(keys)
    for k in keys:
        p.index.commit(k)  # the first tier full of chunks not written down
    p.lower[0].index.plan_store([other])
    p.lower[0].index.commit(other)
    p._queue_up(other, 1)
    assert p.build_step({}, {}).copies == []  # no clean chunk to give up: not promoted
    assert all(k in p.index for k in keys) and p.tier_stats.evictions[0] == 0
    p.lower[0].index.plan_store(keys[:1])
    p.lower[0].index.commit(keys[0])  # one of them is written down now
    p._queue_up(other, 1)
    up = p.build_step({}, {})
    assert [(c.key, c.src, c.dst) for c in up.copies] == [(other, 1, 0)] and keys[0] not in p.index
    assert keys[1] in p.index


def test_a_staged_hit_waits_without_blocks_until_its_chunks_are_up_then_loads_from_the_first_tier():
    """promote "stage": vLLM allocates no blocks for a lookup answered None, so the drive's read
    holds no GPU memory idle; the copy up is the hit's promotion, and the hit loads from RAM."""
    p = tiered(ram=2, stage=True)
    a = list(range(129))
    first, _ = stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])  # evicts a's chunks from tier 0
    queried = p.stats.queried_tokens
    assert p.match("c", a, 0) is None and p.tier_stats.staged_hits == 1
    up = p.build_step({}, {})
    assert [(c.src, c.dst) for c in up.copies] == [(1, 0), (1, 0)]
    assert [c.key for c in up.copies] == [s.key for s in first.stores]
    assert p.match("c", a, 0) is None  # the copies are still on their way
    p.on_report(WorkerReport(stored=[c.ticket for c in up.copies]))
    n = p.match("c", a, 0)
    assert n == 2 * T and p.stats.queried_tokens == queried + len(a)  # one lookup counted, not three
    p.on_alloc("c", [11, 12, 13, 14, 15], n)
    plan = p.build_step({"c": 1}, {"c": 128})
    assert [ld.tier for ld in plan.loads] == [0, 0]
    assert p.tier_stats.hit_tokens == [2 * T, 0] and p.tier_stats.promotions == 2
    assert p.build_step({}, {}).copies == []  # promoted once: nothing copied up again after the load


def test_a_staged_copy_that_finds_no_room_leaves_the_hit_to_load_from_below():
    """The first tier holds only chunks still waiting for their write-down: a staged copy may not
    take their place, so the request is not kept waiting; it loads from the drive."""
    p = tiered(ram=2, stage=True)
    a = list(range(129))
    stored(p, "a", a, [1, 2, 3, 4, 5])
    b = prefill(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    p.on_report(WorkerReport(stored=[s.ticket for s in b.stores]))  # b in tier 0, not yet written down
    assert p.match("c", a, 0) is None
    step = p.build_step({}, {})
    assert [(c.src, c.dst) for c in step.copies] == [(0, 1), (0, 1)]  # b's write-downs only
    n = p.match("c", a, 0)
    assert n == 2 * T
    p.on_alloc("c", [11, 12, 13, 14, 15], n)
    assert [ld.tier for ld in p.build_step({"c": 1}, {"c": 128}).loads] == [1, 1]


def test_a_staged_hit_waits_at_most_stage_wait_s(monkeypatch):
    import tutti.engine.sched.tiers as tiers_mod

    p = tiered(ram=2, stage=True)
    a = list(range(129))
    stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    assert p.match("c", a, 0) is None
    up = p.build_step({}, {})
    assert len(up.copies) == 2  # planned, never reported: a copier far behind
    monkeypatch.setattr(tiers_mod, "STAGE_WAIT_S", 0.0)
    n = p.match("c", a, 0)
    assert n == 2 * T  # loads from where the chunks are
    p.on_alloc("c", [11, 12, 13, 14, 15], n)
    assert [ld.tier for ld in p.build_step({"c": 1}, {"c": 128}).loads] == [1, 1]


def test_without_stage_a_hit_from_below_is_answered_at_once():
    p = tiered(ram=2)
    a = list(range(129))
    stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    assert p.match("c", a, 0) == 2 * T and p.tier_stats.staged_hits == 0


def test_a_hit_is_staged_only_while_the_requests_in_flight_hold_most_of_the_gpus_blocks():
    """stage_pressure: idle blocks cost only where others wait for them. The requests in flight
    are counted by their distinct blocks (a prefix two of them share is one set of blocks), with
    the hit's own: above the share the hit waits holding none, below it loads at once."""
    def setup(gpu_blocks):
        p = tiered(ram=2, stage=True, gpu_blocks=gpu_blocks, stage_pressure=0.5)
        a = list(range(129))
        stored(p, "a", a, [1, 2, 3, 4, 5])
        stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])  # evicts a's chunks from tier 0
        p.finished("a"), p.finished("b")
        for r in ("x", "y"):  # two requests in flight sharing four blocks, each with one of its own
            p.update_request(r, tokens=list(range(5000, 5200)), all_block_ids=[20, 21, 22, 23, 30 if r == "x" else 31])
        return p, a
    p, a = setup(gpu_blocks=16)  # 6 blocks in flight + the hit's 4 > 0.5 x 16: staged
    assert p.match("c", a, 0) is None and p.tier_stats.staged_hits == 1
    p, a = setup(gpu_blocks=24)  # 10 of 24 (14, were the shared blocks counted twice): loads at once
    assert p.match("c", a, 0) == 2 * T and p.tier_stats.staged_hits == 0
    p.on_alloc("c", [11, 12, 13, 14, 15], 2 * T)
    assert [ld.tier for ld in p.build_step({"c": 1}, {"c": 128}).loads] == [1, 1]
    p, a = setup(gpu_blocks=0)  # vLLM gave no block count: every hit from below is staged
    assert p.match("c", a, 0) is None


def test_the_blocks_in_flight_are_counted_as_they_are_allocated_preempted_and_freed():
    """Kept as vLLM reports blocks (a lookup reads one number, never walks the requests), and only
    where promote "stage" weighs them."""
    p = tiered(stage=True, gpu_blocks=100, stage_pressure=0.5)
    toks = list(range(200))
    p.update_request("x", tokens=toks, all_block_ids=[1, 2, 3])
    p.update_request("y", tokens=toks, all_block_ids=[1, 2, 4])  # shares blocks 1 and 2 with x
    assert len(p._block_refs) == 4
    p.update_request("x", new_block_ids=[5])
    p.preempted("y")  # its blocks are freed; x still holds 1 and 2
    assert sorted(p._block_refs) == [1, 2, 3, 5]
    p.on_alloc("y", [6, 7], 0)  # resumed with new blocks
    # the blocks their prompts still need (200 tokens: 7 blocks of 32): x holds 4, y 2
    assert p._reserved_blocks == (7 - 4) + (7 - 2)
    p.finished("x")
    assert sorted(p._block_refs) == [6, 7] and p._reserved_blocks == 7 - 2
    p.update_request("y", new_block_ids=list(range(8, 14)))  # past its prompt: nothing more to come
    p.preempted("y")
    assert p._reserved_blocks == 0 and not p._block_refs
    assert tiered(stage=False, gpu_blocks=100, stage_pressure=0.5)._block_refs is None  # nothing to weigh


def test_a_staged_hit_whose_blocks_would_not_fit_stays_deferred_until_they_do(monkeypatch):
    """Answered while its blocks would not fit, vLLM would fail the request's allocation and stop
    taking waiting requests at it; on vLLM 0.26 that strands loaded requests queued behind it, with
    their blocks (vllm-project/vllm#57841). "Later" makes vLLM pass over it instead, until the
    requests in flight leave room (what they hold and what their prompts still need), or until
    STAGE_FIT_WAIT_S."""
    import tutti.engine.sched.tiers as tiers_mod

    def staged(gpu_blocks):
        p = tiered(ram=2, stage=True, gpu_blocks=gpu_blocks, stage_pressure=0)
        a = list(range(129))  # 5 blocks of 32 tokens
        stored(p, "a", a, [1, 2, 3, 4, 5])
        stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])  # evicts a's chunks from tier 0
        p.finished("a"), p.finished("b")
        # in flight: x holds 6 blocks of a prompt that needs 8 (2 more reserved)
        p.update_request("x", tokens=list(range(5000, 5256)), all_block_ids=list(range(20, 26)))
        assert p.match("c", a, 0) is None
        up = p.build_step({}, {})
        p.on_report(WorkerReport(stored=[c.ticket for c in up.copies]))  # c's chunks are up
        return p, a
    p, a = staged(gpu_blocks=12)  # 12 - vLLM's null block - 6 held - 2 reserved = 3 free < 5
    assert p.match("c", a, 0) is None and p.match("c", a, 0) is None
    p.finished("x")
    assert p.match("c", a, 0) == 2 * T  # room now: answered, from the first tier
    p.on_alloc("c", [11, 12, 13, 14, 15], 2 * T)
    assert [ld.tier for ld in p.build_step({"c": 1}, {"c": 128}).loads] == [0, 0]
    p, a = staged(gpu_blocks=14)  # 14 - 1 - 8 = 5: fits at once
    assert p.match("c", a, 0) == 2 * T
    p, a = staged(gpu_blocks=13)  # 4 free: waits, past STAGE_WAIT_S (the copies' deadline) too
    monkeypatch.setattr(tiers_mod, "STAGE_WAIT_S", 0.0)
    assert p.match("c", a, 0) is None
    monkeypatch.setattr(tiers_mod, "STAGE_FIT_WAIT_S", 0.0)
    assert p.match("c", a, 0) == 2 * T  # waited long enough: answered, and vLLM decides


def test_a_request_aborted_while_staged_leaves_no_pin_and_its_copies_still_serve_the_next():
    """vLLM aborts a request whose lookup said "later": its copies go on (they are promotions like
    any other), nothing stays pinned, and the next request with that prefix loads from tier 0."""
    p = tiered(ram=2, stage=True)
    a = list(range(129))
    stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    assert p.match("c", a, 0) is None
    assert p.finished("c") is False and p._backlog == 0
    up = p.build_step({}, {})
    assert len(up.copies) == 2 and all(p.lower[0].index.is_pinned(c.key) for c in up.copies)
    p.on_report(WorkerReport(stored=[c.ticket for c in up.copies]))
    assert not any(p.lower[0].index.is_pinned(c.key) for c in up.copies)
    n = p.match("d", a, 0)
    assert n == 2 * T  # in tier 0 already: nothing to stage, answered at once
    p.on_alloc("d", [11, 12, 13, 14, 15], n)
    assert [ld.tier for ld in p.build_step({"d": 1}, {"d": 128}).loads] == [0, 0]


def test_staged_copies_count_as_the_drives_queue_until_they_are_reported():
    """With "stage" a hit's drive reads are its copies up: the next hit is priced behind them."""
    p = tiered(ram=2, stage=True)
    a = list(range(129))
    stored(p, "a", a, [1, 2, 3, 4, 5])
    stored(p, "b", list(range(1000, 1129)), [6, 7, 8, 9, 10])
    assert p._queued_load_bytes(lower=True) == 0
    assert p.match("c", a, 0) is None
    assert p._queued_load_bytes(lower=True) == 2 * 4096  # queued to be copied
    up = p.build_step({}, {})
    assert p._queued_load_bytes(lower=True) == 2 * 4096  # copying
    p.on_report(WorkerReport(stored=[c.ticket for c in up.copies]))
    assert p._queued_load_bytes(lower=True) == 0
