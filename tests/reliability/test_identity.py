"""A chunk's identity is vLLM's block identity: a prompt stored under one cache salt or LoRA
adapter is never served to a request with another (and an adapter retrained under the same
name and path gets new keys), while requests of the same identity still hit.

Each phase is a fresh process over one root; queries run with vLLM's own prefix cache off, so
every cached token comes from tutti; outputs are compared with the same batches on an engine
without the connector. (The multimodal case, an image instead of a salt, is
tests/vllm/test_identity_mm.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import harness

AREA = "chunk identity"
CHUNK = 64
P = harness.prompt(7, 300)  # 4 whole chunks
HIT = 4 * CHUNK
LORA_KW = dict(enable_lora=True, max_lora_rank=8, max_loras=2)

CHILD = """
import json, harness
llm = harness.make_llm({model!r}, kv_transfer_config={kvt!r}, **{kw!r})
res = []
for batch in {batches!r}:  # one batch at a time: vLLM's CPU build mixes up base and LoRA requests in one batch
    res += [dict(tokens=list(o.outputs[0].token_ids), cached=o.num_cached_tokens)
            for o in harness.generate_requests(llm, batch)]
harness.settle(llm)
conn = harness.connector(llm)
print("RESULT", json.dumps(dict(res=res, stats=vars(conn.planner.stats) if conn is not None else {{}})))
harness.shutdown_llm(llm)
"""


def run(model: Path, batches: list[list[dict]], kvt: dict | None = None, **kw) -> tuple[list[dict], dict]:
    out = harness.run_in_subprocess(CHILD.format(model=str(model), kvt=kvt, kw={**LORA_KW, **kw}, batches=batches))
    data = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])
    return data["res"], data["stats"]


def test_salt_and_adapter_are_part_of_a_chunks_identity(tiny_model, tmp_path, report):
    kvt = harness.kv_config(tmp_path / "kv", chunk=CHUNK, capacity="64MiB")
    a1 = harness.make_lora_adapter(tmp_path / "a1", seed=1)
    a2 = harness.make_lora_adapter(tmp_path / "a2", seed=2)
    l1, l2 = ("a1", 1, a1), ("a2", 2, a2)
    report.tried = ("prompt stored under cache_salt 'tenant-a' and under LoRA adapter 1 (tiny random rank-8 "
                    "adapters that change the output); fresh process asks the same tokens with salt 'tenant-b', "
                    "'tenant-a', no salt, adapter 2, adapter 1; adapter 1 then retrained in place (same name and "
                    "path) and asked again")

    _, s1 = run(tiny_model, [[{"tokens": P, "salt": "tenant-a"}], [{"tokens": P, "lora": l1}]], kvt)
    assert s1["stores_committed"] == 8  # 4 chunks each: different keys for the same tokens

    queries = [[{"tokens": P, "salt": "tenant-b"}, {"tokens": P, "salt": "tenant-a"}, {"tokens": P}],
               [{"tokens": P, "lora": l2}], [{"tokens": P, "lora": l1}]]
    got, s2 = run(tiny_model, queries, kvt, enable_prefix_caching=False)
    ref, _ = run(tiny_model, queries, enable_prefix_caching=False)
    cached = [g["cached"] for g in got]
    assert cached == [0, HIT, 0, 0, HIT], cached  # a hit only within the identity that stored it
    assert s2["hit_tokens"] == 2 * HIT and s2["loads_failed"] == 0
    assert ref[3]["tokens"] != ref[4]["tokens"]  # the adapters change the output: a wrong hit would show
    assert [g["tokens"] for g in got] == [r["tokens"] for r in ref]

    harness.make_lora_adapter(tmp_path / "a1", seed=3)  # retrained under the same name and path
    again = [[{"tokens": P, "lora": l1}]]
    got3, s3 = run(tiny_model, again, kvt, enable_prefix_caching=False)
    assert got3[0]["cached"] == 0 and s3["hit_tokens"] == 0  # computed by vLLM itself: nothing of tutti's
    assert got3[0]["tokens"] != got[4]["tokens"]  # the retrained adapter answers otherwise

    report.held = ("0 hit tokens across salts, adapters and an adapter replaced in place (vLLM's own prefix "
                   "cache gives 0 there too); 256 hit tokens within the same salt and the same adapter; every "
                   "output == the same batch without the connector")
    report.requests = 1 + 1 + 5 + 5 + 1
    report.bad_inputs = 4
    report.bytes_lost = 0
    report.counts = {"hit_tokens_same_identity": s2["hit_tokens"], "hit_tokens_other_identity": 0,
                     "stores_committed": s1["stores_committed"], "loads_failed": s2["loads_failed"] + s3["loads_failed"]}
