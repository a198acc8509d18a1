"""Many writers on one namespace, with the real planner, worker pipeline and files: what one
writer made durable is a hit on the others (within the follow interval) and is not stored
again; a chunk its owner evicts or rewrites is recomputed by the reader, never served; the
same writer id twice is refused; a writer's capacity bounds only its own files."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tutti.engine.build import build_planner, build_worker
from tutti.store.chunk_store import StoreLockedError, list_writers

from worker_helpers import L, T, Server, geometry, make_caches, prompt, run_step, server_cfg, views
from tutti.kernels import PagedLayout

BPC = 2  # blocks per chunk (T tokens, N per block)


def cfg(root, writer, **kw):
    return server_cfg(root, writer, **kw)


def wait_for(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return cond()


def test_a_chunk_one_writer_stored_is_a_hit_on_another(tmp_path):
    a, b = Server(tmp_path, "a", 0), Server(tmp_path, "b", 1)
    try:
        p = prompt(1, 2)
        blocks_a = list(range(0, 2 * BPC + 1))
        hit, _, plan = a.request("r1", p, blocks_a)
        assert hit == 0 and len(plan.stores) == 2
        assert list_writers(str(tmp_path), a.worker.store.fingerprint) == ["a", "b"]
        t0 = time.monotonic()
        assert wait_for(lambda: all(k in b.planner.foreign for k in (st.key for st in plan.stores)))
        delay = time.monotonic() - t0
        blocks_b = list(range(10, 10 + 2 * BPC + 1))
        hit, failed, plan_b = b.request("r2", p, blocks_b)
        assert hit == 2 * T and failed == set() and not plan_b.stores  # served from a's files, not stored again
        assert {ld.source for ld in plan_b.loads} == {"a"}
        for ca, cb in zip(a.caches, b.caches):
            assert torch.equal(cb[10:10 + 2 * BPC], ca[0:2 * BPC])  # bit exact across servers
        assert delay < 1.0
        # b's own capacity is untouched: nothing of a's chunks lives in b's files
        assert b.worker.store.entries() == {}
    finally:
        a.close()
        b.close()


def test_replicas_with_private_ram_tiers_share_their_disk_tier(tmp_path):
    """`tiers`: each server's RAM tier is its own, the disk tier behind them is one root; what one
    wrote down is a hit on the other, loaded from the first's files in the disk tier, priced and
    loaded as that tier's (never stored again)."""
    def tiers(name):
        (tmp_path / name).mkdir()
        return {"tiers": [{"root": str(tmp_path / name / "ram"), "capacity_bytes": 4 * geometry().slot_bytes},
                          {"root": str(tmp_path / "disk"), "capacity_bytes": 8 * geometry().slot_bytes}]}

    a, b = Server(tmp_path, "a", 0, **tiers("a")), Server(tmp_path, "b", 1, **tiers("b"))
    try:
        p = prompt(3, 2)
        hit, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        assert hit == 0 and len(plan.stores) == 2
        down = a.planner.build_step({}, {})  # the write-downs of a's committed chunks
        assert len(down.copies) == 2
        run_step(a.worker, down)
        a.worker.flush()
        a.planner.on_report(a.worker.take_report())
        assert a.planner.tier_stats.writedowns[1] == 2
        assert wait_for(lambda: all(st.key in b.planner.foreign for st in plan.stores))
        hit, failed, plan_b = b.request("r2", p, list(range(10, 10 + 2 * BPC + 1)))
        assert hit == 2 * T and failed == set() and not plan_b.stores
        assert {(ld.source, ld.tier) for ld in plan_b.loads} == {("a", 1)}
        for ca, cb in zip(a.caches, b.caches):
            assert torch.equal(cb[10:10 + 2 * BPC], ca[0:2 * BPC])  # bit exact, from a's disk-tier files
        assert b.worker.store.entries() == {} and b.worker.ctx.lower[0][0].entries() == {}
    finally:
        a.close()
        b.close()


