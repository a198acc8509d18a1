"""Shared pieces of the reliability tests: configs, prompts, engines, and an out-of-process
check of a store's integrity."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any, Sequence

import harness

CHUNK = 32  # tokens a chunk: one vLLM block of 32


def kv_config(root: str | os.PathLike, *, chunk: int = CHUNK, capacity: Any = "16MiB", **extra) -> dict:
    return harness.kv_config(root, chunk=chunk, capacity=capacity, **extra)


prompt = harness.prompt


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def connector_of(llm):
    return harness.connector(llm)


@contextlib.contextmanager
def engine(model_dir, kvt: dict | None = None, **kw):
    """A vLLM engine in this process, always shut down (so the next one can start)."""
    llm = harness.make_llm(model_dir, kv_transfer_config=kvt, **kw)
    try:
        yield llm
    finally:
        harness.shutdown_llm(llm)


def reference(model_dir, prompts: Sequence[Sequence[int]], max_tokens: int = 2, **kw) -> list[list[int]]:
    """Recompute: the same prompts through an engine without the connector."""
    with engine(model_dir, None, **kw) as llm:
        return tokens(harness.generate_ids(llm, prompts, max_tokens))


def failed_start_cleanup() -> None:
    """An engine whose start raised leaves vLLM's process-global connector and distributed state
    behind; clear both so the next engine in this process starts clean."""
    import gc

    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()


def stats(llm) -> dict:
    return dict(vars(connector_of(llm).planner.stats))


# ---------------------------------------------------------------------------- store checks
_VERIFY = r'''
import json, os, sys
import torch
from tutti.store.fingerprint import Fingerprint
from tutti.store.chunk_store import ChunkStore, list_namespaces
from tutti.kernels import segment_checksum

root = sys.argv[1]
out = {}
for ns in list_namespaces(root):
    if ns.manifest is None:
        out[ns.digest] = {"error": ns.error}
        continue
    fp = Fingerprint.from_dict(ns.manifest["fingerprint"])
    st = ChunkStore([root], fp, capacity_bytes=1 << 50, writer=False)
    try:
        bad, good = [], []
        for slot, e in sorted(st.entries().items()):
            ok = True
            for layer in range(st.num_layers):
                try:
                    fd, off = st.location(slot, layer)
                    data = os.pread(fd, st.segment_bytes, off)
                except OSError:
                    data = b""
                if len(data) != st.segment_bytes:
                    ok = False
                    break
                got = int(segment_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8))) & ((1 << 64) - 1)
                if got != e.checksums[layer]:
                    ok = False
                    break
            (good if ok else bad).append(slot)
        # bytes on disk in slots the journal does not list: stores cut off before their journal record
        unjournaled = 0
        for name in os.listdir(ns.path):
            if name.startswith("slab-") and name.endswith(".bin"):
                slab = int(name[5:-4])
                path = os.path.join(ns.path, name)
                with open(path, "rb") as f:
                    data = f.read()
                for i in range(0, len(data), st.slot_bytes):
                    slot = slab * st.slots_per_slab + i // st.slot_bytes
                    if slot not in st.entries() and any(data[i:i + st.slot_bytes]):
                        unjournaled += 1
        out[ns.digest] = {"entries": len(good) + len(bad), "good": good, "bad": bad,
                          "keys": {str(s): e.key.hex() for s, e in st.entries().items()},
                          "slot_bytes": st.slot_bytes, "unjournaled_slots": unjournaled,
                          "dropped_tail_bytes": st.journal.dropped_tail_bytes,
                          "fingerprint": ns.manifest["fingerprint"]}
    finally:
        st.close()
print("VERIFY", json.dumps(out))
'''


def verify_store(root: str | os.PathLike) -> dict[str, dict]:
    """Open every namespace under `root` read-only in a fresh `python3 -c` and check each journaled
    segment against its (unsigned 64-bit) checksum. Returns digest -> summary."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(["python3", "-c", _VERIFY, str(root)], capture_output=True, text=True, env=env,
                       cwd=str(repo), timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"store verification failed rc={p.returncode}:\n{p.stderr[-4000:]}")
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("VERIFY ")][-1]
    return json.loads(line[7:])


def only_namespace(summary: dict[str, dict]) -> dict:
    assert len(summary) == 1, f"expected one namespace, found {list(summary)}"
    return next(iter(summary.values()))


def write_weights(model_dir: str | os.PathLike, seed: int) -> Path:
    """Real (random) safetensors weights for the tiny Llama in `model_dir`, so a test can replace
    a checkpoint in place (load with load_format="safetensors"); dummy weights ignore the seed."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.08).to(torch.float32)

    w = {"model.embed_tokens.weight": rnd(v, h), "lm_head.weight": rnd(v, h), "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
                  p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
                  p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                  p + "mlp.down_proj.weight": rnd(h, inter), p + "input_layernorm.weight": torch.ones(h),
                  p + "post_attention_layernorm.weight": torch.ones(h)})
    out = Path(model_dir) / "model.safetensors"
    save_file(w, str(out))
    return out


def disk_state(root: Path) -> tuple[int, int]:
    """(latest slab write time, journal length) of the namespace under `root`."""
    slab = journal = 0
    for p in root.glob("tutti-*/*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.name.startswith("slab-"):
            slab = max(slab, st.st_mtime_ns)
        elif p.name == "journal.bin":
            journal = st.st_size
    return slab, journal


def kill_mid_write(code: str, watch: Path, *, from_batch: int, by_batch: int,
                   timeout_s: float = 240) -> tuple[list[int], bool]:
    """Run `code` (a server printing "BATCH i" after each batch) in a fresh interpreter and SIGKILL
    it, once `from_batch` batches are done and its journal names something, at a moment when
    `watch`'s slabs are being written that its journal does not name yet (a write in flight), or
    after `by_batch` batches (still once something is journaled). A put is journaled only once its
    bytes are durable, so on a busy machine the journal can trail the batches by seconds: killed
    before its first record, the kill would test nothing. Returns the batches printed and whether
    the kill landed mid-write."""
    import signal
    import sys
    import threading
    import time

    env = dict(os.environ, **harness.ENV_DEFAULTS)
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(repo / "tests" / "vllm"), env.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=str(repo))
    batches: list[int] = []

    def read() -> None:
        for line in child.stdout:
            if line.startswith("BATCH "):
                batches.append(int(line.split()[1]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    in_flight_seen = False
    last = (0, 0)
    try:
        while time.monotonic() < deadline and child.poll() is None:
            now = disk_state(watch)
            journaled = last[1] > 0
            if len(batches) >= from_batch and journaled and now[0] > last[0] and now[1] == last[1] and last[0] > 0:
                in_flight_seen = True
                break
            if len(batches) >= by_batch and journaled:
                break
            last = now
            time.sleep(0.002)
        assert child.poll() is None, f"child exited early: {child.stderr.read()[-3000:]}"
        child.send_signal(signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
    reader.join(timeout=5)
    assert child.returncode == -signal.SIGKILL
    return batches, in_flight_seen
