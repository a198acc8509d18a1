"""Hits a full store keeps: the real Planner and ChunkIndex replaying a prefix-repetition workload.

No IO and no vLLM: every request is matched, its blocks allocated, its step built and its stores
reported done, in the order a client sends them; what is measured is how many prompt tokens the
store serves when it holds only part of the prefixes (a count, not a time, so the same on any
machine). It is the workload of `bench/serve_workload.py` (prefixes of `--prefix-len` tokens,
each sent `--repeats` times with its own suffix, in a seeded shuffled order; here the prefixes'
lengths vary from `--min-prefix-len`, so evictions end inside prefixes), with vLLM's own
prefix cache left out. Run it at two commits to compare eviction behaviour:

    python3 bench/eviction_sim.py [--capacities 0.25,0.5,0.75] [--num-prefixes 48]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tutti.engine.keys import namespace_seed  # noqa: E402
from tutti.engine.plan import WorkerReport  # noqa: E402
from tutti.engine.sched.planner import Planner  # noqa: E402


def run(a, capacity_fraction: float, seed: int) -> dict:
    rng = random.Random(seed)
    chunks_per_prefix = a.prefix_len // a.chunk_tokens
    # prefixes of --min-prefix-len to --prefix-len tokens (whole chunks): evictions then end inside
    # prefixes, where which end goes first decides whether the rest can still be hit
    lo = max(1, a.min_prefix_len // a.chunk_tokens) if a.min_prefix_len else chunks_per_prefix
    lengths = [rng.randint(lo, chunks_per_prefix) * a.chunk_tokens for _ in range(a.num_prefixes)]
    prefixes = [[rng.randrange(10, 30000) for _ in range(n)] for n in lengths]
    if a.workload == "multi_turn":  # each prefix a conversation: every turn sends all before it plus a turn
        convs = [list(pf) for pf in prefixes]
        requests = []
        for _ in range(a.repeats):
            live = list(range(a.num_prefixes))
            rng.shuffle(live)
            for i in live:
                convs[i] = convs[i] + [rng.randrange(10, 30000) for _ in range(a.turn_len)]
                requests.append(list(convs[i]))
        best = sum(len(r) // a.chunk_tokens * a.chunk_tokens for r in requests) - sum(lengths) - a.num_prefixes * a.turn_len
    else:
        order = [i for i in range(a.num_prefixes) for _ in range(a.repeats)]
        rng.shuffle(order)
        requests = [prefixes[i] + [rng.randrange(10, 30000) for _ in range(a.suffix_len)] for i in order]
        best = (a.repeats - 1) * sum(lengths)  # every repeat served whole
    # the capacity as a fraction of the workload's distinct chunks (multi_turn: the conversations' last turns)
    working = sum(len(c) for c in convs) if a.workload == "multi_turn" else sum(lengths)
    num_slots = max(1, int(capacity_fraction * working // a.chunk_tokens))
    p = Planner(num_slots=num_slots, chunk_tokens=a.chunk_tokens, block_size=16, seed=namespace_seed("sim"),
                num_workers=1, slot_bytes=4096)
    hit = queried = 0
    for n, tokens in enumerate(requests):
        req = f"r{n}"
        got = p.match(req, tokens, 0)
        hit += got
        queried += len(tokens)
        blocks = list(range(-(-len(tokens) // 16)))
        p.on_alloc(req, blocks, got)
        p.update_request(req, tokens=tokens, all_block_ids=blocks)
        plan = p.build_step({req: len(tokens) - got}, {req: got})
        p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores], steps_done=[plan.step]))
        p.finished(req)
    return {"workload": a.workload, "capacity_fraction": capacity_fraction, "slots": num_slots, "seed": seed, "hit_tokens": hit,
            "of_repeats": round(hit / best, 3), "evictions": p.index.evictions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="prefix_repetition", choices=["prefix_repetition", "multi_turn"])
    ap.add_argument("--turn-len", type=int, default=512, help="multi_turn: tokens a turn adds")
    ap.add_argument("--capacities", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--num-prefixes", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--min-prefix-len", type=int, default=256, help="prefix lengths vary from this to --prefix-len")
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = [run(a, float(c), int(s)) for c in a.capacities.split(",") for s in a.seeds.split(",")]
    for r in rows:
        print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
