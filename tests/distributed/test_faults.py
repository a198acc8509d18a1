"""Faults across nodes on a real GlusterFS volume, with tutti's real planner, worker pipeline,
files and IO queue on each node (nodes.Server; no vLLM): a writer killed with -9 mid-store on
one node, a node's link to the storage cut mid-load, a node's file system client killed mid-load.
Nothing stored is lost or served wrong, the other node's server goes on, a reader fails only the
chunks it cannot read."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from nodes import BPC, T, Server, prompt, wait_for
from worker_helpers import run_step

HERE = Path(__file__).resolve().parent
SLOTS = 96  # a capacity nothing here evicts from
DST = list(range(19, 24))  # where a hit is loaded: blocks no store reads from


def src_blocks(i: int) -> list[int]:
    """Request i's blocks on the storing node (2 chunks and a tail block, within blocks 0..18)."""
    start = (i * 5) % 14
    return list(range(start, start + 2 * BPC + 1))


def expected(caches, i: int) -> list[torch.Tensor]:
    return [c[src_blocks(i)[:2 * BPC]] for c in caches]


def loaded(server: Server) -> list[torch.Tensor]:
    return [c[DST[:2 * BPC]] for c in server.caches]


STORE_LOOP = r"""
import sys
sys.path.insert(0, sys.argv[2])
from nodes import Server, prompt
from test_faults import SLOTS, src_blocks
from worker_helpers import geometry
s = Server(sys.argv[1], "auto", 0, engine_id="engine-a", capacity_bytes=SLOTS * geometry().slot_bytes)
print("UP", s.writer_id, flush=True)
for i in range(10000):
    hit, failed, plan = s.request(f"r{i}", prompt(100 + i, 2), src_blocks(i))
    print("DONE", i, " ".join(st.key.hex() for st in plan.stores), flush=True)
"""


