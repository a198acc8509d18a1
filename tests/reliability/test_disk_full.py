"""The disk fills up under a running server (a small tmpfs as the store's root): stores fail
cleanly and are counted, what is stored keeps loading, serving never stops, and stores resume
once space frees up (a filler file deleted, or the filesystem grown)."""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import harness
from relkit import CHUNK, connector_of, engine, kv_config, only_namespace, prompt, reference, tokens, verify_store

AREA = "disk full"
CHUNKS = 4
PROMPT_LEN = CHUNKS * CHUNK + 7


@contextlib.contextmanager
def tmpfs(path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine: cannot make a small filesystem to fill up")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root / CAP_SYS_ADMIN): {p.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path) -> int:
    """Write a filler file until the filesystem is full; returns its size."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        for piece in (1 << 16, 4096, 1):
            buf = b"\xa5" * piece
            while True:
                try:
                    if f.write(buf) != piece:
                        break
                    n += piece
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    return n


def test_disk_full_stores_fail_cleanly_loads_and_serving_continue(tiny_model, tmp_path, report):
    sets = {name: [prompt(500 + 10 * i + j, PROMPT_LEN) for j in range(2)] for i, name in enumerate("ABCD")}
    allp = [p for ps in sets.values() for p in ps]
    want_all = reference(tiny_model, allp, 4)
    want = {name: want_all[2 * i:2 * i + 2] for i, name in enumerate(sets)}
    root = tmp_path / "kv"
    served = 0
    with tmpfs(root, "2M"):
        kvt = kv_config(root, capacity="16MiB")  # more than the disk holds: the disk fills first
        with engine(tiny_model, kvt) as llm:
            conn = connector_of(llm)
            st = conn.planner.stats

            def run(name, expect_hits=None):
                nonlocal served
                outs = harness.generate_ids(llm, sets[name], 4)
                served += len(outs)
                assert tokens(outs) == want[name], f"set {name}: outputs differ from recompute"
                harness.settle(llm)
                if expect_hits is not None:
                    assert [o.num_cached_tokens for o in outs] == [expect_hits] * len(outs), name
                return outs

            run("A")
            assert st.stores_committed == 2 * CHUNKS and st.stores_failed == 0
            filler = root / "filler"
            fill(filler)
            # 1) full disk: the new chunks' stores fail, counted; serving goes on, outputs exact
            run("B")
            failed1 = st.stores_failed
            assert failed1 == 2 * CHUNKS and st.stores_committed == 2 * CHUNKS, vars(st)
            assert st.stores_skipped == 0  # failed on the full disk, not skipped for lack of staging
            # 2) what was stored before still loads
            llm.reset_prefix_cache()
            run("A", expect_hits=CHUNKS * CHUNK)
            assert st.loads_failed == 0
            # 3) space frees up (filler deleted): stores resume
            filler.unlink()
            run("C")
            assert st.stores_committed == 4 * CHUNKS, vars(st)
            # 4) full again, then the filesystem grows (remount bigger): stores resume again
            fill(filler)
            run("D")
            failed2 = st.stores_failed
            assert failed2 == failed1 + 2 * CHUNKS, vars(st)
            r = subprocess.run(["mount", "-o", "remount,size=8M", str(root)], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            llm.reset_prefix_cache()
            run("D", expect_hits=0)  # nothing of D was stored; stored now
            run("B", expect_hits=0)
            assert st.stores_committed == 8 * CHUNKS, vars(st)
            llm.reset_prefix_cache()
            for name in "ABCD":  # everything that was ever stored whole is served
                run(name, expect_hits=CHUNKS * CHUNK)
            assert st.loads_failed == 0
            stats = dict(vars(st))
        ns = only_namespace(verify_store(root))
    assert ns["bad"] == [] and ns["entries"] == 8 * CHUNKS
    report.tried = ("store root on a 2 MiB tmpfs; filled with a filler file twice while serving; freed once by "
                    "deleting the filler, once by remount size=8M")
    report.held = (f"{failed2} stores failed cleanly and were counted (stores_failed), outputs == recompute for "
                   "every request, earlier chunks kept loading, stores resumed after each episode, journal whole")
    report.requests = served
    report.faults = 2
    report.bytes_lost = 0  # every set stored before a fill was served afterwards (asserted above)
    report.counts = {k: stats[k] for k in ("stores_committed", "stores_failed", "hit_tokens", "loads_failed")}


# ---------------------------------------------------------------- a RAM root crowded out later
_CROWDED = r"""
import json, sys
sys.path.insert(0, {here!r})
import harness
from relkit import connector_of, engine, tokens
from test_disk_full import fill
root, sets = {root!r}, {sets!r}
with engine({model!r}, {kvt!r}) as llm:
    conn = connector_of(llm)
    st = conn.planner.stats
    outs = {{}}
    outs["A"] = tokens(harness.generate_ids(llm, sets["A"], 4))
    harness.settle(llm)
    filler = fill(root + "/filler")  # another process's files take every free byte of the tmpfs
    outs["B"] = tokens(harness.generate_ids(llm, sets["B"], 4))  # stored into the maps after the fill
    harness.settle(llm)
    llm.reset_prefix_cache()
    hits = [o.num_cached_tokens for o in harness.generate_ids(llm, sets["A"] + sets["B"], 4)]
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    store = get_kv_transfer_group().worker.store
    print("CROWDED", json.dumps({{"outs": outs, "hits": hits, "filler": filler,
                                 "mapped": store.maps_every_slab, "stats": dict(vars(st))}}))
"""


def test_a_ram_root_crowded_out_after_start_never_faults_the_server(tiny_model, tmp_path, report):
    """A writer on a RAM root maps its whole capacity at start (stores then copy into the maps).
    The capacity fits the tmpfs at start; afterwards another process fills the tmpfs. A sparse
    slab would turn the next copy into SIGBUS (the server dies, rc -7); reserved slabs keep
    every store of the capacity, and the server keeps serving."""
    sets = {name: [prompt(700 + 10 * i + j, PROMPT_LEN) for j in range(2)] for i, name in enumerate("AB")}
    want = reference(tiny_model, sets["A"] + sets["B"], 4)
    root = tmp_path / "kv"
    with tmpfs(root, "16M"):
        code = _CROWDED.format(here=str(Path(__file__).parent), root=str(root), sets=sets, model=str(tiny_model),
                               kvt=kv_config(root, capacity="8MiB"))
        out = harness.run_in_subprocess(code, timeout=240)  # raises with rc -7 if the server faulted
        got = json.loads([ln for ln in out.splitlines() if ln.startswith("CROWDED ")][-1][8:])
        ns = only_namespace(verify_store(root))
    st = got["stats"]
    assert got["mapped"], "the writer did not map its capacity at start: the path under test was not taken"
    assert got["filler"] > 0
    assert got["outs"]["A"] + got["outs"]["B"] == want
    assert st["stores_committed"] == 4 * CHUNKS and st["stores_failed"] == 0, st  # the reservation held
    assert got["hits"] == [CHUNKS * CHUNK] * 4
    assert ns["bad"] == [] and ns["entries"] == 4 * CHUNKS
    report.tried = ("store root on a 16 MiB tmpfs, capacity 8 MiB (fits at start: the writer maps it all); then "
                    f"a filler file took every free byte ({got['filler']} B) and the server stored 2 more prompts")
    report.held = ("no SIGBUS: the slabs were reserved at start, so every store after the fill landed "
                   f"({st['stores_committed']} committed, 0 failed); all 4 prompts hit afterwards; outputs == "
                   "recompute; journal whole")
    report.requests = 8
    report.faults = 1
    report.bytes_lost = 0
    report.counts = {k: st[k] for k in ("stores_committed", "stores_failed", "hit_tokens", "loads_failed")}



# ------------------------------------------------- two replicas with one config on one small tmpfs
_REPLICAS = r"""
import json, torch
from tutti.engine.build import Geometry, build_worker
from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk
from tutti.kernels import PagedLayout

L, B, H, N, D, T = 2, 64, 2, 16, 64, 32  # a chunk: 2 blocks of 16 tokens; a slot: 2 layers x 32 KiB
geom = Geometry(model="tiny", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L, num_heads=H,
                content_bytes=2 * D * 4)
cfg = {{"root": {root!r}, "capacity_bytes": {capacity}, "chunk_tokens": T, "staging_bytes": "4MiB",
        "staging_slots": 72, "max_inflight_stores": 64}}  # one config for both: writer_id auto
SLOTS, PER_STEP = {capacity} // geom.slot_bytes, B // 2


def step(w, n, plan):
    w.start_step(plan)
    for layer in range(L):
        w.wait_layer(layer)
        w.save_layer(layer)
    w.end_step()
    w.flush()
    return w.take_report()


def key(slot):
    return slot.to_bytes(32, "little")


workers = []
for i in range(2):  # both start while the tmpfs is empty, as replicas started at once would
    caches = [torch.randn(B, H, N, 2 * D, generator=torch.Generator().manual_seed(layer)) for layer in range(L)]
    v = [c.as_strided((B, H, 2, N, D), (c.stride(0), c.stride(1), N * D, D, 1)) for c in caches]
    w = build_worker(cfg, geom, caches=v, layout=PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim")))
    w.warm_up()
    workers.append((w, caches))
out = []
for w, caches in workers:
    orig = [c.clone() for c in caches]
    stored, failed, n = [], [], 0
    for first in range(0, SLOTS, PER_STEP):  # slot first + j holds blocks 2j, 2j + 1
        rep = step(w, n, StepPlan(n := n + 1, stores=[
            StoreChunk("r", key(first + j), first + j, (2 * j, 2 * j + 1), ticket=first + j + 1)
            for j in range(min(PER_STEP, SLOTS - first))]))
        stored += [t - 1 for t in rep.stored]
        failed += rep.store_failed
    exact = 0
    for c in caches:
        c.zero_()
    for first in range(0, len(stored), PER_STEP):  # every stored chunk loads back bit exact
        part = sorted(stored)[first:first + PER_STEP]
        j = {{s: i for i, s in enumerate(part)}}
        rep = step(w, n, StepPlan(n := n + 1, loads=[LoadChunk("q", key(s), s, (2 * j[s], 2 * j[s] + 1))
                                                     for s in part]))
        bad = w.take_failed_blocks()
        for s in part:
            src = [2 * (s % PER_STEP), 2 * (s % PER_STEP) + 1]
            dst = [2 * j[s], 2 * j[s] + 1]
            exact += not bad & set(dst) and all(torch.equal(c[dst], o[src]) for c, o in zip(caches, orig))
    out.append({{"writer": w.store.writer_id, "mapped": w.store.maps_every_slab, "slots": SLOTS,
                 "stored": len(stored), "failed": len(failed), "exact": exact}})
for w, _ in workers:
    w.close()
print("REPLICAS", json.dumps(out))
"""


def test_two_replicas_with_one_config_on_one_small_tmpfs_never_fault(tmp_path, report):
    """Two replicas with one config (writer_id auto) start on one RAM root that holds one
    capacity but not two: each saw the space free at its start. Sparse slabs let both map their
    whole capacity and the first copy past the tmpfs's size killed the process with SIGBUS; now
    the first reserves its slabs, the second finds the space taken and stores through the file,
    where a full tmpfs fails a store with ENOSPC."""
    root = tmp_path / "kv"
    capacity = 8 << 20
    with tmpfs(root, "12M"):
        code = _REPLICAS.format(root=str(root), capacity=capacity)
        out = harness.run_in_subprocess(code, timeout=240)  # raises with rc 135 (SIGBUS) if a copy faulted
        got = json.loads([ln for ln in out.splitlines() if ln.startswith("REPLICAS ")][-1][9:])
    first, second = got
    assert (first["writer"], second["writer"]) == ("", "auto-1")
    assert first["mapped"] and first["stored"] == first["slots"] and first["failed"] == 0, first
    assert not second["mapped"], second  # the space was reserved by the first: no mapping to fault on
    assert 0 < second["stored"] < second["slots"] and second["failed"] == second["slots"] - second["stored"], second
    assert first["exact"] == first["stored"] and second["exact"] == second["stored"], got
    report.tried = ("two workers with one config (writer_id auto) on one 12 MiB tmpfs, capacity 8 MiB each, both "
                    f"started before either stored; each then stored {first['slots']} chunks")
    report.held = (f"no SIGBUS: the first reserved its slabs and stored all {first['stored']}; the second found "
                   f"the space taken, stored {second['stored']} through the file and failed {second['failed']} "
                   "with ENOSPC; every stored chunk loaded back bit exact")
    report.faults = 1
    report.bytes_lost = 0
    report.counts = {"first_stored": first["stored"], "second_stored": second["stored"],
                     "second_failed": second["failed"]}
