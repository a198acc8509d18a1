"""A tiered server (a RAM tier in front of a disk tier) killed with SIGKILL while its copier
writes chunks down: each tier keeps only whole chunks, and a new server over the same tiers
serves exactly those, from whichever tier holds them, with outputs identical to recompute."""

from __future__ import annotations

from pathlib import Path

import harness
from relkit import (CHUNK, connector_of, engine, kill_mid_write, kv_config, only_namespace, prompt, reference, tokens,
                    verify_store)

AREA = "crash (SIGKILL), tiers"
PER_BATCH, PROMPT_LEN = 16, 8 * CHUNK + 5
SLOT_BYTES = 2 * 32 * 1024  # 2 layers x (32 tokens x 2 heads x 512 B)
RAM_SLOTS, DISK_SLOTS = 48, 400


def batch_prompts(i: int) -> list[list[int]]:
    return [prompt(3000 + 100 * i + j, PROMPT_LEN) for j in range(PER_BATCH)]


def tiered(tmp: Path, ram_slots: int = RAM_SLOTS, disk_slots: int = DISK_SLOTS) -> dict:
    kvt = kv_config(tmp / "ram", capacity=1)
    extra = kvt["kv_connector_extra_config"]
    del extra["root"], extra["capacity_bytes"]
    extra["tiers"] = [{"root": str(tmp / "ram"), "capacity_bytes": ram_slots * SLOT_BYTES},
                      {"root": str(tmp / "disk"), "capacity_bytes": disk_slots * SLOT_BYTES}]
    return kvt


CHILD = """
import sys, harness
sys.path.insert(0, {here!r})
import test_tiers_crash
from crash_child import main
main({model!r}, {kvt!r}, test_tiers_crash.batch_prompts)
"""


def test_sigkill_mid_write_down_then_fresh_server(tiny_model, tmp_path, report):
    kvt = tiered(tmp_path)
    code = CHILD.format(here=str(Path(__file__).parent), model=str(tiny_model), kvt=kvt)
    # Kill while the disk tier's slabs are being written and its journal does not name the copy
    # yet (a write-down in flight), once the RAM tier has evicted (batch 3 on: 3 x 16 x 8 chunks
    # went through 48 RAM slots); fall back to a plain kill after batch 6.
    disk = tmp_path / "disk"
    batches, in_flight_seen = kill_mid_write(code, disk, from_batch=3, by_batch=6)
    assert len(batches) >= 3, "killed before the RAM tier evicted anything"
    started = max(batches) + 2

    # 1) Out of process, read-only: every journaled segment of each tier matches its checksum.
    ram, low = only_namespace(verify_store(tmp_path / "ram")), only_namespace(verify_store(disk))
    assert low["entries"] > 0, "nothing was written down before the kill"
    assert ram["bad"] == [] and low["bad"] == [], f"torn chunks: RAM {ram['bad']}, disk {low['bad']}"
    stored = set(ram["keys"].values()) | set(low["keys"].values())

    # 2) A new server over the same tiers (twice as large: its own stores evict nothing of the old)
    prompts = [p for i in range(started) for p in batch_prompts(i)[:6]] + [prompt(7, PROMPT_LEN)]
    want = reference(tiny_model, prompts, 4)
    with engine(tiny_model, tiered(tmp_path, 2 * RAM_SLOTS, 2 * DISK_SLOTS)) as llm:
        conn = connector_of(llm)
        p = conn.planner
        assert len(p.index) == ram["entries"] and len(p.lower[0].index) == low["entries"]
        outs = harness.generate_ids(llm, prompts, 4)
        s = dict(vars(p.stats))
        by_tier = list(p.tier_stats.hit_tokens)
    from tutti.engine.keys import chunk_keys

    expect = []
    for pr in prompts:
        keys = chunk_keys(pr, CHUNK, p.seed)[: (len(pr) - 1) // CHUNK]
        n = 0
        while n < len(keys) and keys[n].hex() in stored:
            n += 1
        expect.append(n * CHUNK)
    got = [o.num_cached_tokens for o in outs]
    assert tokens(outs) == want
    assert s["loads_failed"] == 0
    where = {i: ["r" if k.hex() in set(ram["keys"].values()) else "d" if k.hex() in set(low["keys"].values()) else "-"
                 for k in chunk_keys(prompts[i], CHUNK, p.seed)[:8]] for i in range(len(prompts)) if got[i] != expect[i]}
    assert got == expect, (where, s, by_tier)  # every durable chunk of a prompt's prefix served, from either tier
    assert by_tier[1] > 0, by_tier  # some of it from the disk tier
    lost = sum(e - g for e, g in zip(expect, got) if e > g) // CHUNK * SLOT_BYTES
    report.tried = (f"SIGKILL of a tiered server ({RAM_SLOTS}-chunk RAM tier, {DISK_SLOTS}-chunk disk tier, "
                    f"write-through) storing 16x{PROMPT_LEN}-token batches, during batch {started}; "
                    f"{'kill landed while a write-down was in flight (disk slabs written, journal not yet)' if in_flight_seen else 'kill between write-downs'}")
    report.held = (f"RAM tier {ram['entries']} and disk tier {low['entries']} journaled chunks all pass checksums; "
                   f"a new server over both tiers hits exactly the journaled prefixes (tier hit tokens {by_tier}), "
                   "outputs == recompute")
    report.requests = len(prompts)
    report.faults = 1
    report.bytes_lost = lost
    report.counts = {"ram_chunks": ram["entries"], "disk_chunks": low["entries"], "hit_tokens": s["hit_tokens"],
                     "loads_failed": s["loads_failed"]}
    assert lost == 0
