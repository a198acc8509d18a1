"""A chunk's identity is vLLM's block identity: cache salt and LoRA adapter, on real engines.

Each phase is a fresh process over one store root. Queries run with vLLM's own prefix cache
off, so every cached token comes from tutti; tokens are compared with the same requests on an
engine without the connector.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import harness

CHUNK = 64
P = harness.prompt(7, 300)  # 4 whole chunks
HIT = 4 * CHUNK
LORA_KW = dict(enable_lora=True, max_lora_rank=8, max_loras=2)


def kv_config(root: Path) -> dict:
    return harness.kv_config(root, chunk=CHUNK, capacity="64MiB")


def run(model, reqs, kvt=None, **llm_kw) -> tuple[list[dict], dict]:
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(model)!r}, kv_transfer_config={kvt!r}, **{llm_kw!r})\n"
        f"outs = harness.generate_requests(llm, {reqs!r})\n"
        "harness.settle(llm)\n"
        "conn = llm.llm_engine.engine_core.engine_core.scheduler.connector\n"
        "print('RESULT', json.dumps([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens}"
        " for o in outs]))\n"
        "print('STATS', json.dumps(vars(conn.planner.stats) if conn is not None else {}))\n"
        "harness.shutdown_llm(llm)\n"
    )
    out = harness.run_in_subprocess(code)
    res = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])
    stats = json.loads([l for l in out.splitlines() if l.startswith("STATS ")][-1][6:])
    return res, stats


def test_cache_salt_isolates_tenants(tiny_model, tmp_path):
    kvt = kv_config(tmp_path / "kv")
    stored, s1 = run(tiny_model, [{"tokens": P, "salt": "tenant-a"}], kvt)
    assert s1["stores_committed"] == 4
    queries = [{"tokens": P, "salt": "tenant-b"}, {"tokens": P, "salt": "tenant-a"}, {"tokens": P}]
    got, s2 = run(tiny_model, queries, kvt, enable_prefix_caching=False)
    assert [g["cached"] for g in got] == [0, HIT, 0]  # only the tenant that stored it hits
    assert s2["hit_tokens"] == HIT and s2["loads_failed"] == 0
    ref, _ = run(tiny_model, queries, enable_prefix_caching=False)
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]
    assert stored[0]["tokens"] == ref[1]["tokens"]


def test_lora_adapters_do_not_share_chunks(tiny_model, tmp_path):
    a1 = harness.make_lora_adapter(tmp_path / "a1", seed=1)
    a2 = harness.make_lora_adapter(tmp_path / "a2", seed=2)
    l1, l2 = ("a1", 1, a1), ("a2", 2, a2)
    kvt = kv_config(tmp_path / "kv")
    _, s1 = run(tiny_model, [{"tokens": P, "lora": l1}], kvt, **LORA_KW)
    assert s1["stores_committed"] == 4
    # (vLLM's CPU build mixes up a base-model request batched with LoRA requests, with or
    # without a connector: the no-adapter case is the salt test's third query)
    queries = [{"tokens": P, "lora": l2}, {"tokens": P, "lora": l1}]
    got, s2 = run(tiny_model, queries, kvt, enable_prefix_caching=False, **LORA_KW)
    assert [g["cached"] for g in got] == [0, HIT]  # a hit only under the adapter that stored it
    assert s2["hit_tokens"] == HIT and s2["loads_failed"] == 0
    ref, _ = run(tiny_model, queries, enable_prefix_caching=False, **LORA_KW)
    assert ref[0]["tokens"] != ref[1]["tokens"]  # the adapters change the output
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]


def test_an_adapter_replaced_under_its_name_and_path_gets_new_keys(tiny_model, tmp_path):
    """vLLM keys a LoRA block by name and path; tutti also keys the adapter's content."""
    path = harness.make_lora_adapter(tmp_path / "a", seed=1)
    kvt = kv_config(tmp_path / "kv")
    run(tiny_model, [{"tokens": P, "lora": ("a", 1, path)}], kvt, **LORA_KW)
    harness.make_lora_adapter(tmp_path / "a", seed=3)  # retrained, same name and path
    got, s2 = run(tiny_model, [{"tokens": P, "lora": ("a", 1, path)}], kvt, enable_prefix_caching=False, **LORA_KW)
    ref, _ = run(tiny_model, [{"tokens": P, "lora": ("a", 1, path)}], enable_prefix_caching=False, **LORA_KW)
    assert got[0]["cached"] == 0 and s2["hit_tokens"] == 0
    assert got[0]["tokens"] == ref[0]["tokens"]


def test_vllm_block_hash_inputs_are_what_tutti_keys_cover():
    """tutti keys token ids plus vLLM's own per-block extra keys (it calls the function vLLM's
    block hash uses). This fails if vLLM's block hash starts taking another input, which tutti
    would then have to cover too."""
    from vllm.v1.core import kv_cache_utils as kcu

    assert list(inspect.signature(kcu.hash_block_tokens).parameters) == [
        "hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys"]
    assert list(inspect.signature(kcu.generate_block_hash_extra_keys).parameters) == [
        "request", "start_token_idx", "end_token_idx", "start_mm_idx"]
    src = inspect.getsource(kcu.generate_block_hash_extra_keys)
    for part in ("_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys", "cache_salt",
                 "_gen_prompt_embeds_extra_hash_keys"):
        assert part in src, part


def test_request_identity_follows_vllm_extra_keys():
    """The identity bytes differ exactly where vLLM's extra keys (or the adapter) differ."""
    from types import SimpleNamespace

    from tutti.vllm.compat import request_identity

    def req(**kw):
        base = dict(lora_request=None, mm_features=None, cache_salt=None, prompt_embeds=None)
        base.update(kw)
        return SimpleNamespace(**base)

    assert request_identity(req(), 32) is None  # token ids alone
    a, b = request_identity(req(cache_salt="a"), 32), request_identity(req(cache_salt="b"), 32)
    assert a(0, 64) != b(0, 64)
    assert a(64, 128) == b(64, 128)  # the salt keys the first block; the chain carries it on
