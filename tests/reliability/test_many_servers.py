"""Many servers, one store: three real vLLM engines in separate processes on one root, all from
one configuration (no writer id: each finds a writer slot of its own, tutti.engine.claims).
What one stores is a hit on the others while all run; nothing is stored twice; a server killed
mid-run leaves its chunks readable and a restart takes a free slot back; outputs equal
recompute throughout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness
from relkit import CHUNK, kv_config, prompt, reference

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


def test_three_servers_share_one_store(tiny_model, tmp_path, report):
    root = tmp_path / "kv"
    p1 = [prompt(1100 + i, PROMPT_LEN) for i in range(2)]
    p2 = [prompt(1200 + i, PROMPT_LEN) for i in range(2)]
    servers = {}
    try:
        for w in ("a", "b", "c"):  # one after another, so that a takes the namespace's slot, b auto-1, c auto-2
            servers[w] = Proc(tiny_model, root)
            servers[w].wait_ready()
        want = reference(tiny_model, p1 + p2, 4)
        a, b, c = servers["a"], servers["b"], servers["c"]
        out_a = a.gen(p1)  # A computes and stores p1
        assert out_a["tokens"] == want[:2] and out_a["stats"]["stores_committed"] == 2 * CHUNKS
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
        b2 = Proc(tiny_model, root)  # a restart with the same config takes the free slot (b's) back
        servers["b"] = b2
        b2.wait_ready()
        out_b2 = b2.gen(p2 + p1)
        assert out_b2["cached"] == [full] * 4 and out_b2["tokens"] == want[2:] + want[:2]
        assert out_b2["stats"]["stores_committed"] == 0 and out_b2["stats"]["loads_failed"] == 0
        seconds = time.monotonic() - t0
    finally:
        for s in servers.values():
            if s.p.poll() is None:
                s.quit()
    writers = sorted(p.name for p in next(root.glob("tutti-*")).iterdir() if p.is_dir())
    assert writers == ["w-auto-1", "w-auto-2"]  # a wrote the namespace's own files ('')
    report.tried = ("three vLLM servers (separate processes, one identical config: writer slots found, '', auto-1, "
                    "auto-2) on one root: A stores, B and C hit while all run; B stores, A hits; B SIGKILLed, C hits "
                    "B's chunks; B restarted with the same config takes its slot back")
    report.held = ("every hit whole (cached tokens = 4 chunks), outputs == recompute, nothing stored twice, no load "
                   "failure; B's chunks readable after SIGKILL and its again after restart")
    report.requests = 2 * 6
    report.faults = 1
    report.bytes_lost = 0
    report.counts = {"hits_across_servers": 12, "seconds_after_first_store": round(seconds, 1)}