def _tiered_pair(tmp_path, announce=False, **kw):
    def tiers(name):
        (tmp_path / name).mkdir()
        return {"tiers": [{"root": str(tmp_path / name / "ram"), "capacity_bytes": 4 * geometry().slot_bytes},
                          {"root": str(tmp_path / "disk"), "capacity_bytes": 8 * geometry().slot_bytes}], **kw}

    return (Server(tmp_path, "a", 0, announce=announce, **tiers("a")),
            Server(tmp_path, "b", 1, announce=announce, **tiers("b")))


def _copies(s: Server):
    """One step of nothing but the planner's copies, run, flushed and reported; its plan."""
    plan = s.planner.build_step({}, {})
    run_step(s.worker, plan)
    s.worker.flush()
    s.planner.on_report(s.worker.take_report())
    return plan


def _shared_hit(a: Server, b: Server, seed: int, n: int):
    """a stores a 2-chunk prompt and writes it down into the shared disk tier; b, once it follows
    a's journal there, hits it: (the prompt, its chunk keys, b's plan)."""
    p = prompt(seed, 2)
    _, _, plan = a.request(f"a{n}", p, list(range(0, 2 * BPC + 1)))
    _copies(a)
    keys = [st.key for st in plan.stores]
    assert wait_for(lambda: all(k in b.planner.foreign for k in keys))
    _, _, plan_b = b.request(f"b{n}", p, list(range(10, 10 + 2 * BPC + 1)))
    return p, keys, plan_b


