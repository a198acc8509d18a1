"""tutti as a user runs it on a distributed file system: two real vLLM CPU servers, each on its
own node's mount of one GlusterFS volume, with one configuration for both (the same root path,
writer_id "auto": no per-server id). Each server runs in a mount namespace of its own where its
node's mount is bound at the configured root, as on two machines that mount the volume at the
same place. A prompt one server stores is a hit on the other, loaded from the other node's
writer directory, within a stated time; its tokens equal recompute's; the same hit with its loads
writing nothing (the negative control) gives other tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness
import phases

CHUNK = 64  # tokens a chunk: 2 vLLM blocks of 32
CHUNKS = 4
FOLLOW_LIMIT_S = 5.0  # stated: a chunk stored on one node is a hit on the other within this
REPO = Path(__file__).resolve().parents[2]

SERVER = r"""
import json, sys, time
import harness
kvt = json.loads(sys.argv[1])
llm = harness.make_llm(sys.argv[2], kv_transfer_config=kvt)
conn = harness.connector(llm)
print("READY {}", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "generate":
        outs = harness.generate_ids(llm, cmd["prompts"], cmd.get("tokens", 8))
        harness.settle(llm)
        print("RESULT " + json.dumps({"t": time.time(), "tokens": [list(o.outputs[0].token_ids) for o in outs],
                                      "cached": [o.num_cached_tokens for o in outs],
                                      "stats": dict(vars(conn.planner.stats))}), flush=True)
    elif cmd["op"] == "follow":  # until the other writers' chunks this server knows reach n
        t0 = time.monotonic()
        foreign = conn.planner.foreign
        while len(foreign) < cmd["n"] and time.monotonic() - t0 < cmd["timeout"]:
            time.sleep(0.01)
        print("FOLLOWED " + json.dumps({"t": time.time(), "n": len(foreign), "writers": list(foreign.writers)}),
              flush=True)
    else:
        break
harness.shutdown_llm(llm)
print("BYE", flush=True)
"""


class Server:
    """A vLLM server process on one node: its node's mount bound at `root` in a mount namespace of
    its own (util-linux unshare), so both servers are given the very same configuration."""

    def __init__(self, node_mount: Path, root: Path, model: Path, kvt: dict, log: Path) -> None:
        env = dict(os.environ, **harness.ENV_DEFAULTS)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests" / "vllm"), env.get("PYTHONPATH", "")])
        self.log = log
        self._err = open(log, "w")
        self.p = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             'mount --bind "$0" "$1" && exec "$2" -c "$3" "$4" "$5"',
             str(node_mount), str(root), sys.executable, SERVER, json.dumps(kvt), str(model)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env, cwd=str(REPO))

    def expect(self, prefix: str) -> dict:
        line = self.p.stdout.readline()
        while line and not line.startswith(prefix + " "):
            line = self.p.stdout.readline()
        assert line, f"server exited before {prefix}: {self.log.read_text()[-3000:]}"
        return json.loads(line[len(prefix) + 1:])

    def ask(self, prefix: str, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.expect(prefix)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"op": "quit"}\n')
                self.p.stdin.flush()
                self.p.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        self._err.close()


def test_a_prompt_stored_on_one_node_is_a_hit_on_the_other(cluster, on_volume, tiny_model, tmp_path):
    vol_a, vol_b = on_volume
    root = tmp_path / "kv"  # the one configured root; each server's namespace binds its node's mount here
    root.mkdir()
    kvt = harness.kv_config(root, chunk=CHUNK, capacity="64MiB")  # writer_id: "auto" (the default)
    p = harness.prompt(5301, CHUNKS * CHUNK + 3)
    t0 = time.perf_counter()
    a = Server(vol_a, root, tiny_model, kvt, tmp_path / "a.log")
    b = Server(vol_b, root, tiny_model, kvt, tmp_path / "b.log")
    try:
        want = phases.run(tiny_model, vol_b, [p], connector=None, chunk=CHUNK, engine={}, tokens=8)
        assert "tokens" in want, want.get("error")
        a.expect("READY")
        b.expect("READY")
        started = time.perf_counter() - t0

        stored = a.ask("RESULT", op="generate", prompts=[p])
        assert stored["cached"] == [0] and stored["stats"]["stores_committed"] == CHUNKS, stored["stats"]
        assert stored["tokens"] == want["tokens"]
        followed = b.ask("FOLLOWED", op="follow", n=CHUNKS, timeout=2 * FOLLOW_LIMIT_S)
        delay = followed["t"] - stored["t"]
        assert followed["n"] >= CHUNKS, f"node b's server knew {followed['n']} of node a's chunks after {delay:.1f} s"
        assert delay < FOLLOW_LIMIT_S

        hit = b.ask("RESULT", op="generate", prompts=[p])
        assert hit["cached"] == [CHUNKS * CHUNK], hit
        assert hit["stats"]["hit_tokens"] == CHUNKS * CHUNK and hit["stats"]["loads_failed"] == 0, hit["stats"]
        assert hit["stats"]["stores_committed"] == 0, "node b stored the chunks again instead of loading node a's"
        assert hit["tokens"] == want["tokens"], "a hit loaded across nodes gave other tokens than recompute"
    finally:
        a.close()
        b.close()
    ns = next(vol_b.glob("tutti-*"))
    writers = sorted(d.name for d in ns.iterdir() if d.is_dir() and d.name.startswith("w-"))
    assert writers == ["w-auto-1"], f"two servers, one configuration: one more writer slot expected, found {writers}"

    # the negative control: the same hit through node b, its loads writing nothing
    ctl = phases.run(tiny_model, vol_b, [p], connector="TuttiConnectorV1", chunk=CHUNK, engine={}, drop="kv",
                     tokens=8)
    assert ctl.get("cached") == [CHUNKS * CHUNK], ctl.get("error")
    assert ctl["tokens"][0] != want["tokens"][0], "the tokens do not depend on the loaded KV"
    print(f"\ntwo servers up on two nodes in {started:.1f} s; node a's stored chunks known on node b "
          f"{delay:.2f} s after its store returned; hit {CHUNKS * CHUNK} tokens, equal to recompute's")
