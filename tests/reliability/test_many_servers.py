"""Many servers, one store: three real vLLM engines in separate processes on one root, all from
one configuration (no writer id: each finds a writer slot of its own, tutti.engine.claims).
What one stores is a hit on the others while all run; nothing is stored twice; a server killed
mid-run leaves its chunks readable and a restart takes a free slot back; outputs equal
recompute throughout.

Events a router can use, on the same servers: each publishes tutti's KV events on its own topic
(`kv@{host}-{writer}@{model}`, one config) to one bound subscriber that decodes them with vLLM's
own event classes. A chunk one server stores is announced by every server (any of them can load
it); a request routed by those announcements to a server that did not store the prefix hits it;
a server restarted with the same config announces what it can load before it serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness
from relkit import CHUNK, kv_config, prompt, reference

zmq = pytest.importorskip("zmq")
from test_events import Subscriber  # noqa: E402 - tests/vllm: vLLM's wire format, decoded

AREA = "many servers, one store"
CHUNKS = 4
PROMPT_LEN = CHUNKS * CHUNK + 3

SERVER = """
import json, sys, harness
llm = harness.make_llm({model!r}, kv_transfer_config={kvt!r})
conn = harness.connector(llm)
print("READY", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "gen":
        llm.reset_prefix_cache()  # a hit must come from the store, not vLLM's own cache
        outs = harness.generate_ids(llm, cmd["prompts"], 4)
        harness.settle(llm)
        print("OUT " + json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "cached": [o.num_cached_tokens for o in outs],
                                  "stats": vars(conn.planner.stats)}}), flush=True)
    elif cmd["op"] == "quit":
        break
