"""Two servers pointed at one root. Same configuration (writer_id "auto", the default): the
second takes a writer slot of its own and serves the first's chunks while both run. The same
explicit writer slot twice: the second gets a clear error at start (the slot has a writer) and
writes nothing, and the first keeps storing undisturbed. Another configuration: its own
namespace, side by side. Never interleaved writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness
from relkit import (CHUNK, connector_of, engine, failed_start_cleanup, kv_config, prompt, reference, tokens,
                    verify_store)

AREA = "two servers, one root"
CHUNKS = 4
PROMPT_LEN = CHUNKS * CHUNK + 3

FIRST = """
import json, sys, harness
llm = harness.make_llm({model!r}, kv_transfer_config={kvt!r})
harness.generate_ids(llm, {p1!r}, 4)
harness.settle(llm)
print("READY", flush=True)
sys.stdin.readline()
harness.generate_ids(llm, {p2!r}, 4)
harness.settle(llm)
conn = harness.connector(llm)
print("STATS", json.dumps(vars(conn.planner.stats)), flush=True)
harness.shutdown_llm(llm)
"""


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_second_server_on_same_root(tiny_model, tmp_path, report):
    root = tmp_path / "kv"
    kvt = kv_config(root)
    p1 = [prompt(700 + i, PROMPT_LEN) for i in range(3)]
    p2 = [prompt(800 + i, PROMPT_LEN) for i in range(3)]
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, **harness.ENV_DEFAULTS)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(repo / "tests" / "vllm"), env.get("PYTHONPATH", "")])
    code = FIRST.format(model=str(tiny_model), kvt=kvt, p1=p1, p2=p2)
    first = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=str(repo))
    try:
        want = reference(tiny_model, p1 + p2, 4)  # meanwhile the first server starts
        line = first.stdout.readline()
        while line and not line.startswith("READY"):
            line = first.stdout.readline()
        assert line.startswith("READY"), f"first server did not start: {first.stderr.read()[-3000:]}"
        before = _files(root)

        # 1) the first server's writer slot ('') asked for explicitly, while it runs: a clear error at start-up
        with pytest.raises(Exception, match=r"already has a writer.*held by pid " + str(first.pid)) as ei:
            with engine(tiny_model, kv_config(root, writer_id="")):
                pass
        from vllm.distributed.kv_transfer import has_kv_transfer_group

        assert not has_kv_transfer_group(), "the refused server left vLLM's global connector set"
        failed_start_cleanup()
        assert _files(root) == before, "the refused server touched the store"

        # 1b) the same configuration (writer_id auto), while the first runs: a replica. It takes a
        # slot of its own and every chunk the first stored is a hit on it
        with engine(tiny_model, kvt) as llm:
            outs = harness.generate_ids(llm, p1, 4)
            harness.settle(llm)
            s_replica = dict(vars(connector_of(llm).planner.stats))
        assert tokens(outs) == want[:3] and [o.num_cached_tokens for o in outs] == [CHUNKS * CHUNK] * 3
        assert s_replica["stores_committed"] == 0 and s_replica["loads_failed"] == 0
        assert (next(root.glob("tutti-*")) / "w-auto-1").is_dir()

        # 2) another configuration (chunk 64) on the same root: its own namespace, side by side
        with engine(tiny_model, kv_config(root, chunk=2 * CHUNK)) as llm:
            outs = harness.generate_ids(llm, p1, 4)
            harness.settle(llm)
            s_other = dict(vars(connector_of(llm).planner.stats))
        assert tokens(outs) == want[:3] and s_other["hit_tokens"] == 0 and s_other["stores_committed"] == 6

        # the first server goes on storing as if nothing happened
        out, err = first.communicate("go\n", timeout=240)
        assert first.returncode == 0, err[-3000:]
        s_first = json.loads([ln for ln in out.splitlines() if ln.startswith("STATS ")][-1][6:])
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert s_first["stores_committed"] == 2 * 3 * CHUNKS and s_first["stores_failed"] == 0

    # Each namespace is whole and holds only its own chunks.
    summary = verify_store(root)
    assert len(summary) == 2
    by_chunk = {ns["fingerprint"]["chunk_tokens"]: ns for ns in summary.values()}
    assert by_chunk[CHUNK]["bad"] == [] and by_chunk[CHUNK]["entries"] == 2 * 3 * CHUNKS
    assert by_chunk[2 * CHUNK]["bad"] == [] and by_chunk[2 * CHUNK]["entries"] == 3 * 2
    with engine(tiny_model, kvt) as llm:  # after both: everything the first stored is served
        outs = harness.generate_ids(llm, p1 + p2, 4)
        s = dict(vars(connector_of(llm).planner.stats))
    assert tokens(outs) == want and s["loads_failed"] == 0
    assert [o.num_cached_tokens for o in outs] == [CHUNKS * CHUNK] * 6
    report.tried = ("a second server on the root of a running one: its writer slot asked for explicitly, the same "
                    "config (writer_id auto: a replica), and a different config (chunk_tokens 64)")
    msg = str(ei.value).splitlines()[0]
    msg = msg[msg.index("already has a writer"):msg.index("lock file")].rstrip(": ") + ": lock file ... held by pid N"
    report.held = (f"the held slot refused at start-up (\"... {msg}...\"), no file touched; the replica wrote as "
                   "auto-1 and hit every chunk of the first; "
                   "different config got its own namespace; the first kept storing; both namespaces whole; "
                   "outputs == recompute")
    report.requests = 3 + 3 + 6 + 6 + 3
    report.faults = 2
    report.bytes_lost = 0  # every chunk the first server stored was served at the end (asserted)
    report.counts = {"stores_first": s_first["stores_committed"], "stores_other_ns": s_other["stores_committed"],
                     "hit_tokens_after": s["hit_tokens"]}
