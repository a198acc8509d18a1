"""The server test_crash.py kills: generates batch after batch of new prompts (each storing
many chunks) and prints BATCH i after each, until it is killed."""

from __future__ import annotations

import sys

import harness


def main(model: str, kvt: dict, batch_prompts=None) -> None:
    if batch_prompts is None:
        from test_crash import batch_prompts

    llm = harness.make_llm(model, kv_transfer_config=kvt)
    for i in range(1000):
        harness.generate_ids(llm, batch_prompts(i), 4)
        print(f"BATCH {i}", flush=True)
    sys.exit("not killed")
