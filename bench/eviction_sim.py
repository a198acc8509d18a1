"""Hits a full store keeps: the real Planner and ChunkIndex replaying a prefix-repetition workload.

No IO and no vLLM: every request is matched, its blocks allocated, its step built and its stores
reported done, in the order a client sends them; what is measured is how many prompt tokens the
store serves when it holds only part of the prefixes (a count, not a time, so the same on any
machine). It is the workload of `bench/serve_workload.py` (prefixes of `--prefix-len` tokens,
each sent `--repeats` times with its own suffix, in a seeded shuffled order; here the prefixes'
lengths vary from `--min-prefix-len`, so evictions end inside prefixes), with vLLM's own
prefix cache left out. Run it at two commits to compare eviction behaviour:

    python3 bench/eviction_sim.py [--capacities 0.25,0.5,0.75] [--num-prefixes 48]

or compare policies at one commit, on uniform or Zipf-skewed prefix popularity, with the working
set 0.5x-4x of the store's capacity; each policy is an eviction policy, optionally "+" a store
admission policy, and the table gives each one's hit tokens (summed over the seeds) and its ratio
to LRU's:

    python3 bench/eviction_sim.py --popularity zipf --zipf-s 1.0 --working-sets 0.5,1,2,4 \
        --policies lru,fifo,lfuda,lru+seen_twice,lfuda+seen_twice,opt

"opt" is not a policy but the ceiling: Belady's MIN, which knows the future (`belady`).

`--popularity uniform` (the default) sends every prefix `--repeats` times in a shuffled order;
`zipf` draws `--num-prefixes x --repeats` requests, prefix k (from 1) with weight 1/k^s, so a
few prefixes carry most requests and a long tail is sent once or never. `--one-off-share` mixes
in prompts sent once (a scan), each with a prefix no other request shares.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tutti.engine.keys import namespace_seed  # noqa: E402
from tutti.engine.plan import WorkerReport  # noqa: E402
from tutti.engine.sched.admission import get_admission  # noqa: E402
from tutti.engine.sched.eviction import get_eviction  # noqa: E402
from tutti.engine.sched.planner import Planner  # noqa: E402


def zipf_order(rng: random.Random, n: int, draws: int, s: float) -> list[int]:
    """`draws` prefix indices, index k drawn with weight 1/(k+1)^s."""
    return rng.choices(range(n), weights=[1.0 / (k + 1) ** s for k in range(n)], k=draws)


def run(a, capacity_fraction: float, seed: int, policy: str = "lru") -> dict:
    rng = random.Random(seed)
    popularity = getattr(a, "popularity", "uniform")
    one_off = getattr(a, "one_off_share", 0.0)
    working_of = getattr(a, "working_set_of", "repeated")
    chunks_per_prefix = a.prefix_len // a.chunk_tokens
    # prefixes of --min-prefix-len to --prefix-len tokens (whole chunks): evictions then end inside
    # prefixes, where which end goes first decides whether the rest can still be hit
    lo = max(1, a.min_prefix_len // a.chunk_tokens) if a.min_prefix_len else chunks_per_prefix
    lengths = [rng.randint(lo, chunks_per_prefix) * a.chunk_tokens for _ in range(a.num_prefixes)]
    prefixes = [[rng.randrange(10, 30000) for _ in range(n)] for n in lengths]
    if a.workload == "multi_turn" and popularity == "zipf":  # which conversation takes the next turn: skewed
        convs = [list(pf) for pf in prefixes]
        requests, best, seen, turns = [], 0, {}, Counter()
        for i in zipf_order(rng, a.num_prefixes, a.num_prefixes * a.repeats, a.zipf_s):
            best += seen.get(i, 0)  # every token of its previous turn, in whole chunks
            convs[i] = convs[i] + [rng.randrange(10, 30000) for _ in range(a.turn_len)]
            requests.append(list(convs[i]))
            seen[i] = len(convs[i]) // a.chunk_tokens * a.chunk_tokens
            turns[i] += 1
        drawn = {i for i in turns if turns[i] > 1} if working_of == "repeated" else set(turns)
    elif a.workload == "multi_turn":  # each prefix a conversation: every turn sends all before it plus a turn
        convs = [list(pf) for pf in prefixes]
        requests = []
        for _ in range(a.repeats):
            live = list(range(a.num_prefixes))
            rng.shuffle(live)
            for i in live:
                convs[i] = convs[i] + [rng.randrange(10, 30000) for _ in range(a.turn_len)]
                requests.append(list(convs[i]))
        best = sum(len(r) // a.chunk_tokens * a.chunk_tokens for r in requests) - sum(lengths) - a.num_prefixes * a.turn_len
        drawn = set(range(a.num_prefixes))
    else:
        if popularity == "zipf":
            order = zipf_order(rng, a.num_prefixes, a.num_prefixes * a.repeats, a.zipf_s)
        else:
            order = [i for i in range(a.num_prefixes) for _ in range(a.repeats)]
            rng.shuffle(order)
        requests = [prefixes[i] + [rng.randrange(10, 30000) for _ in range(a.suffix_len)] for i in order]
        best = sum(lengths[i] for i in order) - sum(lengths[i] for i in set(order))  # every repeat served whole
        times = Counter(order)
        drawn = {i for i in times if times[i] > 1} if working_of == "repeated" else set(times)
    # the capacity as a fraction of the workload's distinct chunks (multi_turn: the conversations' last
    # turns): by default of the prefixes sent more than once, what a store must hold to serve every
    # repeat (uniform: every prefix); `--working-set-of sent` counts every prefix sent at least once
    # (Zipf's tail sent once included; one-off prompts never are)
    working = sum(len(convs[i]) for i in drawn) if a.workload == "multi_turn" else sum(lengths[i] for i in drawn)
    num_slots = max(1, int(capacity_fraction * working // a.chunk_tokens))
    if one_off:  # prompts nobody sends again, spread evenly: what a scan-resistant policy must not keep
        n_scan = round(len(requests) * one_off / (1 - one_off))
        for _ in range(n_scan):
            n = rng.randint(lo, chunks_per_prefix) * a.chunk_tokens + a.suffix_len
            requests.insert(rng.randrange(len(requests) + 1), [rng.randrange(30000, 60000) for _ in range(n)])
    if policy == "opt":
        return _row(a, capacity_fraction, seed, policy, popularity, working_of, one_off, num_slots,
                    *belady(requests, a.chunk_tokens, num_slots), best)
    evict, _, admit = policy.partition("+")
    p = Planner(num_slots=num_slots, chunk_tokens=a.chunk_tokens, block_size=16, seed=namespace_seed("sim"),
                num_workers=1, slot_bytes=4096, eviction=get_eviction(evict),
                admission=get_admission(admit) if admit else None)
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
    return _row(a, capacity_fraction, seed, policy, popularity, working_of, one_off, num_slots, hit,
                p.index.evictions, p.stats.stores_committed, p.stats.stores_declined, best)


def _row(a, capacity_fraction, seed, policy, popularity, working_of, one_off, num_slots, hit, evictions,
         committed, declined, best) -> dict:
    return {"workload": a.workload, "capacity_fraction": capacity_fraction, "slots": num_slots, "seed": seed, "hit_tokens": hit,
            "of_repeats": round(hit / best, 3), "evictions": evictions, "policy": policy,
            "popularity": popularity if popularity == "uniform" else f"zipf{a.zipf_s:g}",
            "working_set": round(1 / capacity_fraction, 3), "working_set_of": working_of, "one_off_share": one_off,
            "stores_committed": committed, "stores_declined": declined}


def belady(requests: list[list[int]], chunk_tokens: int, num_slots: int) -> tuple[int, int, int, int]:
    """The ceiling no online policy passes: Belady's MIN with bypass over the same requests' chunks
    (it knows every future request; it evicts the chunk used again farthest ahead, and stores a
    computed chunk only if it is used again before every resident one). MIN maximises chunk hits;
    a prefix hit also needs every chunk before it, so the prefix hits any policy gets (tutti's
    included) are at most MIN's chunk hits, which this returns as hit tokens, with evictions,
    stores and stores bypassed. A chunk's identity is its whole prefix, as in tutti.engine.keys."""
    import heapq

    seqs = []
    for tokens in requests:
        keys, h = [], 0
        for j in range((len(tokens) - 1) // chunk_tokens):  # the chunks match() looks up: never the last token's
            h = hash((h, tuple(tokens[j * chunk_tokens:(j + 1) * chunk_tokens])))
            keys.append(h)
        seqs.append(keys)
    flat = [k for keys in seqs for k in keys]
    nxt, last = [0] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = last.get(flat[i], 1 << 62)
        last[flat[i]] = i
    resident: dict[int, int] = {}  # key -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, key), stale entries skipped
    hits = evictions = stores = bypassed = 0
    for i, k in enumerate(flat):
        if k in resident:
            hits += 1
        elif nxt[i] >= 1 << 62:
            bypassed += 1
            continue
        elif len(resident) < num_slots:
            stores += 1
        else:
            while -heap[0][0] != resident.get(heap[0][1]):
                heapq.heappop(heap)
            if -heap[0][0] <= nxt[i]:  # every resident is used again sooner: do not store this one
                bypassed += 1
                continue
            del resident[heapq.heappop(heap)[1]]
            evictions += 1
            stores += 1
        resident[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return hits * chunk_tokens, evictions, stores, bypassed


def table(rows: list[dict]) -> str:
    """Hit tokens summed over the seeds, per policy and working set / capacity, and the ratio to
    LRU's (the policy named "lru", else the first one)."""
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    base = "lru" if "lru" in policies else policies[0]
    cases = list(dict.fromkeys((r["workload"], r["popularity"], r["one_off_share"], r.get("working_set_of", "repeated"),
                                r["working_set"]) for r in rows))
    total = {}
    for r in rows:
        key = (r["policy"], r["workload"], r["popularity"], r["one_off_share"], r.get("working_set_of", "repeated"),
               r["working_set"])
        total[key] = total.get(key, 0) + r["hit_tokens"]
    out = ["| workload | popularity | one-off share | working set of | working set / capacity | policy | hit tokens | x "
           + base + " |", "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        ref = total.get((base, *case), 0)
        for pol in policies:
            got = total.get((pol, *case))
            if got is None:
                continue
            ratio = f"{got / ref:.2f}" if ref else "-"
            out.append(f"| {case[0]} | {case[1]} | {case[2]:g} | {case[3]} | {case[4]:g}x | {pol} | {got} | {ratio} |")
    return "\n".join(out)


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
    ap.add_argument("--popularity", default="uniform", choices=["uniform", "zipf"])
    ap.add_argument("--zipf-s", type=float, default=1.0, help="zipf: prefix k (from 1) drawn with weight 1/k^s")
    ap.add_argument("--working-sets", default="",
                    help="working set / capacity, e.g. 0.5,1,2,4 (replaces --capacities: capacity = 1/x)")
    ap.add_argument("--working-set-of", default="repeated", choices=["repeated", "sent"],
                    help="the working set: the prefixes sent more than once (what serves every repeat) or every one sent")
    ap.add_argument("--one-off-share", type=float, default=0.0, help="share of requests that are one-off prompts")
    ap.add_argument("--policies", default="lru",
                    help="eviction policies, each optionally +admission (e.g. lru,lfuda,lru+seen_twice)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not 0 <= a.one_off_share < 1:
        ap.error("--one-off-share must be in [0, 1)")
    fractions = [1 / float(x) for x in a.working_sets.split(",")] if a.working_sets else \
        [float(c) for c in a.capacities.split(",")]
    policies = a.policies.split(",")
    rows = [run(a, c, int(s), pol) for c in fractions for pol in policies for s in a.seeds.split(",")]
    for r in rows:
        print(json.dumps(r))
    if len(policies) > 1:
        print(table(rows))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
