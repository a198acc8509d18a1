"""The disk fills up under a running server (a small tmpfs as the store's root): stores fail
cleanly and are counted, what is stored keeps loading, serving never stops, and stores resume
once space frees up (a filler file deleted, or the filesystem grown)."""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess

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
