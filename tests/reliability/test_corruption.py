"""Damaged store files: flipped bytes in a slab, a truncated slab, a deleted slab, a garbled
journal tail. Each is detected, the affected chunks are dropped (for good: a restart does not
serve them again), vLLM recomputes, nothing crashes, and outputs equal recompute."""

from __future__ import annotations

import os

import harness
from relkit import CHUNK, connector_of, engine, kv_config, only_namespace, prompt, reference, tokens, verify_store

AREA = "corruption"
GROUPS = ["flip", "truncate", "delete", "untouched", "journal_tail"]  # stored in this order
CHUNKS = 4
PROMPT_LEN = CHUNKS * CHUNK + 10


def test_damaged_slabs_and_journal_are_detected_and_recomputed(tiny_model, tmp_path, report):
    root = tmp_path / "kv"
    kvt = kv_config(root, slots_per_slab=CHUNKS)  # one group's chunks per slab
    prompts = {g: prompt(300 + i, PROMPT_LEN) for i, g in enumerate(GROUPS)}
    order = list(prompts.values())
    want = reference(tiny_model, order, 4)

    with engine(tiny_model, kvt) as llm:
        for g in GROUPS:  # one group at a time: its chunks take consecutive slots
            assert tokens(harness.generate_ids(llm, [prompts[g]], 4)) == [want[GROUPS.index(g)]]
            harness.settle(llm)
        seed = connector_of(llm).planner.seed
    from tutti.engine.keys import chunk_keys

    ns = only_namespace(verify_store(root))
    assert ns["bad"] == [] and ns["entries"] == CHUNKS * len(GROUPS)
    slot_of = {k: int(s) for s, k in ns["keys"].items()}
    slots = {g: [slot_of[k.hex()] for k in chunk_keys(prompts[g], CHUNK, seed)[:CHUNKS]] for g in GROUPS}
    for i, g in enumerate(GROUPS):
        assert slots[g] == list(range(CHUNKS * i, CHUNKS * (i + 1))), slots
    nsdir = next(root.glob("tutti-*"))
    slot_bytes, seg = ns["slot_bytes"], ns["slot_bytes"] // 2

    # ---- damage ----
    slab0 = nsdir / "slab-0.bin"  # "flip": chunk 1, layer 1, a few bytes
    data = bytearray(slab0.read_bytes())
    for off in (1 * slot_bytes + seg + 100, 1 * slot_bytes + seg + 5000):
        data[off] ^= 0x5A
    slab0.write_bytes(bytes(data))
    slab1 = nsdir / "slab-1.bin"  # "truncate": cut in the middle of chunk 2's layer 1
    os.truncate(slab1, 2 * slot_bytes + seg + seg // 2)
    (nsdir / "slab-2.bin").unlink()  # "delete": every chunk of the group
    journal = nsdir / "journal.bin"  # "journal_tail": garble the last record (a put of the last group)
    jd = bytearray(journal.read_bytes())
    for i in range(1, 12):
        jd[-i] ^= 0xFF
    journal.write_bytes(bytes(jd) + os.urandom(37))  # and a torn append after it
    faults = 4
    # first faulted chunk of each group (chunks before it must still be served)
    first_bad = {"flip": 1, "truncate": 2, "delete": 0, "untouched": CHUNKS, "journal_tail": CHUNKS - 1}

    seen = only_namespace(verify_store(root))  # detection out of process, read-only
    assert sorted(seen["bad"]) == sorted([slots["flip"][1]] + slots["truncate"][2:] + slots["delete"]), seen["bad"]
    assert seen["dropped_tail_bytes"] > 0 and str(slots["journal_tail"][-1]) not in seen["keys"]

    # ---- a server on the damaged root ----
    with engine(tiny_model, kvt) as llm:
        conn = connector_of(llm)
        outs = harness.generate_ids(llm, order, 4)
        assert tokens(outs) == want  # recomputed where damaged
        harness.settle(llm)
        s1 = dict(vars(conn.planner.stats))
    served = {g: o.num_cached_tokens // CHUNK for g, o in zip(GROUPS, outs)}
    # The planner hits on what the journal names; the damaged ones fail to load and are counted.
    assert served == {g: CHUNKS if g != "journal_tail" else CHUNKS - 1 for g in GROUPS}, served
    assert s1["loads_failed"] == 1 + 2 + CHUNKS, s1

    # ---- dropped for good: the journal no longer names any damaged chunk; a restart agrees ----
    after = only_namespace(verify_store(root))
    assert after["bad"] == [], f"damaged chunks still journaled in slots {after['bad']}"
    with engine(tiny_model, kvt) as llm:
        outs2 = harness.generate_ids(llm, order, 4)
        s2 = dict(vars(connector_of(llm).planner.stats))
    assert tokens(outs2) == want and s2["loads_failed"] == 0, s2
    served2 = {g: o.num_cached_tokens // CHUNK for g, o in zip(GROUPS, outs2)}
    # a damaged chunk ends its prefix; the journal_tail chunk was a plain miss, stored again
    assert served2 == {**first_bad, "journal_tail": CHUNKS}, served2
    lost = sum(max(0, first_bad[g] - served2[g]) for g in GROUPS) * slot_bytes
    report.tried = ("flipped bytes in a slab, slab truncated mid-segment, slab deleted, journal tail "
                    "garbled + torn append (kv_load_failure_policy=recompute)")
    report.held = ("read-only check flags exactly the damaged slots; server hits, fails the damaged loads "
                   f"({s1['loads_failed']} counted), recomputes, outputs == recompute; damaged chunks "
                   "journaled free, restart serves none of them; undamaged prefixes still served")
    report.requests = 2 * len(order) + len(GROUPS)
    report.faults = faults
    report.bytes_lost = lost
    report.counts = {"loads_failed": s1["loads_failed"], "hit_tokens": s1["hit_tokens"] + s2["hit_tokens"],
                     "journal_tail_bytes_dropped": seen["dropped_tail_bytes"]}
    assert lost == 0
