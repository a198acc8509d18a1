"""A vLLM process killed with SIGKILL while it stores: the store keeps only whole chunks, and a
new server on the same root serves exactly those, with outputs identical to recompute."""

from __future__ import annotations

from pathlib import Path

import harness
from relkit import (CHUNK, connector_of, engine, kill_mid_write, kv_config, only_namespace, prompt, reference, tokens,
                    verify_store)

AREA = "crash (SIGKILL)"
PER_BATCH, PROMPT_LEN = 16, 8 * CHUNK + 5
SLOTS, SLOT_BYTES = 160, 2 * 32 * 1024  # 2 layers x (32 tokens x 2 heads x 512 B)


def batch_prompts(i: int) -> list[list[int]]:
    return [prompt(1000 + 100 * i + j, PROMPT_LEN) for j in range(PER_BATCH)]


CHILD = """
import sys, harness
sys.path.insert(0, {here!r})
from crash_child import main
main({model!r}, {kvt!r})
"""


def test_sigkill_mid_store_then_fresh_server(tiny_model, tmp_path, report):
    root = tmp_path / "kv"
    # 160 chunks: batch 0 stores 128, from batch 1 on every store overwrites an evicted slot,
    # the riskiest moment to die (the old chunk's bytes are being replaced)
    kvt = kv_config(root, capacity=SLOTS * SLOT_BYTES)
    code = CHILD.format(here=str(Path(__file__).parent), model=str(tiny_model), kvt=kvt)
    # Kill at a moment when segments are being written that the journal does not name yet (a
    # store in flight), once evicted slots are being overwritten (batch 1 done); fall back to a
    # plain kill after batch 4.
    batches, in_flight_seen = kill_mid_write(code, root, from_batch=2, by_batch=5)
    assert len(batches) >= 2, "killed before any slot was overwritten"
    started = max(batches) + 2  # batches printed, plus the one being generated when killed

    # 1) Out of process, read-only: every journaled segment matches its checksum.
    ns = only_namespace(verify_store(root))
    assert ns["entries"] > 0, "nothing was stored before the kill: the test did not exercise anything"
    assert ns["bad"] == [], f"journal names torn chunks in slots {ns['bad']}"
    stored_keys = set(ns["keys"].values())

    # 2) A new server on the same root: starts, serves only those chunks, outputs equal recompute.
    prompts = [p for i in range(started) for p in batch_prompts(i)[:6]] + [prompt(7, PROMPT_LEN)]
    want = reference(tiny_model, prompts, 4)
    # (reopened twice as large, so its own new stores never evict what the old one left)
    with engine(tiny_model, kv_config(root, capacity=2 * SLOTS * SLOT_BYTES)) as llm:
        conn = connector_of(llm)
        assert len(conn.planner.index) == ns["entries"] and ns["slot_bytes"] == SLOT_BYTES
        outs = harness.generate_ids(llm, prompts, 4)
        s = dict(vars(conn.planner.stats))
    from tutti.engine.keys import chunk_keys

    expect_hits = []
    for p in prompts:
        keys = chunk_keys(p, CHUNK, conn.planner.seed)[: (len(p) - 1) // CHUNK]
        n = 0
        while n < len(keys) and keys[n].hex() in stored_keys:
            n += 1
        expect_hits.append(n * CHUNK)
    got_hits = [o.num_cached_tokens for o in outs]
    assert tokens(outs) == want
    assert s["loads_failed"] == 0
    assert got_hits == expect_hits  # every durable chunk in a prompt's prefix was served
    assert sum(got_hits) > 0
    lost = sum(e - g for e, g in zip(expect_hits, got_hits) if e > g) // CHUNK * ns["slot_bytes"]
    report.tried = (f"SIGKILL of a server storing 16x{PROMPT_LEN}-token batches into {SLOTS} slots (evicted slots "
                    f"being overwritten), during batch {max(batches) + 2}; "
                    f"{'kill landed while segments were written that the journal did not name yet' if in_flight_seen else 'kill between stores'}")
    report.held = (f"{ns['entries']} journaled chunks all pass checksums (read-only python3 -c); "
                   f"{ns['unjournaled_slots']} slots holding unjournaled bytes (freed or cut off) ignored; new "
                   "server starts, hits exactly the journaled prefixes, outputs == recompute")
    report.requests = len(prompts)
    report.faults = 1
    report.bytes_lost = lost
    report.counts = {"chunks_durable": ns["entries"], "hit_tokens": s["hit_tokens"], "loads_failed": s["loads_failed"],
                     "unjournaled_slots_ignored": ns["unjournaled_slots"]}
    assert lost == 0
