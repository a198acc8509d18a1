"""KV events across nodes: a reader announces the chunks another node's server stored on the
shared volume (with the extras that server recorded: vLLM's block hashes for a router) once it
follows them there, and withdraws them when their owner evicts them. tutti.vllm.events turns
these into vLLM's BlockStored/BlockRemoved (tests/vllm/test_events.py)."""

from __future__ import annotations

import time

from nodes import BPC, Server, prompt, wait_for

FOLLOW_LIMIT_S = 5.0  # stated: stored on node a, announced by node b's server within this


def test_a_reader_on_another_node_announces_what_the_writer_stored_and_withdraws_it(on_volume):
    root_a, root_b = on_volume
    # planners that announce (kv_events_endpoint set, as a server with events)
    a, b = Server(root_a, "a", 0, announce=True), Server(root_b, "b", 1, announce=True)
    try:
        _, _, plan = a.request("r1", prompt(5, 2), list(range(0, 2 * BPC + 1)))
        keys = [st.key for st in plan.stores]
        a.planner.extras.append([(k, {"h": [i]}) for i, k in enumerate(keys)])  # what the connector records
        t0 = time.monotonic()
        got: list = []
        assert wait_for(lambda: got.extend(b.planner.foreign.take_events()) or len(got) >= 2, FOLLOW_LIMIT_S)
        delay = time.monotonic() - t0
        assert sorted((kind, k, x["h"][0]) for kind, k, x in got) == sorted(("stored", k, i) for i, k in enumerate(keys))
        for i in range(4):  # a fills its 8-slot capacity: the first prompt's chunks are evicted
            a.request(f"fill{i}", prompt(300 + i, 2), list(range(0, 2 * BPC + 1)))
        gone: list = []
        assert wait_for(lambda: gone.extend(e for e in b.planner.foreign.take_events() if e[0] == "removed")
                        or {k for _, k, _ in gone} >= set(keys), FOLLOW_LIMIT_S)
        print(f"announced on the other node {delay:.2f} s after the store")
    finally:
        for s in (a, b):
            if s.planner.extras is not None:
                s.planner.extras.close()
            s.close()
