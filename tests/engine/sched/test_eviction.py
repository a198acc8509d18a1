"""Eviction policies behind the chunk index: LRU (the default) and FIFO order what a full store
gives up; a pinned chunk is never evicted whatever the order; a policy chosen by name or
"package.module:attr" from the config reaches the planner's index; a bad one is refused naming
the key, before any IO."""

import pytest

from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.engine.sched.eviction import FIFO, LRU, available_evictions, get_eviction, register_eviction
from tutti.engine.sched.index import ChunkIndex


def fill(idx, keys):
    res = idx.plan_store(keys)
    for k in keys:
        idx.commit(k)
    return res


def test_lru_keeps_what_was_hit_and_fifo_does_not():
    for policy, survivor in ((LRU(), b"a"), (FIFO(), b"b")):
        idx = ChunkIndex(2, policy)
        fill(idx, [b"a", b"b"])
        assert idx.lookup_prefix([b"a"]) == 1  # a hit on a
        res = fill(idx, [b"c"])
        assert set(res.evicted) == ({b"a", b"b"} - {survivor}) and survivor in idx
        idx.check_invariants()


def test_a_pinned_chunk_is_never_evicted_whatever_the_order_says():
    class Newest:
        """Evicts the newest first: a policy the index must still overrule for pins."""

        def __init__(self):
            self.keys = []

        def inserted(self, k):
            self.keys.append(k)

        def touched(self, k):
            pass

        def removed(self, k):
            self.keys.remove(k)

        def order(self):
            return reversed(list(self.keys))

    idx = ChunkIndex(2, Newest())
    fill(idx, [b"a", b"b"])
    idx.pin([b"b"])
    assert fill(idx, [b"c"]).evicted == [b"a"]  # b is newest, but pinned
    idx.pin([b"c"])
    assert fill(idx, [b"d"]).declined == [b"d"]  # everything pinned: declined, never forced
    idx.check_invariants()


def test_policies_from_the_config_reach_the_planner(tmp_path, monkeypatch):
    from worker_helpers import geometry

    from tutti.engine.build import build_planner

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "mypolicy.py").write_text("from tutti.engine.sched.eviction import FIFO\nclass Mine(FIFO):\n    name = 'mine'\n")
    base = {"root": str(tmp_path / "kv"), "capacity_bytes": 4 * geometry().slot_bytes, "chunk_tokens": 32,
            "writer_id": ""}
    assert isinstance(build_planner(base, geometry()).index.eviction, LRU)
    p = build_planner({**base, "eviction_policy": "mypolicy:Mine"}, geometry())
    assert type(p.index.eviction).__name__ == "Mine"
    register_eviction("fifo2", FIFO)
    assert "fifo2" in available_evictions() and isinstance(get_eviction("fifo2"), FIFO)
    with pytest.raises(ConfigError, match="eviction_policy='nope': unknown"):
        EngineConfig.from_dict({**base, "eviction_policy": "nope"})
    with pytest.raises(ConfigError, match="eviction_policy='no_such_mod:X': cannot import module"):
        EngineConfig.from_dict({**base, "eviction_policy": "no_such_mod:X"})
    (tmp_path / "notpolicy.py").write_text("class P:\n    pass\n")
    with pytest.raises(ConfigError, match="no inserted, touched, removed, order method"):
        EngineConfig.from_dict({**base, "eviction_policy": "notpolicy:P"})
