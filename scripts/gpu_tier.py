"""tutti as a secondary tier of vLLM's OffloadingConnector, end to end on the GPU (the
OffloadingConnector needs CUDA), and vLLM's own `fs` tier on the same disk as the baseline.

Each phase is a fresh process (so vLLM's CPU tier starts empty and a hit must come from the
secondary tier), PYTHONHASHSEED fixed (vLLM's offload keys are seeded by it):
  proof (tiny model, eager): store -> fresh process: hit from tutti's tier, tokens equal the
      storing run's -> every stored chunk damaged on disk -> fresh process: tokens still equal
      (the tier refuses the damaged chunks; vLLM recomputes), refusals counted from the log.
  bench (8B KV geometry, vLLM's default mode): no connector (recompute, timed in a fresh process
      like the hits), vLLM's fs tier, TuttiTier and tutti's own connector, all on the same disk:
      store the prompt, then a fresh process times the hit; ratio to recompute of the same call.

    python3 scripts/gpu_tier.py --out /tmp/tier [--lengths 32768] [--skip-bench]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from subcase import emit, run_case  # noqa: E402


def kvt(tier: str, root: str, cpu_bytes: int) -> dict | None:
    if tier == "none":  # no connector: the recompute baseline of the same call
        return None
    if tier == "connector":  # tutti's own layer-wise connector on the same disk, for the same table
        return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": {
                    "root": root, "capacity_bytes": "24GiB", "chunk_tokens": 256, "staging_bytes": "8GiB",
                    "staging_slots": 1024, "max_inflight_stores": 1000}}
    sec = ({"type": "fs", "root_dir": root} if tier == "fs" else
           {"type": "tutti", "root": root, "capacity_bytes": "24GiB"})
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes,
                                          "secondary_tiers": [sec]}}


def phase(a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from tutti.vllm.plugin import register

    register()  # the tier type "tutti" (vLLM 0.26 finds tiers by registered name only)
    from vllm_ttft import bench_engine, prompt, timed_generate

    t0 = time.time()
    llm = bench_engine(a.model, kvt(a.tier, a.root, a.cpu_bytes), max_len=max(a.lengths) + 512, gpu_mem=0.5,
                       eager=a.eager)
    out = {"phase": a.phase, "tier": a.tier, "engine_start_s": time.time() - t0, "lengths": {}}
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen, one, sixteen = timed_generate(llm)

    gen([prompt(998, 64, vocab)], one)  # warm-up
    for n in a.lengths:
        p = prompt(n, n, vocab)
        t1, o1 = gen([p], one)  # store: the first prefill; hit: from the secondary tier (CPU tier empty)
        if a.phase == "store":
            for _ in range(40):  # let the CPU tier's stores cascade to the secondary tier
                gen([prompt(999, 16, vocab)], one)
                time.sleep(0.25)
        llm.reset_prefix_cache()
        _, o2 = gen([p], sixteen)
        out["lengths"][str(n)] = {"seconds": t1, "cached_tokens": o1[0].num_cached_tokens,
                                  "first_token": list(o1[0].outputs[0].token_ids),
                                  "tokens16": list(o2[0].outputs[0].token_ids)}
    time.sleep(2)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return out


def run_phase(a, name: str, tier: str, root: str, model: str, lengths: list[int], eager: bool) -> dict:
    cmd = [sys.executable, __file__, "--phase", name, "--tier", tier, "--root", root, "--model", model,
           "--lengths", ",".join(map(str, lengths)), "--cpu-bytes", str(a.cpu_bytes)] + (["--eager"] if eager else [])
    env = dict(os.environ, PYTHONHASHSEED="0")
    if name == "hit":  # both tiers write through the page cache: read the disk, not memory
        try:
            subprocess.run(["sync"], check=False)
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        except OSError:
            pass
    res, err = run_case(cmd, timeout=a.timeout, marker="PHASE", env=env)
    res["tier_refusals"] = err.count("failed its check")
    print(f"{tier} {name}: {res['wall_s']:.0f}s {'ERROR' if 'error' in res else 'ok'}", flush=True)
    return res


def damage(root: str) -> int:
    """Flip one byte in every chunk tutti's tier stored (through its journal's slots)."""
    from tutti.store.journal import Journal
    from tutti.store.chunk_store import JOURNAL

    flipped = 0
    for ns in glob.glob(os.path.join(root, "tutti-*")):
        with open(os.path.join(ns, "manifest.json")) as f:
            m = json.load(f)
        j = Journal(os.path.join(ns, JOURNAL), writer=False)
        for slot in j.entries:
            local = slot  # one root
            path = os.path.join(ns, f"slab-{local // m['slots_per_slab']}.bin")
            off = (local % m["slots_per_slab"]) * m["slot_bytes"] + random.Random(slot).randrange(m["segment_bytes"] // 2)
            with open(path, "r+b") as f:
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x5A]))
            flipped += 1
    return flipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/tier")
    ap.add_argument("--phase", default="")
    ap.add_argument("--tier", default="tutti")
    ap.add_argument("--root", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--lengths", default="32768")
    ap.add_argument("--cpu-bytes", type=int, default=16 << 30)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--timeout", type=int, default=200)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-proof", action="store_true")
    ap.add_argument("--disk", default="/tmp/tier-disk")
    ap.add_argument("--tiny-bench", action="store_true", help="the bench on the tiny model (a CPU smoke run)")
    ap.add_argument("--bench-tiers", default="none,fs,tutti,connector",
                    help="none: no connector (recompute); fs: vLLM's fs tier; tutti: TuttiTier; "
                    "connector: TuttiConnectorV1 (all on --disk)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    if a.phase:
        emit(phase(a), "PHASE")
        return
    import shutil

    from vllm_ttft import make_model

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.disk, exist_ok=True)  # tutti creates its root, never the root's parent
    report: dict = {}
    if not a.skip_proof:
        tiny = make_model(os.path.join(a.out, "tiny"), True)
        root = os.path.join(a.disk, "proof")
        shutil.rmtree(root, ignore_errors=True)
        s = run_phase(a, "store", "tutti", root, tiny, [2048], True)
        h = run_phase(a, "hit", "tutti", root, tiny, [2048], True)
        flipped = damage(root)
        c = run_phase(a, "hit", "tutti", root, tiny, [2048], True)
        report["proof"] = {"store": s, "hit": h, "damaged_chunks": flipped, "hit_after_damage": c}
        ok = all("error" not in r for r in (s, h, c))
        if ok:
            d0, d1, d2 = (r["lengths"]["2048"] for r in (s, h, c))
            report["proof"]["verdict"] = {
                "hit_cached_tokens": d1["cached_tokens"], "tokens_equal": d1["tokens16"] == d0["tokens16"]
                and d1["first_token"] == d0["first_token"],
                "after_damage_cached_tokens": d2["cached_tokens"], "after_damage_refusals": c["tier_refusals"],
                "after_damage_tokens_equal": d2["tokens16"] == d0["tokens16"] and d2["first_token"] == d0["first_token"]}
        print(json.dumps(report["proof"].get("verdict")), flush=True)
        with open(os.path.join(a.out, "tier.json"), "w") as f:
            json.dump(report, f, indent=1)
    if not a.skip_bench:
        model = make_model(os.path.join(a.out, "model8b"), a.tiny_bench, "8b")
        report["bench"] = {}
        for tier in a.bench_tiers.split(","):
            root = os.path.join(a.disk, tier)
            shutil.rmtree(root, ignore_errors=True)
            # no connector stores nothing: its one (fresh-process) run is the recompute baseline
            s = {"skipped": True} if tier == "none" else run_phase(a, "store", tier, root, model, a.lengths, False)
            h = run_phase(a, "hit", tier, root, model, a.lengths, False)
            report["bench"][tier] = {"store": s, "hit": h}
            with open(os.path.join(a.out, "tier.json"), "w") as f:
                json.dump(report, f, indent=1)
            shutil.rmtree(root, ignore_errors=True)
        rows = []
        base = report["bench"].get("none", {}).get("hit", {})
        for n in a.lengths:
            for tier, r in report["bench"].items():
                if "error" in r["store"] or "error" in r["hit"]:
                    rows.append(f"| {n} | {tier} | ERROR | | | |")
                    continue
                hi = r["hit"]["lengths"][str(n)]
                st = r["store"]["lengths"][str(n)] if "lengths" in r["store"] else {"seconds": float("nan"),
                                                                                   "tokens16": hi["tokens16"]}
                rec = base.get("lengths", {}).get(str(n))
                vs = f"{hi['seconds'] / rec['seconds']:.2f}x" if rec else "n/a"
                same = hi["tokens16"] == (rec or st)["tokens16"]
                rows.append(f"| {n} | {tier} | {st['seconds']:.3f} | {hi['seconds']:.3f} | {vs} | "
                            f"{hi['cached_tokens']} | {same} |")
        md = ("| prompt | case (disk) | first prefill, storing (s) | fresh process (s) | / recompute (none) | "
              "cached tokens | tokens equal recompute |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
        report["markdown"] = md
        print(md)
    with open(os.path.join(a.out, "tier.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