harness.shutdown_llm(llm)
"""


class Proc:
    """A vLLM engine in a process of its own, driven over stdin/stdout; `extra`: more connector keys."""

    def __init__(self, model, root, **extra):
        repo = Path(__file__).resolve().parents[2]
        env = dict(os.environ, **harness.ENV_DEFAULTS)
        env["PYTHONPATH"] = os.pathsep.join([str(repo), str(repo / "tests" / "vllm"), env.get("PYTHONPATH", "")])
        kvt = kv_config(root, follow_interval_s=0.1, **extra)  # the same for every server
        self.p = subprocess.Popen([sys.executable, "-c", SERVER.format(model=str(model), kvt=kvt)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env, cwd=str(repo))

    def wait_ready(self):
        line = self.p.stdout.readline()
        while line and not line.startswith("READY"):
            line = self.p.stdout.readline()
        assert line.startswith("READY"), f"server did not start: {self.p.stderr.read()[-3000:]}"

    def gen(self, prompts):
        self.p.stdin.write(json.dumps({"op": "gen", "prompts": prompts}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        while line and not line.startswith("OUT "):
            line = self.p.stdout.readline()
        assert line, f"server died: {self.p.stderr.read()[-3000:]}"
        return json.loads(line[4:])

    def quit(self):
        if self.p.poll() is None:
            try:
                self.p.communicate(json.dumps({"op": "quit"}) + "\n", timeout=120)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_three_servers_share_one_store(tiny_model, tmp_path, report, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # one hash seed for every replica, as llm-d requires
    root = tmp_path / "kv"
    p1 = [prompt(1100 + i, PROMPT_LEN) for i in range(2)]
    p2 = [prompt(1200 + i, PROMPT_LEN) for i in range(2)]
    port = _free_port()
    ctx = zmq.Context()
    sub = Subscriber(ctx, bind=f"tcp://127.0.0.1:{port}")  # the router's indexer binds; servers connect
    extra = {"kv_events_endpoint": f"tcp://127.0.0.1:{port}", "kv_events_topic": "kv@{host}-{writer}@{model}"}

    def stored_by_topic() -> dict[str, list]:
        with sub._lock:
            pairs = list(zip([t for t, _ in sub.frames], sub.batches))
        out: dict[str, list] = {}
        for topic, batch in pairs:
            for e in batch.events:
                if type(e).__name__ == "BlockStored":
                    out.setdefault(topic.decode(), []).extend(e.block_hashes)
        return out

    n = 2 * CHUNKS * (CHUNK // 32)  # vLLM block hashes of two prompts' chunks (one per 32 tokens)
    servers = {}
    try:
        for w in ("a", "b", "c"):  # one after another, so that a takes the namespace's slot, b auto-1, c auto-2
            servers[w] = Proc(tiny_model, root, **extra)
            servers[w].wait_ready()
        want = reference(tiny_model, p1 + p2, 4)
        a, b, c = servers["a"], servers["b"], servers["c"]
        out_a = a.gen(p1)  # A computes and stores p1
        assert out_a["tokens"] == want[:2] and out_a["stats"]["stores_committed"] == 2 * CHUNKS
        t_ann = time.monotonic()
        sub.drain(lambda: len(stored_by_topic()) == 3 and all(len(set(h)) >= n for h in stored_by_topic().values()),
                  timeout=30)
        announce_s = time.monotonic() - t_ann
        stored = stored_by_topic()
        topics = sorted(stored)
        own = next(t for t in topics if "-0@" in t)  # A took the namespace's own slot
        assert len(topics) == 3 and len(set(stored[own])) == n
        assert all(set(stored[t]) == set(stored[own]) for t in topics)  # every replica announces what it can load
        # route by the announcements: the replicas that did not store p1 announce its first block
        routed = [t for t in topics if t != own and stored[own][0] in stored[t]]
        assert sorted("auto-1" in t or "auto-2" in t for t in routed) == [True, True]
        time.sleep(0.5)  # > the follow interval (0.1 s), with margin for a loaded CI machine
        t0 = time.monotonic()
        out_b = b.gen(p1)  # B and C hit A's chunks while all three run
        out_c = c.gen(p1)
        full = CHUNKS * CHUNK
        assert out_b["cached"] == [full, full] and out_c["cached"] == [full, full], (out_b["cached"], out_c["cached"])
        assert out_b["tokens"] == want[:2] and out_c["tokens"] == want[:2]
        assert out_b["stats"]["stores_committed"] == 0 and out_c["stats"]["stores_committed"] == 0  # not stored twice
        assert out_b["stats"]["loads_failed"] == 0
        out_b = b.gen(p2)  # B stores p2, A hits it
        assert out_b["stats"]["stores_committed"] == 2 * CHUNKS
        time.sleep(0.5)
        out_a = a.gen(p2)
        assert out_a["cached"] == [full, full] and out_a["tokens"] == want[2:]
        b.kill()  # SIGKILL: its lock dies with it, its chunks stay readable
        out_c = c.gen(p2)
        assert out_c["cached"] == [full, full] and out_c["tokens"] == want[2:] and out_c["stats"]["loads_failed"] == 0
        b_topic = next(t for t in topics if "auto-1" in t)
        before = len(stored_by_topic().get(b_topic, []))
        b2 = Proc(tiny_model, root, **extra)  # a restart with the same config takes the free slot (b's) back
        servers["b"] = b2
        b2.wait_ready()
        # before serving anything it announces what it can load: A's p1 and its own p2 (as recorded)
        sub.drain(lambda: len(stored_by_topic().get(b_topic, [])) >= before + 2 * n, timeout=30)
        assert set(stored_by_topic()[b_topic][before:]) >= set(stored[own])
        out_b2 = b2.gen(p2 + p1)
        assert out_b2["cached"] == [full] * 4 and out_b2["tokens"] == want[2:] + want[:2]
        assert out_b2["stats"]["stores_committed"] == 0 and out_b2["stats"]["loads_failed"] == 0
        seconds = time.monotonic() - t0
    finally:
        for s in servers.values():
            if s.p.poll() is None:
                s.quit()
        sub.close()
        ctx.term()
    writers = sorted(p.name for p in next(root.glob("tutti-*")).iterdir() if p.is_dir())
    assert writers == ["w-auto-1", "w-auto-2"]  # a wrote the namespace's own files ('')
    report.tried = ("three vLLM servers (separate processes, one identical config: writer slots found, '', auto-1, "
                    "auto-2) on one root, each publishing tutti's KV events on its own topic to one subscriber: A "
                    "stores, B and C (routed by the announcements) hit while all run; B stores, A hits; B SIGKILLed, "
                    "C hits B's chunks; B restarted with the same config takes its slot back")
    report.held = ("every hit whole (cached tokens = 4 chunks), outputs == recompute, nothing stored twice, no load "
                   "failure; B's chunks readable after SIGKILL and its again after restart; all three replicas "
                   f"announced A's block hashes within {announce_s:.2f} s, the restarted one before serving")
    report.requests = 2 * 6
    report.faults = 1
    report.bytes_lost = 0
    report.counts = {"hits_across_servers": 12, "seconds_after_first_store": round(seconds, 1),
                     "announce_seconds": round(announce_s, 2)}
