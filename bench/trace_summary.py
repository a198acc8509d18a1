"""What a window of a loaded server's GPU did: a torch profiler trace, summarised.

Why: under `vllm serve` tutti's decode is slower than the OffloadingConnector's (results/serve.md:
TPOT 6.3-7.1 against 5.7-6.5 ms over a dozen commands) and nothing on the host side explains it
(`bench/hook_cost.py`, the GIL samples). A trace of the same window of both servers says whether
the compute stream waits between its kernels (the host is late: hooks, the GIL) or runs longer
kernels (the GPU is shared: tutti's kernels and copies beside the forward).

    python3 bench/trace_summary.py TRACE.pt.trace.json.gz [...]   # one JSON summary per trace

`bench/serve_workload.py --profile-steps N` takes the traces (vLLM's `--profiler-config`, started
and stopped around the client's run) and puts each server's summary in its results.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import re

TUTTI_KERNELS = ("_paged_copy_kernel", "_checksum_kernel")  # tutti/kernels: gather/scatter, checksums
GAP_US = (50.0, 1000.0)  # compute-stream idle gaps counted above these


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        data = json.load(f)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


STEP_NAME = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")


def batch_summary(gsteps: list[dict]) -> dict:
    """What the steps carried: requests running per step (weighted by each step's time on the
    GPU), prompts prefilled and tokens decoded per ms of steps. Why: two servers whose steps are
    equally long and busy still serve at different rates when one holds fewer requests in its
    batch (the rest wait outside it, e.g. for asynchronous loads): results/serve.md,
    serve/2026-12-03_profile_pair.json."""
    span = running = 0.0
    prefills = prefill_tokens = decoded = 0
    for st in gsteps:
        m = STEP_NAME.match(str(st.get("name", "")))
        if not m:
            continue
        n_ctx, ctx_tokens, n_gen = int(m.group(1)), int(m.group(2)), int(m.group(3))
        span += st["dur"]
        running += (n_ctx + n_gen) * st["dur"]
        prefills += n_ctx
        prefill_tokens += ctx_tokens
        decoded += n_gen
    if not span:
        return {}
    return {"running_mean": round(running / span, 3), "prefill_requests": prefills, "prefill_tokens": prefill_tokens,
            "decode_tokens": decoded, "decode_tokens_per_ms": round(decoded / (span / 1e3), 4)}


def summarize(events: list[dict]) -> dict:
    """GPU time by stream, the compute stream's idle gaps, tutti's kernels, copies by direction, and
    the CPU's step annotations (vLLM's `execute_*` ranges) over the trace's GPU window."""
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    gpu = [e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    out: dict = {"gpu_events": len(gpu)}
    if gpu:
        t0 = min(e["ts"] for e in gpu)
        t1 = max(e["ts"] + e["dur"] for e in gpu)
        out["window_ms"] = round((t1 - t0) / 1e3, 3)
    streams: dict = collections.defaultdict(lambda: {"busy_us": 0.0, "kernels": 0, "names": collections.Counter()})
    for e in gpu:
        if e.get("cat") != "kernel":
            continue
        s = streams[(e.get("pid"), e.get("tid"))]
        s["busy_us"] += e["dur"]
        s["kernels"] += 1
        s["names"][str(e.get("name", ""))[:60]] += e["dur"]
    ranked = sorted(streams.items(), key=lambda kv: -kv[1]["busy_us"])
    out["streams"] = [{"stream": str(k[1]), "busy_ms": round(v["busy_us"] / 1e3, 3), "kernels": v["kernels"],
                       "top": [[n, round(us / 1e3, 3)] for n, us in v["names"].most_common(4)]}
                      for k, v in ranked[:6]]
    if ranked:
        key = ranked[0][0]  # the compute stream: the busiest
        ks = sorted((e for e in gpu if e.get("cat") == "kernel" and (e.get("pid"), e.get("tid")) == key),
                    key=lambda e: e["ts"])
        gaps = [max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(ks, ks[1:])]
        span = (ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]) if ks else 0.0
        out["compute"] = {"span_ms": round(span / 1e3, 3), "busy_ms": round(ranked[0][1]["busy_us"] / 1e3, 3),
                          "busy_fraction": round(ranked[0][1]["busy_us"] / span, 4) if span else None,
                          "idle_ms": round(sum(gaps) / 1e3, 3)}
        for lim in GAP_US:
            big = [g for g in gaps if g > lim]
            out["compute"][f"gaps_over_{int(lim)}us"] = {"n": len(big), "ms": round(sum(big) / 1e3, 3)}
        # where the compute stream waits: idle time by the kernels on either side (a step's start,
        # an eager attention layer between graph pieces, ...), to compare servers phase by phase
        cs = sorted((e for e in gpu if (e.get("pid"), e.get("tid")) == key), key=lambda e: e["ts"])
        pairs: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for a, b in zip(cs, cs[1:]):
            g = b["ts"] - (a["ts"] + a["dur"])
            if g > 20:
                k = (str(a.get("name", ""))[:45], str(b.get("name", ""))[:45])
                pairs[k] += g
                count[k] += 1
        out["compute"]["idle_by_neighbours"] = [[a, b, count[(a, b)], round(us / 1e3, 3)]
                                                for (a, b), us in pairs.most_common(8)]
    # the host's CUDA calls by thread: the engine's thread (the most calls) and tutti's; a launch that
    # blocks for milliseconds (a kernel's module loaded on first use, a full queue) stalls every thread
    rt = [e for e in spans if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    corr = {(e.get("args") or {}).get("correlation"): e for e in gpu if (e.get("args") or {}).get("correlation")}
    threads: dict = collections.defaultdict(collections.Counter)
    for e in rt:
        threads[e.get("tid")][str(e.get("name"))] += e["dur"]
    out["host_threads"] = [{"tid": str(t), "cuda_ms": round(sum(c.values()) / 1e3, 3),
                            "top": [[n, round(us / 1e3, 3)] for n, us in c.most_common(3)]}
                           for t, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))[:6]]
    slow = sorted((e for e in rt if e["dur"] > 2000 and "Synchronize" not in str(e.get("name"))),
                  key=lambda e: -e["dur"])[:10]
    out["slow_launches"] = [[str(e.get("tid")), str(e.get("name")), round(e["dur"] / 1e3, 3),
                             str(corr.get((e.get("args") or {}).get("correlation"), {}).get("name", ""))[:70]]
                            for e in slow]
    tk = [e for e in gpu if e.get("cat") == "kernel" and any(n in str(e.get("name", "")) for n in TUTTI_KERNELS)]
    out["tutti_kernels"] = {"n": len(tk), "ms": round(sum(e["dur"] for e in tk) / 1e3, 3),
                            "streams": sorted({str(e.get("tid")) for e in tk})}
    copies: dict = collections.defaultdict(lambda: {"n": 0, "ms": 0.0, "GB": 0.0})
    for e in gpu:
        if e.get("cat") != "gpu_memcpy":
            continue
        name = str(e.get("name", ""))
        kind = next((k for k in ("HtoD", "DtoH", "DtoD", "HtoH") if k in name), "other")
        c = copies[kind]
        c["n"] += 1
        c["ms"] += e["dur"] / 1e3
        c["GB"] += float((e.get("args") or {}).get("bytes", 0)) / 1e9
    out["copies"] = {k: {"n": v["n"], "ms": round(v["ms"], 3), "GB": round(v["GB"], 3)} for k, v in copies.items()}
    # the steps on the GPU's timeline (vLLM's `execute_context_C(tokens)_generation_G(tokens)`):
    # decode-only steps (no context) against steps that also prefill, and how busy the compute
    # stream was inside each kind
    gsteps = [e for e in spans if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("execute_")]
    if gsteps and ranked:
        key = ranked[0][0]
        ks = sorted((e for e in gpu if e.get("cat") == "kernel" and (e.get("pid"), e.get("tid")) == key),
                    key=lambda e: e["ts"])
        starts = [e["ts"] for e in ks]
        kinds: dict = collections.defaultdict(lambda: {"n": 0, "span_us": 0.0, "busy_us": 0.0})
        for st in gsteps:
            kind = "decode" if str(st["name"]).startswith("execute_context_0(") else "prefill+decode"
            a, b = st["ts"], st["ts"] + st["dur"]
            busy = 0.0
            for k in ks[bisect.bisect_left(starts, a):bisect.bisect_right(starts, b)]:
                busy += max(0.0, min(b, k["ts"] + k["dur"]) - k["ts"])
            kinds[kind]["n"] += 1
            kinds[kind]["span_us"] += st["dur"]
            kinds[kind]["busy_us"] += busy
        out["gpu_steps"] = {k: {"n": v["n"], "mean_ms": round(v["span_us"] / v["n"] / 1e3, 3),
                                "busy_fraction": round(v["busy_us"] / v["span_us"], 4) if v["span_us"] else None}
                            for k, v in kinds.items()}
        out["batch"] = batch_summary(gsteps)
    steps = [e for e in spans if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("execute_")]
    if steps:
        durs = sorted(e["dur"] for e in steps)
        out["steps"] = {"n": len(steps), "mean_ms": round(sum(durs) / len(durs) / 1e3, 3),
                        "p50_ms": round(durs[len(durs) // 2] / 1e3, 3)}
    return out


def find_traces(root: str) -> list[str]:
    found = []
    for d, _, files in os.walk(root):
        found += [os.path.join(d, f) for f in files if ".pt.trace.json" in f]
    return sorted(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args()
    for p in a.traces:
        print(json.dumps({"trace": p, **summarize(load_events(p))}))


if __name__ == "__main__":
    main()
