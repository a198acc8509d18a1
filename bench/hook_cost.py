"""tutti's host time per step, hook by hook, on a real vLLM engine (the CPU build is enough).

Why: under vLLM's asynchronous scheduling the engine's thread prepares step t+1 while the GPU
runs step t; every microsecond tutti's hooks take there is margin the host no longer has, and on
a fast GPU's decode steps (5-6 ms on an H200) that margin is small. This times every
`TuttiConnectorV1` hook that vLLM calls (both halves, in one process), over decode-heavy steps
with nothing to load or store, and prints microseconds per step: the floor tutti costs a server.

    python3 bench/hook_cost.py                 # the best of 3 repeats, 300 steps each
    python3 bench/hook_cost.py --json out.json
    python3 bench/hook_cost.py --workload prefixes --tiers   # long prompts sent again: lookups,
                                                             # hits, stores, a RAM tier over a disk one

`--workload prefixes` is the serving benchmark's load in small: `--num-prefixes` prompts of
`--prefix-len` tokens each sent `--sends` times (a new suffix each time), `--requests` at a time,
vLLM's own cache held to `--gpu-blocks` blocks so that repeats reach tutti, chunks of
`--chunk-tokens`. It prints microseconds per step and per call, hook by hook: where the
scheduler's share of tutti's host time (`vllm:tutti_scheduler_hook_seconds`) goes.

Compare two commits in one sitting (the machine's speed drifts between sittings): run it at
each, alternating, and compare the totals.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "tests", "vllm")]

HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "update_connector_output",
         "request_finished", "take_events", "get_kv_connector_stats", "bind_connector_metadata", "start_load_kv",
         "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished", "get_transfer_results",
         "get_block_ids_with_load_errors", "build_connector_worker_meta", "clear_connector_metadata")


def instrument(cls, spent: collections.Counter, calls: collections.Counter) -> None:
    for name in HOOKS:
        fn = cls.__dict__.get(name) or getattr(cls, name, None)
        if fn is None:
            continue

        def wrap(fn=fn, name=name):
            @functools.wraps(fn)
            def timed(*a, **k):
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    spent[name] += time.perf_counter() - t
                    calls[name] += 1
            return timed

        setattr(cls, name, wrap())


def timed_engine():
    """The test harness, vLLM's TokensPrompt, and the time and calls each hook of TuttiConnectorV1
    takes from now on (both halves in this process, to be timed)."""
    import harness

    harness.set_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import TokensPrompt

    from tutti.vllm.connector import TuttiConnectorV1

    spent, calls = collections.Counter(), collections.Counter()
    instrument(TuttiConnectorV1, spent, calls)
    return harness, TokensPrompt, spent, calls


def timed_runs(a, llm, env, requests_of) -> list[dict]:
    """A warm-up request, then `--repeats` batches (`requests_of(rep)`, `--tokens` generated each):
    for each, its requests, wall seconds, engine steps, each hook's seconds (largest first) and
    calls, and what tutti served meanwhile (the planner's counters)."""
    harness, TokensPrompt, spent, calls = env
    llm.generate([TokensPrompt(prompt_token_ids=harness.prompt(7, 300))], harness.greedy(4), use_tqdm=False)
    stats = harness.connector(llm).planner.stats
    out = []
    for rep in range(a.repeats):
        spent.clear()
        calls.clear()
        before = stats.copy()
        reqs = requests_of(rep)
        t0 = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=r) for r in reqs], harness.greedy(a.tokens), use_tqdm=False)
        out.append({"requests": len(reqs), "wall_s": time.perf_counter() - t0,
                    "steps": max(1, calls["build_connector_meta"]), "spent": dict(spent.most_common()),
                    "calls": collections.Counter(calls), "served": stats.since(before)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=300, help="generated tokens per request (decode steps)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", choices=("decode", "prefixes"), default="decode")
    ap.add_argument("--num-prefixes", type=int, default=16)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--sends", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--gpu-blocks", type=int, default=512, help="vLLM's own KV cache, in blocks (prefixes workload)")
    ap.add_argument("--tiers", action="store_true", help="a RAM tier (a quarter of the prefixes) over a disk tier")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.workload == "prefixes":
        return prefixes(a)
    env = timed_engine()
    harness = env[0]
    work = tempfile.mkdtemp(prefix="tutti-hook-cost-")
    try:
        model = harness.make_tiny_model(os.path.join(work, "model"))
        kv = harness.kv_config(os.path.join(work, "root"), chunk=32, capacity="256MiB", hit_policy="auto")
        llm = harness.make_llm(model, kv_transfer_config=kv, max_num_seqs=a.requests)
        # prompts under one chunk: nothing is stored or loaded, every step is a quiet decode step
        raw = timed_runs(a, llm, env, lambda rep: [harness.prompt(500 + 10 * rep + i, 20) for i in range(a.requests)])
        runs = [{"steps": r["steps"], "us_per_step": round(sum(r["spent"].values()) / r["steps"] * 1e6, 1),
                 "hooks": {k: round(v / r["steps"] * 1e6, 1) for k, v in r["spent"].items()}} for r in raw]
        best = min(runs, key=lambda r: r["us_per_step"])
        print(f"tutti host time: {best['us_per_step']} us per step over {best['steps']} decode steps "
              f"(best of {a.repeats}: {[r['us_per_step'] for r in runs]})")
        for k, v in best["hooks"].items():
            print(f"  {k:32s} {v:7.1f} us")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"best": best, "runs": runs}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def prefixes(a) -> dict:
    """Long prompts sent again, `--requests` at a time: each hook's time per step and per call,
    and what tutti served (its stats' hit and stored counts over the runs)."""
    import random

    env = timed_engine()
    harness = env[0]
    work = tempfile.mkdtemp(prefix="tutti-hook-cost-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        max_len = a.prefix_len + a.suffix_len + a.tokens + 64
        model = harness.make_tiny_model(os.path.join(work, "model"), max_position=max_len)
        chunk_bytes = 2 * 2 * 128 * 4 * a.chunk_tokens  # the tiny model: 2 layers, K and V, hidden 128, fp32
        if a.tiers:
            ram = max(1, a.num_prefixes // 4) * (a.prefix_len // a.chunk_tokens) * chunk_bytes
            kv = harness.kv_config(os.path.join(work, "ram"), chunk=a.chunk_tokens, capacity=ram, hit_policy="auto")
            extra = kv["kv_connector_extra_config"]
            extra.pop("root"), extra.pop("capacity_bytes")
            extra["tiers"] = [{"root": os.path.join(work, "ram"), "capacity_bytes": ram},
                              {"root": os.path.join(work, "disk"), "capacity_bytes": "1GiB"}]
        else:
            kv = harness.kv_config(os.path.join(work, "root"), chunk=a.chunk_tokens, capacity="1GiB", hit_policy="auto")
        llm = harness.make_llm(model, kv_transfer_config=kv, max_num_seqs=a.requests, max_model_len=max_len,
                               max_num_batched_tokens=max(2048, a.chunk_tokens), num_gpu_blocks_override=a.gpu_blocks)

        def requests(rep: int) -> list[list[int]]:  # each prefix --sends times, shuffled, a new suffix each time
            heads = [harness.prompt(1000 * (rep + 1) + i, a.prefix_len) for i in range(a.num_prefixes)]
            order = [i for i in range(a.num_prefixes) for _ in range(a.sends)]
            random.Random(rep).shuffle(order)
            return [heads[i] + harness.prompt(10 ** 6 + 100 * rep + n, a.suffix_len) for n, i in enumerate(order)]

        runs = []
        for r in timed_runs(a, llm, env, requests):
            steps, spent, calls = r["steps"], r["spent"], r["calls"]
            runs.append({"steps": steps, "wall_s": round(r["wall_s"], 2), "requests": r["requests"],
                         "tutti": {k: r["served"].get(k, 0) for k in ("hit_tokens", "stores_committed", "stores_skipped")},
                         "us_per_step": round(sum(spent.values()) / steps * 1e6, 1),
                         "hooks": {k: {"us_per_step": round(v / steps * 1e6, 1), "calls": calls[k],
                                       "us_per_call": round(v / max(calls[k], 1) * 1e6, 1)}
                                   for k, v in spent.items()}})
        best = min(runs, key=lambda r: r["us_per_step"])
        print(f"tutti host time: {best['us_per_step']} us per step over {best['steps']} steps, {best['wall_s']} s "
              f"(best of {a.repeats}: {[r['us_per_step'] for r in runs]})")
        for k, v in best["hooks"].items():
            print(f"  {k:32s} {v['us_per_step']:8.1f} us a step  {v['calls']:6d} calls  {v['us_per_call']:8.1f} us a call")
        out = {"args": vars(a), "best": best, "runs": runs}
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        harness.shutdown_llm(llm)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
