import random

import pytest

from tutti.engine.sched.index import ChunkIndex
from tutti.engine.keys import chunk_keys, namespace_seed


def k(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_keys_are_chained_deterministic_and_seeded():
    seed = namespace_seed("m", "bf16", 1)
    toks = list(range(1000))
    a = chunk_keys(toks, 256, seed)
    assert len(a) == 3 and len(set(a)) == 3
    assert chunk_keys(toks, 256, seed) == a
    # a change in chunk 0 changes every later key (the chain), not only chunk 0
    b = chunk_keys([7] + toks[1:], 256, seed)
    assert all(x != y for x, y in zip(a, b))
    # another namespace never collides
    assert not set(a) & set(chunk_keys(toks, 256, namespace_seed("m", "fp16", 1)))
    # continuing a chain gives the same keys as hashing from scratch
    assert chunk_keys(toks, 256, seed, start=1, parent=a[0]) == a[1:]


def test_keys_are_stable_across_processes():
    import subprocess, sys
    code = ("from tutti.engine.keys import chunk_keys, namespace_seed;"
            "print(chunk_keys(list(range(600)), 256, namespace_seed('m'))[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".").stdout.strip()
    assert out == chunk_keys(list(range(600)), 256, namespace_seed("m"))[1].hex()


def test_lookup_prefix_stops_at_first_gap():
    idx = ChunkIndex(8)
    res = idx.plan_store([k(0), k(1), k(3)])
    for key in res.slots:
        idx.commit(key)
    assert idx.lookup_prefix([k(0), k(1), k(2), k(3)]) == 2
    assert idx.lookup_prefix([k(2), k(0)]) == 0


def test_pending_is_invisible_until_commit_and_abort_frees():
    idx = ChunkIndex(2)
    res = idx.plan_store([k(0), k(1)])
    assert idx.lookup_prefix([k(0)]) == 0
    assert idx.plan_store([k(2)]).declined == [k(2)]  # both slots pending: nothing to evict
    idx.abort(k(1))
    assert idx.plan_store([k(2)]).slots == {k(2): res.slots[k(1)]}
    idx.commit(k(0))
    assert idx.lookup_prefix([k(0)]) == 1
    idx.check_invariants()


def test_eviction_is_lru_and_never_touches_pinned():
    idx = ChunkIndex(3)
    for i in range(3):
        idx.plan_store([k(i)])
        idx.commit(k(i))
    idx.pin([k(0)])
    idx.lookup_prefix([k(1)])  # k(1) most recently used; k(2) is the LRU unpinned one
    res = idx.plan_store([k(10)])
    assert res.evicted == [k(2)]
    res = idx.plan_store([k(11)])
    assert res.evicted == [k(1)]
    assert k(0) in idx
    res = idx.plan_store([k(12)])  # k(0) pinned, k(10)/k(11) pending: declined
    assert res.declined == [k(12)] and k(0) in idx
    idx.unpin([k(0)])
    assert idx.plan_store([k(12)]).evicted == [k(0)]
    idx.check_invariants()


def test_random_pressure_keeps_capacity_and_pins():
    rng = random.Random(0)
    idx = ChunkIndex(16)
    pinned: set[bytes] = set()
    for step in range(2000):
        op = rng.random()
        key = k(rng.randrange(64))
        if op < 0.5:
            res = idx.plan_store([key])
            assert not set(res.evicted) & pinned
            for kk in res.slots:
                (idx.commit if rng.random() < 0.8 else idx.abort)(kk)
        elif op < 0.7 and key in idx and key not in pinned:
            idx.pin([key]); pinned.add(key)
        elif op < 0.9 and pinned:
            p = rng.choice(sorted(pinned)); idx.unpin([p]); pinned.discard(p)
        for p in pinned:
            assert p in idx
        assert idx.used_slots <= 16
    idx.check_invariants()


def test_rebuild_from_journal_entries():
    idx = ChunkIndex(4)
    idx.rebuild({2: k(5), 0: k(6), 9: k(7)})  # slot 9 is beyond capacity: ignored
    assert k(5) in idx and k(6) in idx and k(7) not in idx
    res = idx.plan_store([k(1), k(2)])
    assert set(res.slots.values()) == {1, 3}
    idx.check_invariants()


def test_zero_capacity_is_a_clear_error():
    with pytest.raises(ValueError, match="capacity"):
        ChunkIndex(0)


def test_index_memory_follows_the_chunks_stored_not_the_capacity():
    import tracemalloc

    tracemalloc.start()
    idx = ChunkIndex(2000 * (1 << 40) // (1 << 20))  # 2000 TiB of 1 MiB chunks
    idx.rebuild({5: b"a" * 32, 9: b"b" * 32})
    res = idx.plan_store([bytes([i]) * 32 for i in range(10)])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20
    assert sorted(res.slots.values()) == [0, 1, 2, 3, 4, 6, 7, 8, 10, 11]  # the holes first, then new slots
    idx.check_invariants()


def test_a_prefix_touched_or_stored_in_order_is_given_up_from_its_end():
    """lookup_prefix and touch_prefix take keys in prefix order and touch the tail first: an
    LRU index then evicts a prefix from its end (a hit needs every chunk before the loaded ones)."""
    from tutti.engine.sched.index import ChunkIndex

    idx = ChunkIndex(4)
    keys = [bytes([i]) * 32 for i in range(4)]
    idx.plan_store(keys)
    for k in keys:  # stored head first, as a prompt's chunks are
        idx.commit(k)
    assert idx.lookup_prefix(keys) == 4
    assert idx.plan_store([b"n" * 32]).evicted == [keys[3]]
    idx.commit(b"n" * 32)
    idx.touch_prefix(keys[:3] + [b"gone" * 8])  # the non-resident are skipped
    assert idx.plan_store([b"m" * 32]).evicted == [b"n" * 32]
    assert idx.plan_store([b"o" * 32]).evicted == [keys[2]]
    idx.check_invariants()


def test_rebuild_keeps_the_journals_order_as_recency():
    from tutti.engine.sched.index import ChunkIndex

    idx = ChunkIndex(4)
    idx.rebuild({3: b"c" * 32, 0: b"a" * 32, 2: b"b" * 32})  # stored c, a, b: c the oldest
    assert idx.plan_store([b"n" * 32]).evicted == []  # slot 1 is free
    idx.commit(b"n" * 32)
    assert idx.plan_store([b"m" * 32]).evicted == [b"c" * 32]
    idx.check_invariants()
