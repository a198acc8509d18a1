"""What the TuttiConnectorV1 tests share (test_connector*.py, test_tp.py, test_scheduler.py): the
chunk size, the connector config, prompts, a fresh-process run and the no-connector reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import harness

CHUNK = 64  # tokens a chunk: 2 vLLM blocks of 32


def kv_config(root: Path, **extra) -> dict:
    return harness.kv_config(root, chunk=CHUNK, capacity="64MiB", **extra)


prompt = harness.prompt


def child_run(model_dir, kvt, prompts, max_tokens=8, **llm_kw) -> list[dict]:
    code = (
        "import json, harness\n"
        f"llm = harness.make_llm({str(model_dir)!r}, kv_transfer_config={kvt!r}, **{llm_kw!r})\n"
        f"outs = harness.generate_ids(llm, {prompts!r}, {max_tokens})\n"
        "harness.settle(llm)\n"
        "conn = harness.connector(llm)\n"
        "print('RESULT', json.dumps([{'tokens': list(o.outputs[0].token_ids), 'cached': o.num_cached_tokens}"
        " for o in outs]))\n"
        "print('STATS', json.dumps(vars(conn.planner.stats)))\n"
        "harness.shutdown_llm(llm)\n"
    )
    return results_of(code)


def results_of(code: str) -> tuple[list[dict], dict]:
    """Run `code` in a fresh process; its last RESULT and STATS lines, decoded."""
    out = harness.run_in_subprocess(code)
    res = json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:])
    stats = json.loads([l for l in out.splitlines() if l.startswith("STATS ")][-1][6:])
    return res, stats


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Tokens without any connector, computed once per prompt set."""
    cache: dict = {}

    def get(prompts, max_tokens=8, **kw):
        key = (json.dumps(prompts), max_tokens, json.dumps(kw, sort_keys=True))
        if key not in cache:
            llm = harness.make_llm(tiny_model, **kw)
            try:
                cache[key] = [list(o.outputs[0].token_ids) for o in harness.generate_ids(llm, prompts, max_tokens)]
            finally:
                harness.shutdown_llm(llm)
        return cache[key]

    return get


def connector_of(llm):
    return harness.connector(llm)