def test_a_replica_promotes_a_shared_disk_tier_hit_into_its_own_ram_tier(tmp_path):
    """Replicas with private RAM tiers over one disk tier: b's hit on a's chunk (read from a's
    disk-tier files) is then copied into b's RAM tier ("borrowed": a keeps it below, so b never
    writes it down), announced by b, and b's next hit is served from its own RAM, bit exact (the
    same hit before the copy was read from a's files)."""
    a, b = _tiered_pair(tmp_path, announce=True)
    try:
        p = prompt(4, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        assert len(_copies(a).copies) == 2  # written down into the shared disk tier
        keys = [st.key for st in plan.stores]
        assert wait_for(lambda: all(k in b.planner.foreign for k in keys))
        b.planner.take_events()
        hit, failed, plan_b = b.request("r2", p, list(range(10, 10 + 2 * BPC + 1)))
        assert hit == 2 * T and failed == set() and {(ld.source, ld.tier) for ld in plan_b.loads} == {("a", 1)}
        up = _copies(b)
        assert [(c.source, c.src, c.dst) for c in up.copies] == [("a", 1, 0)] * 2
        assert b.planner.tier_stats.promotions == b.planner.tier_stats.borrowed == 2
        assert all(k in b.planner.index for k in keys)
        assert b.planner.tier_stats.hit_tokens == [0, 2 * T]  # the hit on a's chunks counts in the shared tier
        assert b.planner.tier_stats.hit_bytes == [0, 2 * geometry().slot_bytes]
        assert {e.key for e in b.worker.store.entries().values()} >= set(keys)  # journaled in b's own RAM tier
        assert [k for kind, ks in b.planner.take_events() if kind == "stored" for k in ks] == keys
        assert b.worker.ctx.lower[0][0].entries() == {}  # never written down: a holds it below
        assert not _copies(b).copies
        for c in b.caches:
            c[10:10 + 2 * BPC].zero_()
        hit, failed, plan_b = b.request("r3", p, list(range(10, 10 + 2 * BPC + 1)))
        assert hit == 2 * T and failed == set() and {(ld.source, ld.tier) for ld in plan_b.loads} == {(None, 0)}
        for ca, cb in zip(a.caches, b.caches):
            assert torch.equal(cb[10:10 + 2 * BPC], ca[0:2 * BPC])  # bit exact, from b's own RAM tier
    finally:
        a.close()
        b.close()


def test_with_write_back_a_borrowed_chunk_goes_first_and_is_never_counted_dropped(tmp_path):
    """write_policy "back": b's own chunks in its RAM tier are dirty (held nowhere below) and a
    borrowed one is not (its owner holds it below): a full RAM tier gives the borrowed chunks up
    before b's own, and giving them up drops nothing."""
    a, b = _tiered_pair(tmp_path, write_policy="back")
    try:
        p = prompt(7, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        for i in range(2):  # a's RAM tier fills and writes down what it will evict: p reaches the disk
            a.request(f"fill{i}", prompt(70 + i, 2), list(range(0, 2 * BPC + 1)))
            _copies(a)
        keys = [st.key for st in plan.stores]
        assert wait_for(lambda: all(k in b.planner.foreign for k in keys))
        b.request("r2", p, list(range(10, 10 + 2 * BPC + 1)))
        assert b.planner.tier_stats.promotions == 0 and len(_copies(b).copies) == 2
        assert b.planner.tier_stats.promotions == 2
        b.request("own", prompt(80, 2), list(range(20, 20 + 2 * BPC + 1)))  # fills b's 4 slots
        b.request("own2", prompt(81, 2), list(range(20, 20 + 2 * BPC + 1)))  # evicts 2: the borrowed ones
        assert not any(k in b.planner.index for k in keys)
        assert b.planner.tier_stats.evictions[0] == 2 and b.planner.tier_stats.dropped == 0
    finally:
        a.close()
        b.close()


def test_a_shared_hit_its_owner_gave_up_before_the_promotion_is_not_borrowed(tmp_path):
    """The promotion is planned only while the owner's journal (as b follows it) still holds the
    chunk in the slot b read, and the copy checks it again after its read: a chunk a gave up
    meanwhile is not copied into b's RAM tier (counted as a failed copy, never served)."""
    a, b = _tiered_pair(tmp_path)
    try:
        _, keys, _ = _shared_hit(a, b, 5, 1)
        # a's disk tier gives both chunks up: b's follower no longer finds them where b read them
        disk = a.worker.ctx.lower[0][0]
        slots = [slot for slot, e in disk.entries().items() if e.key in keys]
        assert len(slots) == 2
        disk.free(slots)
        assert wait_for(lambda: not any(k in b.planner.foreign for k in keys))
        assert not _copies(b).copies and b.planner.tier_stats.promotions == 0
        assert not any(k in b.planner.index for k in keys)
        # given up after the promotion was planned: the copy finds it gone (its read may already
        # have taken the owner's bytes) and commits nothing
        _, keys, _ = _shared_hit(a, b, 6, 2)
        up = b.planner.build_step({}, {})
        assert [(c.source, c.dst) for c in up.copies] == [("a", 0)] * 2
        disk.free([slot for slot, e in disk.entries().items() if e.key in keys])
        run_step(b.worker, up)
        b.worker.flush()
        b.planner.on_report(b.worker.take_report())
        assert b.worker.copier.failed == 2 and b.planner.tier_stats.promotions == 0
        assert not any(k in b.planner.index for k in keys) and b.worker.store.entries() == {}
    finally:
        a.close()
        b.close()


def test_a_chunk_evicted_by_its_owner_is_recomputed_by_the_reader(tmp_path):
    a, b = Server(tmp_path, "a", 0), Server(tmp_path, "b", 1)
    try:
        p = prompt(2, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        assert wait_for(lambda: all(k in b.planner.foreign for k in (st.key for st in plan.stores)))
        # b plans its loads from a's slots; meanwhile a fills its 4-slot capacity with other
        # prompts, evicting (and overwriting) the chunks b is about to read
        hit = b.planner.match("r2", p, 0)
        assert hit == 2 * T
        b.planner.on_alloc("r2", list(range(10, 10 + 2 * BPC + 1)), hit)
        for i in range(2):
            a.request(f"fill{i}", prompt(100 + i, 2), list(range(0, 2 * BPC + 1)))
        plan_b = b.planner.build_step({"r2": 1}, {"r2": hit})
        run_step(b.worker, plan_b)
        failed = b.worker.take_failed_blocks()
        assert failed == set(range(10, 10 + 2 * BPC))  # every block of the evicted chunks: recomputed
        b.planner.on_report(b.worker.take_report())
        assert b.planner.stats.loads_failed == 2
    finally:
        a.close()
        b.close()


def test_the_same_writer_id_twice_is_refused_and_a_restart_takes_its_files_back(tmp_path):
    a = Server(tmp_path, "a", 0)
    try:
        p = prompt(3, 1)
        a.request("r1", p, list(range(0, BPC + 1)))
        with pytest.raises(StoreLockedError, match="already has a writer"):
            Server(tmp_path, "a", 1)
    finally:
        a.close()
    again = Server(tmp_path, "a", 2)  # a restart under the same identity: its own chunks, its own files
    try:
        assert len(again.planner.index) == 1 and len(again.planner.foreign) == 0
        hit, failed, _ = again.request("r2", p, list(range(20, 20 + BPC + 1)))
        assert hit == T and failed == set()
    finally:
        again.close()


def test_the_only_writer_and_named_writers_read_each_other(tmp_path):
    legacy = Server(tmp_path, "", 0)  # the files at the namespace's top, as before servers shared it
    p = prompt(4, 1)
    legacy.request("r1", p, list(range(0, BPC + 1)))
    legacy.close()
    b = Server(tmp_path, "b", 1)
    try:
        assert b.planner.foreign.writers == [""]
        hit, failed, _ = b.request("r2", p, list(range(10, 10 + BPC + 1)))
        assert hit == T and failed == set()
    finally:
        b.close()


@pytest.mark.parametrize("damage", ["sps=0", "sps=null", "sps='64'", "sps=[]", "journal hard link"])
def test_another_writers_damaged_files_fail_its_chunks_never_the_step(tmp_path, damage):
    """Everything read from another writer's files is hostile input (hardening round two, items
    2 and 5): a manifest whose slots_per_slab is 0, null, a string or a list, or a journal that
    gained a hard link (refused as unsafe), fails that writer's chunks (vLLM recomputes them) and
    never raises out of the step."""
    import json
    import os

    a, b = Server(tmp_path, "a", 0), Server(tmp_path, "b", 1)
    try:
        p = prompt(3, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        assert wait_for(lambda: all(k in b.planner.foreign for k in (st.key for st in plan.stores)))
        wdir = next(d for d in tmp_path.rglob("w-a") if d.is_dir())
        if damage.startswith("sps="):
            m = json.loads((wdir / "manifest.json").read_text())
            m["slots_per_slab"] = json.loads(damage[4:].replace("'", '"'))
            (wdir / "manifest.json").write_text(json.dumps(m))
        else:
            # b reads a's journal once first (so its follow view exists), then the journal is linked
            hit, failed, _ = b.request("warm", p, list(range(10, 10 + 2 * BPC + 1)))
            assert hit == 2 * T and failed == set()
            os.link(wdir / "journal.bin", tmp_path / "journal-link")
            with open(wdir / "journal.bin", "ab") as f:
                f.write(b"")  # same size: b's follow view notices the link on its next stat
            os.utime(wdir / "journal.bin", ns=(1, 1))
        hit, failed, plan_b = b.request("r2", p, list(range(10, 10 + 2 * BPC + 1)))
        if hit:  # planned from a's chunks: each fails, nothing raised
            assert {ld.source for ld in plan_b.loads} == {"a"}
            assert failed == set(range(10, 10 + 2 * BPC))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("checks", [True, False])
def test_another_writers_chunk_rewritten_mid_step_is_never_served_even_with_checksums_off(tmp_path, checks):
    """Hardening round three, item 2: `verify_checksums: false` trusts this writer's own chunks
    only. The namespace's writer '' with checks off still follows named writers; writer a evicts
    and rewrites the slot of a chunk b is loading, after b read its first layer. Layers 1-2 then
    come from another prompt: unchecked they were scattered and served (failed=[]); every
    chunk of another writer is checked whatever the flag says, so the chunk fails."""
    a = Server(tmp_path, "a", 0)
    b = Server(tmp_path, "", 1, verify_checksums=checks)
    try:
        p = prompt(5, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        assert wait_for(lambda: all(k in b.planner.foreign for k in (st.key for st in plan.stores)))
        hit = b.planner.match("r2", p, 0)
        assert hit == 2 * T
        dst = list(range(10, 10 + 2 * BPC + 1))
        b.planner.on_alloc("r2", dst, hit)
        plan_b = b.planner.build_step({"r2": 1}, {"r2": hit})
        assert {ld.source for ld in plan_b.loads} == {"a"}
        w = b.worker
        w.start_step(plan_b)
        w.wait_layer(0)
        w.save_layer(0)
        for i in range(2):  # a fills its 4-slot capacity with other prompts: b's slots are rewritten
            a.request(f"fill{i}", prompt(200 + i, 2), list(range(0, 2 * BPC + 1)))
        for layer in range(1, L):
            w.wait_layer(layer)
            w.save_layer(layer)
        w.end_step()
        w.flush()
        failed = w.take_failed_blocks()
        assert failed == set(range(10, 10 + 2 * BPC)), failed  # recomputed: never another prompt's KV
    finally:
        a.close()
        b.close()


def AutoServer(root, engine_id, seed):
    """A server from the shared config with no writer id (its worker takes a slot, its scheduler
    learns it under vLLM's engine id)."""
    return Server(root, "auto", seed, engine_id=engine_id)


def test_identical_configs_find_their_own_writer_slots(tmp_path):
    """#29 item 2: replicas from one config. The first server takes the namespace's writer slot,
    the second (its lock held) auto-1, each with its own lock and files; the second hits what the
    first stored; a restart takes the slot its owner left."""
    import time

    a = AutoServer(tmp_path, "engine-a", 0)
    b = AutoServer(tmp_path, "engine-b", 1)
    try:
        assert (a.worker.cfg.writer_id, b.worker.cfg.writer_id) == ("", "auto-1")
        p = prompt(5, 2)
        assert a.request("r1", p, list(range(0, 2 * BPC + 1)))[0] == 0
        time.sleep(0.3)  # past the follow interval
        hit, failed, _ = b.request("r2", p, list(range(10, 10 + 2 * BPC + 1)))
        assert hit == 2 * T and failed == set()
        assert list_writers(str(tmp_path), geometry().fingerprint()) == ["", "auto-1"]
    finally:
        b.close()
    c = AutoServer(tmp_path, "engine-c", 2)
    try:
        assert c.worker.cfg.writer_id == "auto-1"
    finally:
        c.close()
        a.close()


def test_auto_with_several_workers_takes_only_the_namespaces_slot(tmp_path):
    import dataclasses

    geom = dataclasses.replace(geometry(), tp_size=2, tp_rank=0)
    v = views(make_caches(0))
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    first = build_worker(cfg(tmp_path, "auto"), geom, caches=v, layout=layout, engine_id="e1")
    try:
        with pytest.raises(StoreLockedError, match=r"each rank would pick its slot on its own; give each server"):
            build_worker(cfg(tmp_path, "auto"), geom, caches=views(make_caches(1)), layout=layout, engine_id="e2")
    finally:
        first.close()


def test_every_reader_announces_another_writers_chunks_and_their_removal(tmp_path):
    """With `announce`, a writer records its chunks' extras beside its journal; every other
    writer's follower queues ("stored", key, extras) within the follow interval once the chunk is
    durable there, and ("removed", key, extras) when its owner evicts it."""
    a = Server(tmp_path, "a", 0, announce=True)
    b = Server(tmp_path, "b", 1, announce=True)
    try:
        assert a.planner.writer_id == "a" and a.planner.extras is not None
        p = prompt(3, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        keys = [st.key for st in plan.stores]
        a.planner.extras.append([(k, {"h": [i]}) for i, k in enumerate(keys)])  # what the connector records
        t0 = time.monotonic()
        got = []
        assert wait_for(lambda: got.extend(b.planner.foreign.take_events()) or len(got) >= 2)
        assert time.monotonic() - t0 < 1.0
        assert sorted((kind, k, x["h"][0]) for kind, k, x in got) == sorted(("stored", k, i) for i, k in enumerate(keys))
        for i in range(2):  # a fills its 4-slot capacity: the first prompt's chunks are evicted
            a.request(f"fill{i}", prompt(200 + i, 2), list(range(0, 2 * BPC + 1)))
        gone = []
        assert wait_for(lambda: gone.extend(e for e in b.planner.foreign.take_events() if e[0] == "removed")
                        or {k for _, k, _ in gone} >= set(keys))
        assert not [e for e in a.planner.foreign.take_events() if e[1] in keys]  # a announces its own itself
    finally:
        a.planner.extras.close()
        b.planner.extras.close()
        a.close()
        b.close()


def test_another_writers_huge_extras_never_grow_a_followers_memory_past_its_bound(tmp_path, monkeypatch):
    """Round three, item 5: every line of another writer's extras.jsonl was kept, even for keys no
    writer holds (a 256 MiB file of short lines took a follower from 310 MiB to 3.2 GiB). Lines
    of chunks not journaled are kept up to MAX_EXTRAS_PENDING, whatever the file holds, while the
    lines of chunks the writer holds are still announced."""
    from tutti.engine import sharing
    from tutti.store.extras import ExtrasWriter

    monkeypatch.setattr(sharing, "MAX_EXTRAS_PENDING", 500)
    a = Server(tmp_path, "a", 0)
    b = Server(tmp_path, "b", 1)
    b.planner.foreign.close()
    try:
        p = prompt(7, 2)
        _, _, plan = a.request("r1", p, list(range(0, 2 * BPC + 1)))
        wdir = next(d for d in tmp_path.rglob("w-a") if d.is_dir())
        ex = ExtrasWriter(str(wdir))
        ex.append([(i.to_bytes(16, "little"), {"junk": i}) for i in range(20000)])  # keys no writer holds
        ex.append([(st.key, {"h": [i]}) for i, st in enumerate(plan.stores)])
        ex.close()
        fi = build_planner(cfg(tmp_path, "b"), geometry(), announce=True).foreign
        fi.close()  # refreshed by hand below
        got = []
        for _ in range(6):
            fi.refresh()
            got += fi.take_events()
            assert len(fi._extras) <= 500 + len(fi), len(fi._extras)
        assert sorted(k for kind, k, _ in got if kind == "stored") == sorted(st.key for st in plan.stores)
    finally:
        a.close()
        b.close()


def test_empty_writer_directories_are_never_followed_and_followers_are_bounded(tmp_path, monkeypatch):
    """Round three, item 7: every `w-*` directory was followed with its descriptors held for
    good: 2,100 empty ones took a server to 4,095 of 4,096 descriptors. A writer is followed once
    its journal exists, and at most MAX_FOLLOWED_WRITERS of them."""
    from tutti.engine import sharing

    a = Server(tmp_path, "a", 0)
    try:
        a.request("r1", prompt(8, 1), list(range(0, BPC + 1)))
        ns = next(d for d in tmp_path.rglob("w-a") if d.is_dir()).parent
        for i in range(2000):
            (ns / f"w-empty{i}").mkdir()
        fds = len(os.listdir("/proc/self/fd"))
        b = Server(tmp_path, "b", 1)
        try:
            assert b.planner.foreign.writers == ["a"]
            assert len(os.listdir("/proc/self/fd")) - fds < 100
        finally:
            b.close()
        for w in ("c", "d", "e"):  # real writers with journals, past a cap of 2
            Server(tmp_path, w, 2).close()
        monkeypatch.setattr(sharing, "MAX_FOLLOWED_WRITERS", 2)
        b = Server(tmp_path, "b", 1)
        try:
            assert len(b.planner.foreign.writers) == 2
        finally:
            b.close()
    finally:
        a.close()