def test_a_writer_killed_mid_store_loses_nothing_it_stored_and_the_other_node_serves_on(on_volume):
    """One configuration for both servers (writer_id "auto"): node b's takes the namespace's slot,
    node a's (a process of its own) the next; node a's is killed with -9 while storing and
    restarted with the same configuration."""
    from worker_helpers import geometry

    a_root, b_root = on_volume
    cap = SLOTS * geometry().slot_bytes
    b = Server(b_root, "auto", 1, engine_id="engine-b", capacity_bytes=cap)
    assert b.writer_id == ""
    child = subprocess.Popen([sys.executable, "-c", STORE_LOOP, str(a_root), str(HERE)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=str(HERE.parents[1]))
    done: dict[int, list[bytes]] = {}
    try:
        up = child.stdout.readline().split()
        assert up[:1] == ["UP"], child.stderr.read()[-3000:]
        slot = up[1] if len(up) > 1 else ""
        assert slot == "auto-1", up
        while len(done) < 6:
            line = child.stdout.readline()
            assert line.startswith("DONE"), (line, child.stderr.read()[-3000:])
            _, i, *keys = line.split()
            done[int(i)] = [bytes.fromhex(k) for k in keys]
        time.sleep(0.05)  # into the next request's store (each is a step, its stores and a sync)
        child.send_signal(signal.SIGKILL)
        child.wait()
        # node b: every chunk the killed writer reported stored is followed and served bit-exact
        keys = [k for ks in done.values() for k in ks]
        assert all(len(ks) == 2 for ks in done.values())
        assert wait_for(lambda: all(k in b.planner.foreign for k in keys)), "node b lost chunks node a stored"
        a_caches = _a_caches()
        for i in sorted(done):
            hit, failed, plan = b.request(f"b{i}", prompt(100 + i, 2), DST)
            assert hit == 2 * T and failed == set() and {ld.source for ld in plan.loads} == {slot}, (i, hit, failed)
            assert all(torch.equal(x, y) for x, y in zip(loaded(b), expected(a_caches, i)))
        # node a's server restarts (same configuration): its slot's lock died with it, its journal is whole
        a = Server(a_root, "auto", 0, engine_id="engine-a2", capacity_bytes=cap)
        try:
            assert a.writer_id == slot, "the restarted server did not take its slot back"
            held = {e.key for e in a.worker.store.entries().values()}
            assert set(keys) <= held
            print(f"\nkilled after {len(done)} requests read; restarted with {len(held)} chunks journaled "
                  f"({len(held) - len(keys)} from the requests it made after those), a torn tail of "
                  f"{a.worker.store.journal.dropped_tail_bytes} B dropped")
            for i in sorted(done):
                hit, failed, _ = a.request(f"a{i}", prompt(100 + i, 2), DST)
                assert hit == 2 * T and failed == set(), (i, hit, failed)
                assert all(torch.equal(x, y) for x, y in zip(loaded(a), expected(a_caches, i)))
            # and stores again, which node b follows
            _, _, plan = a.request("after", prompt(999, 2), src_blocks(3))
            assert len(plan.stores) == 2
            assert wait_for(lambda: all(st.key in b.planner.foreign for st in plan.stores))
        finally:
            a.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        b.close()


def _request_computing(server: Server, req: str, i: int, truth_caches) -> tuple[int, set, object]:
    """Server.request of prompt i into DST, with the blocks it does not load computed as vLLM's
    model would (node a's KV for prompt i): the harness has no model, and a store of blocks
    never computed would put wrong KV in the store, which no server does. DST is cleared first,
    so a block the step reports loaded holds what the load wrote."""
    truth = expected(truth_caches, i)
    for c in server.caches:
        c[DST] = 0

    def compute(hit: int) -> None:
        for c, t in zip(server.caches, truth):
            for j in range(hit // (T // BPC), 2 * BPC):
                c[DST[j]] = t[j]

    return server.request(req, prompt(100 + i, 2), DST, compute=compute)


def _a_caches():
    from worker_helpers import make_caches

    return make_caches(0)  # node a's KV cache: Server(..., seed 0)


def _store(server: Server, i: int) -> list[bytes]:
    _, _, plan = server.request(f"r{i}", prompt(100 + i, 2), src_blocks(i))
    assert len(plan.stores) == 2
    return [st.key for st in plan.stores]


def test_a_node_cut_off_mid_load_fails_only_those_loads_and_serves_again_once_back(cluster, on_volume):
    """Node b's link to the storage goes down after its planner chose to load node a's chunks: the
    step's loads fail (after the client's ping timeout), that step's blocks are recomputed, not
    served; node a stores on meanwhile; with the link back node b loads node a's chunks again,
    those stored while it was cut off included."""

    a_root, b_root = on_volume
    a, b = Server(a_root, "a", 0), Server(b_root, "b", 1)
    try:
        keys = _store(a, 0) + _store(a, 1)
        assert wait_for(lambda: all(k in b.planner.foreign for k in keys))
        p = prompt(100, 2)
        hit = b.planner.match("cut", p, 0)
        assert hit == 2 * T
        b.planner.on_alloc("cut", DST, hit)
        plan = b.planner.build_step({"cut": 1}, {"cut": hit})
        cluster.cut("b")
        stored_meanwhile: list = []
        side = threading.Thread(target=lambda: stored_meanwhile.extend(_store(a, 2)))
        t0 = time.monotonic()
        try:
            side.start()
            run_step(b.worker, plan)
            b.worker.flush()
            failed = b.worker.take_failed_blocks()
            took = time.monotonic() - t0
            side.join(60)
        finally:
            cluster.restore("b")
        assert failed == set(DST[:2 * BPC]), failed  # every loaded block is recomputed, none served
        b.planner.on_report(b.worker.take_report())
        b.planner.finished("cut")
        assert len(stored_meanwhile) == 2, "node a could not store while node b was cut off"
        # back: node b follows and loads again, what node a stored meanwhile included
        assert wait_for(lambda: all(k in b.planner.foreign for k in stored_meanwhile), timeout=30)
        for i in (1, 2):
            t1 = time.monotonic()
            while True:
                hit, failed, _ = _request_computing(b, f"again{i}-{time.monotonic()}", i, a.caches)
                if hit == 2 * T and not failed:
                    break
                # a read the returning mount still fails is recomputed, and node b then stores and
                # serves its own copy (computed here as a model would: right, so a hit on it is too)
                assert time.monotonic() - t1 < 30, f"node b did not load node a's chunks again: {hit}, {failed}"
                time.sleep(0.5)
            assert all(torch.equal(x, y) for x, y in zip(loaded(b), expected(a.caches, i)))
        # the chunks whose loads failed: node b does not load them from node a again (they failed
        # there); it recomputes and stores them itself, and serves its own copy from then on
        hit, failed, plan = b.request("failed-before", p, DST)
        assert failed == set()
        assert hit == 2 * T or {st.key for st in plan.stores} == set(keys[:2]), (hit, plan)
        if hit:
            assert all(torch.equal(x, y) for x, y in zip(loaded(b), expected(a.caches, 0)))
        print(f"\nnode b's cut-off step failed its loads after {took:.1f} s; node b loads again once back; the "
              f"chunks that failed were {'served again' if hit else 'recomputed and stored by node b'}")
    finally:
        a.close()
        b.close()


def test_a_nodes_client_killed_mid_load_fails_its_loads_and_the_other_node_goes_on(cluster, on_volume):
    """Node b's file system client dies (kill -9 of its glusterfs process: what an unmount or a
    crashed client leaves): node b's loads fail, the step ends, its blocks are recomputed; node a
    stores and serves on; node b's server, restarted on a fresh mount, serves node a's chunks."""

    a_root, b_root = on_volume
    a, b = Server(a_root, "a", 0), Server(b_root, "b", 1)
    closed = False
    try:
        keys = _store(a, 0)
        assert wait_for(lambda: all(k in b.planner.foreign for k in keys))
        hit = b.planner.match("dead", prompt(100, 2), 0)
        assert hit == 2 * T
        b.planner.on_alloc("dead", DST, hit)
        plan = b.planner.build_step({"dead": 1}, {"dead": hit})
        cluster.kill_client("b")
        try:
            run_step(b.worker, plan)
            b.worker.flush()
            failed = b.worker.take_failed_blocks()
            assert failed == set(DST[:2 * BPC]), failed
        finally:
            try:
                b.close()
            except OSError as exc:  # its files are on a dead mount
                print(f"\nnode b's server, closed on its dead mount: {exc!r}")
            closed = True
            cluster.unmount("b")
            cluster.mount("b")
        keys = _store(a, 1)  # node a goes on
        b = Server(b_root, "b", 1)
        closed = False
        assert wait_for(lambda: all(k in b.planner.foreign for k in keys))
        for i in (0, 1):
            hit, failed, _ = b.request(f"back{i}", prompt(100 + i, 2), DST)
            assert hit == 2 * T and failed == set()
            assert all(torch.equal(x, y) for x, y in zip(loaded(b), expected(a.caches, i)))
    finally:
        a.close()
        if not closed:
            b.close()


def _fill(root: Path) -> list[Path]:
    """Files of 1 MiB through `root` until the volume refuses three in a row (each file lands on
    one brick: every brick full)."""
    made, refused, i = [], 0, 0
    while refused < 3:
        path = root / f"filler-{i}"
        i += 1
        try:
            with open(path, "wb") as f:
                f.write(b"\xff" * (1 << 20))
                os.fsync(f.fileno())
            made.append(path)
            refused = 0
        except OSError as exc:
            assert exc.errno in (28, 122), exc  # ENOSPC, EDQUOT
            refused += 1
            made.append(path)  # it may exist, partly written
    return made


def test_a_full_volume_fails_stores_not_steps_and_loses_nothing_stored(tmp_path):
    """A volume of two 24 MiB bricks, filled through node a's mount after a few stores: node a's
    steps go on, the stores that do not fit fail (counted), nothing is journaled that is not
    whole; node b serves every chunk node a journaled, bit-exact, before and after; with room
    made again node a stores again and node b follows."""
    import gluster

    with gluster.Cluster(tmp_path / "gl", brick_bytes=24 << 20) as small:
        a_root, b_root = small.mounts["a"] / "kv", small.mounts["b"] / "kv"
        a_root.mkdir()
        a, b = Server(a_root, "a", 0, capacity_bytes=SLOTS * 12288), Server(b_root, "b", 1)
        try:
            keys = {i: _store(a, i) for i in range(3)}
            fillers = _fill(small.mounts["a"])
            stats0 = dict(vars(a.planner.stats))
            for i in range(3, 9):  # the volume is full: these stores fail, the steps do not
                _, _, plan = a.request(f"r{i}", prompt(100 + i, 2), src_blocks(i))
                keys[i] = [st.key for st in plan.stores]
            st = a.planner.stats
            assert st.stores_failed - stats0["stores_failed"] > 0, vars(st)
            journaled = {e.key for e in a.worker.store.entries().values()}
            assert {k for i in range(3) for k in keys[i]} <= journaled
            assert wait_for(lambda: all(k in b.planner.foreign for k in journaled), timeout=15)
            for i in range(9):
                whole = [k in journaled for k in keys[i]]
                n = whole.index(False) if False in whole else len(whole)  # the hit: journaled chunks in a row
                hit, failed, _ = b.request(f"b{i}", prompt(100 + i, 2), DST)
                assert hit == n * T and failed == set(), (i, hit, n, failed)
                for x, y in zip(loaded(b), expected(a.caches, i)):
                    assert torch.equal(x[:n * BPC], y[:n * BPC]), i
            served = sum(k in journaled for i in range(3, 9) for k in keys[i])
            for f in fillers:
                f.unlink(missing_ok=True)
            # room again: node a stores, node b follows
            t0 = time.monotonic()
            while True:
                before = a.planner.stats.stores_committed
                _, _, plan = a.request(f"again-{time.monotonic()}", prompt(500, 2), src_blocks(1))
                if a.planner.stats.stores_committed - before == 2:
                    break
                assert time.monotonic() - t0 < 20, "node a did not store again once the volume had room"
                time.sleep(0.5)
            assert wait_for(lambda: all(s.key in b.planner.foreign for s in plan.stores), timeout=15)
            print(f"\nfull volume: {st.stores_failed - stats0['stores_failed']} stores failed, {served} of the "
                  f"{2 * 6} chunks stored while full were journaled (whole) and served by node b")
        finally:
            a.close()
            b.close()
