"""Events a router can use: three real vLLM engines (separate processes) from one configuration
on one root, each publishing tutti's KV events on its own topic to one subscriber, decoded with
vLLM's own event classes. A chunk one server stores is announced by every server (any of them
can load it), and a request routed by those announcements to a server that did not store the
prefix hits it there, with recompute's tokens; a replica restarted with the same config
announces what it can load before it serves anything."""

from __future__ import annotations

import socket
import time

import pytest

from relkit import CHUNK, prompt, reference
from test_many_servers import CHUNKS, PROMPT_LEN, Proc

zmq = pytest.importorskip("zmq")
from test_events import Subscriber  # noqa: E402 - tests/vllm: vLLM's wire format, decoded

AREA = "replicas and events"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_replica_announces_what_any_can_load_and_a_routed_request_hits(tiny_model, tmp_path, report,
                                                                             monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # one hash seed for every replica, as llm-d requires
    root = tmp_path / "kv"
    port = _free_port()
    ctx = zmq.Context()
    sub = Subscriber(ctx, bind=f"tcp://127.0.0.1:{port}")  # the router's indexer binds; servers connect
    extra = {"kv_events_endpoint": f"tcp://127.0.0.1:{port}", "kv_events_topic": "kv@{host}-{writer}@{model}"}
    p1 = [prompt(1300 + i, PROMPT_LEN) for i in range(2)]
    servers = {}
    try:
        for w in ("a", "b", "c"):
            servers[w] = Proc(tiny_model, root, **extra)
            servers[w].wait_ready()
        want = reference(tiny_model, p1, 4)
        a, c = servers["a"], servers["c"]

        def by_topic(kind):
            with sub._lock:
                pairs = list(zip([t for t, _ in sub.frames], sub.batches))
            out: dict[str, list] = {}
            for topic, batch in pairs:
                for e in batch.events:
                    if type(e).__name__ == kind:
                        out.setdefault(topic.decode(), []).extend(e.block_hashes)
            return out

        out_a = a.gen(p1)  # A computes and stores p1: 2 x CHUNKS chunks
        assert out_a["tokens"] == want and out_a["stats"]["stores_committed"] == 2 * CHUNKS
        t0 = time.monotonic()
        n = 2 * CHUNKS * (CHUNK // 32)  # one vLLM block hash per 32 tokens
        sub.drain(lambda: len(by_topic("BlockStored")) == 3
                  and all(len(set(h)) >= n for h in by_topic("BlockStored").values()), timeout=30)
        seconds = time.monotonic() - t0
        stored = by_topic("BlockStored")
        topics = sorted(stored)
        assert len(topics) == 3 and all(t.startswith("kv@") for t in topics), topics
        hashes = {t: set(h) for t, h in stored.items()}
        own = next(t for t in topics if "-0@" in t)  # A took the namespace's own slot
        assert len(hashes[own]) == n
        assert all(hashes[t] == hashes[own] for t in topics)  # every replica announces what it can load
        # route the second prompt by the announcements: any replica but the one that stored it
        first_block = stored[own][0]
        candidates = [t for t in topics if t != own and first_block in hashes[t]]
        assert len(candidates) == 2
        target = servers["c"] if any("auto-2" in t for t in candidates) else servers["b"]
        out = target.gen([p1[1]])
        full = CHUNKS * CHUNK
        assert out["cached"] == [full] and out["tokens"] == want[1:]
        assert out["stats"]["stores_committed"] == 0 and out["stats"]["loads_failed"] == 0
        assert target is c
        # a replica restarted with the same config announces, without a request, what it can load
        b_topic = next(t for t in topics if "auto-1" in t)
        servers["b"].quit()
        before = len(by_topic("BlockStored").get(b_topic, []))
        servers["b"] = Proc(tiny_model, root, **extra)
        servers["b"].wait_ready()
        sub.drain(lambda: len(by_topic("BlockStored").get(b_topic, [])) >= before + n, timeout=30)
        assert set(by_topic("BlockStored")[b_topic][before:]) == hashes[own]
    finally:
        for s in servers.values():
            if s.p.poll() is None:
                s.quit()
        sub.close()
        ctx.term()
    report.tried = ("three vLLM engines (separate processes, one config) on one root, each publishing tutti's KV "
                    "events on its own topic (kv@{host}-{writer}@{model}) to one bound subscriber; A stores 2 "
                    "prompts; the second is routed by the announcements to a replica that did not store it")
    report.held = ("all three replicas announced the same block hashes (vLLM's, decoded with KVEventBatch) for A's "
                   f"chunks within {seconds:.1f} s; the routed request hit every chunk with recompute's tokens")
    report.requests = 3
    report.faults = 0
    report.bytes_lost = 0
    report.counts = {"topics": 3, "announce_seconds": round(seconds, 2)}
