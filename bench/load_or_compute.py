"""Load or compute: one request's hit against recomputing it, from a fresh server, on a disk root.

vLLM's default mode (torch.compile + CUDA graphs, asynchronous scheduling), the engine core in
this process so the planner can be reached (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), the step token
budget of `vllm serve` on an H200 (8192), weights re-seeded so that tokens depend on the KV
cache. Two processes per geometry, one engine each:

  store   the prompts' first prefill (stored), every store settled, the process ends
  (page cache dropped)
  hit     a fresh server: its start-up read probe measures the disk; one unrelated prompt
          (a server that has served something: its prefill rate is measured); then for each
          length, each with vLLM's prefix cache reset and the page cache dropped:
            auto     hit_policy auto (the default): what it chose, the time to the first token
            always   the whole hit loaded (tutti before load-or-compute)
            never    recomputed (the baseline of the same process)
          and 16 greedy tokens of each against the recompute's and against vLLM's own prefix
          cache holding the same prefix (the hit's compute shape: greedy tokens of seeded
          weights can flip with the shape, results/kv_proof.md; bytes are proven there)

    python3 bench/load_or_compute.py --out $OUT [--geometry 8b|70b] [--lengths 8192,32768]
    python3 bench/load_or_compute.py --out /tmp/loc --tiny        # the CPU smoke run
    python3 bench/load_or_compute.py --out $OUT --no-async-scheduling   # hits layer-wise, overlapped
    python3 bench/load_or_compute.py --out $OUT --no-async-scheduling --trace \
        --hit-extras '[{}, {"gil_switch_interval_s": 0.0005}]'   # an A/B of hit phases, per-layer timelines
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from subcase import emit, run_case  # noqa: E402
from vllm_ttft import bench_engine, hit_shape, make_model, prompt, timed_generate  # noqa: E402


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def kv_config(a) -> dict:
    extra = {"root": a.root, "capacity_bytes": a.capacity, "chunk_tokens": a.chunk_tokens,
             "hit_policy": "always"}
    extra.update(json.loads(a.tutti_extra))
    return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run_phase(phase: str, a) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from gpu_kv_proof import rpc_reseed

    from tutti.tools.demo import on_cuda
    from tutti.engine.sched.hit_policy import Always, CostModel, Never
    from tutti.vllm import internals

    if a.trace:
        os.environ["TUTTI_TRACE"] = "1"  # read when the worker is built (in this process)
    t0 = time.time()

    def progress(what: str) -> None:  # kept by the driver also when the phase runs out of time
        print(f"LOC_PROGRESS {phase} {time.time() - t0:.1f}s {what}", file=sys.stderr, flush=True)

    llm = bench_engine(a.model, kv_config(a), max_len=max(a.lengths) + 512, gpu_mem=a.gpu_mem, eager=a.tiny,
                       batched_tokens=a.batched_tokens, async_scheduling=False if a.no_async_scheduling else None)
    res: dict = {"phase": phase, "engine_start_s": round(time.time() - t0, 1),
                 "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
                 "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)}
    progress("engine started")
    if on_cuda():
        res["reseeded_tensors"] = llm.collective_rpc(rpc_reseed, args=(1234, "plain"))[0]
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen, one, sixteen = timed_generate(llm)
    conn = internals.engine_connector(llm)
    planner = conn.planner

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    res["async_loads"] = bool(planner.asynchronous)  # every hit asynchronously (else layer-wise, budgeted)
    res["sync_load_budget"] = planner.sync_budget if planner.can_load_async else None
    res["probe"] = {"bytes": worker.probe[0], "seconds": round(worker.probe[1], 4)}
    prompts = {n: prompt(n, n, vocab) for n in a.lengths}
    if phase == "store":
        gen([prompt(998, 64, vocab)], one)  # warm-up, shorter than a chunk
        for n, p in prompts.items():
            llm.reset_prefix_cache()
            t, o = gen([p], sixteen)
            res[f"first_{n}"] = {"s": round(t, 4), "tokens16": list(o[0].outputs[0].token_ids)}
            progress(f"first prefill of {n} tokens: {t:.3f} s")
        worker.flush()
        progress("stores settled")
        for _ in range(3):  # deliver the stores' reports to the scheduler
            gen([prompt(999, 16, vocab)], one)
            time.sleep(0.2)
        res["stats"] = dict(vars(planner.stats))
        return res
    # the hit phase: a server that has served one prompt (its prefill rate measured)
    # a prompt no earlier hit phase stored (each phase measures the prefill rate by computing it)
    gen([prompt(4241 + a.phase_index, min(4096, max(a.lengths)), vocab)], one)
    rates0 = {"load_GBps": planner.meter.load_rate and round(planner.meter.load_rate / 1e9, 3),
              "prefill_tok_s": planner.meter.prefill_rate and round(planner.meter.prefill_rate)}
    res["rates_before_hits"] = rates0
    class AutoNoExtra(CostModel):
        """auto as it was before it learned what layer-wise steps take beyond max(reads, compute)."""

        def decide(self, q, rates):
            return super().decide(q, dataclasses.replace(rates, layerwise_extra_s=0.0))

    policies = {"auto": CostModel(), "always": Always(), "never": Never(), "auto_noextra": AutoNoExtra()}
    rec = None
    if a.py_spy:  # who holds the GIL in this process (the step's thread, tutti's IO and load threads) during the hits
        from gil_profile import GilRecorder, find_py_spy

        rec = GilRecorder.start(find_py_spy(a.py_spy), os.getpid(), os.path.join(a.out, f"gil_hits_{a.geometry}.txt"))
    for n, p in prompts.items():
        for name in a.policies.split(","):
            planner.hit_policy = policies[name]
            for rep in range(a.repeats):
                llm.reset_prefix_cache()
                res.setdefault("dropped_caches", drop_caches())
                before = planner.stats.copy()
                if worker.trace is not None:
                    worker.trace.clear()
                t, o = gen([p], one)
                d = planner.stats.since(before)
                timeline = layer_timeline(worker) if worker.trace is not None else None
                llm.reset_prefix_cache()
                drop_caches()
                before16 = planner.stats.copy()
                _, o16 = gen([p], sixteen)
                m16 = int(planner.stats.since(before16)["hit_tokens"])
                r = res.setdefault(f"{name}_{n}", {"s": [], "loaded_tokens": [], "declined_tokens": []})
                r["s"].append(round(t, 4))
                progress(f"{name} {n}: {t:.3f} s, {int(d['hit_tokens'])} tokens loaded")
                r["loaded_tokens"].append(int(d["hit_tokens"]))
                r["declined_tokens"].append(int(d["declined_hit_tokens"]))
                r["cached"] = o[0].num_cached_tokens
                r["tokens16"] = list(o16[0].outputs[0].token_ids)
                r["tokens16_loaded"] = m16  # the shape its tokens were computed in
                if timeline is not None:
                    r["timeline"] = timeline  # of the last repeat
                r["rates"] = {"load_GBps": planner.meter.load_rate and round(planner.meter.load_rate / 1e9, 3),
                              "prefill_tok_s": planner.meter.prefill_rate and round(planner.meter.prefill_rate),
                              "layerwise_extra_ms": round(1e3 * planner.meter.layerwise_extra_s, 1)}
        # the reference in each hit's shape: vLLM's own prefix cache holding the same prefix (its
        # KV from a prefill of the prefix alone) and the rest computed, as a loaded hit computes it;
        # greedy tokens of seeded weights can flip with the compute shape (results/kv_proof.md).
        # One per shape a policy's tokens were computed in (auto loads part of the hit), and the
        # full hit's shape.
        planner.hit_policy = policies["never"]
        shapes = {hit_shape(n, a.chunk_tokens)}
        shapes |= {res[f"{name}_{n}"]["tokens16_loaded"] for name in a.policies.split(",")
                   if res.get(f"{name}_{n}", {}).get("tokens16_loaded")}
        refs = res[f"vllm_prefix_cache_{n}"] = {}
        for m in sorted(shapes):
            llm.reset_prefix_cache()
            gen([p[:m]], one)
            _, o16 = gen([p], sixteen)
            refs[str(m)] = {"cached": o16[0].num_cached_tokens, "tokens16": list(o16[0].outputs[0].token_ids)}
    if rec is not None:
        res["gil"] = rec.stop()
    res["stats"] = dict(vars(planner.stats))
    return res


def layer_timeline(worker) -> dict:
    """Per layer of the last step that loaded, in ms after the load's start: on the host the first
    read submitted, the last read landed and the layer made ready (the forward past its wait); on
    CUDA the load stream's scatter done and the compute stream past the layer's wait. Where the
    compute waits on "loaded" the disk (or the host before it) is the step's bottleneck."""
    trace = list(worker.trace or ())
    starts = [i for i, (what, _, _) in enumerate(trace) if what == "start"]
    if not starts:
        return {}
    t0 = trace[starts[-1]][2]
    host: dict[int, dict[str, float]] = {}
    for what, layer, t in trace[starts[-1] + 1:]:
        if layer < 0:
            continue
        h = host.setdefault(layer, {})
        ms = round(1e3 * (t - t0), 3)
        if what == "read":
            h.setdefault("read", ms)  # the first
        else:
            h[what] = ms  # io_done: the last; ready: once
    gpu: dict[int, dict[str, float]] = {}
    for what, layer, ms in worker.loads.gpu_timeline():
        gpu.setdefault(layer, {})[what] = ms
    return {"host_ms": {str(k): v for k, v in sorted(host.items())}, "gpu_ms": {str(k): v for k, v in sorted(gpu.items())}}


def same_shape(r: dict, refs: dict) -> bool | None:
    """Do a policy's tokens equal vLLM's own prefix cache holding as many tokens as that policy
    loaded? None where nothing was loaded (recompute is then its own reference)."""
    m = r.get("tokens16_loaded")
    if not m:
        return None
    ref = refs.get(str(m))
    return ref is not None and r["tokens16"] == ref["tokens16"]


def summarize(store: dict, hit: dict, lengths, policies) -> list[dict]:
    rows = []
    for n in lengths:
        ref = store.get(f"first_{n}", {}).get("tokens16")
        never = hit.get(f"never_{n}", {})
        base = min(never["s"]) if never.get("s") else None
        for name in policies:
            r = hit.get(f"{name}_{n}")
            if not r:
                continue
            best = min(r["s"])
            rows.append({"tokens": n, "policy": name, "s": best, "x_recompute": base and round(best / base, 3),
                         "each_s": r["s"], "loaded": r["loaded_tokens"][-1], "each_loaded": r["loaded_tokens"],
                         "declined": r["declined_tokens"][-1],
                         "tokens_equal_recompute": r["tokens16"] == never.get("tokens16"),
                         "tokens_equal_vllm_prefix_cache_same_shape": same_shape(r, hit.get(f"vllm_prefix_cache_{n}", {})),
                         "tokens_equal_first_prefill": r["tokens16"] == ref})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", default="")
    ap.add_argument("--phase-index", type=int, default=1, help=argparse.SUPPRESS)  # the warm-up prompt's seed
    ap.add_argument("--out", default="/tmp/load_or_compute")
    ap.add_argument("--py-spy", default="", help="sample who holds the GIL in the hit phase's process during its hits "
                    "(py-spy --gil; 'auto' finds it on PATH or in .gpu_pytest/bin); off by default")
    ap.add_argument("--model", default="")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--geometry", default="8b", choices=("8b", "70b"))
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--root", default="/tmp/tutti-loc-disk")
    ap.add_argument("--capacity", default="24GiB")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens (vllm serve's on an H200)")
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--policies", default="auto,always,never",
                    help="of auto, always, never and auto_noextra (auto without the measured layer-wise extra)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tutti-extra", default="{}", help="more kv_connector_extra_config keys, as JSON")
    ap.add_argument("--timeout", type=int, default=280)
    ap.add_argument("--hit-extras", default="[{}]",
                    help="JSON list: one hit phase per entry (a fresh server each, same store), its keys merged "
                         "over --tutti-extra: an A/B of a knob on one machine's disk in one call, e.g. "
                         "'[{}, {\"gil_switch_interval_s\": 0.0005}]'")
    ap.add_argument("--trace", action="store_true",
                    help="TUTTI_TRACE in the hit phase: each policy's last hit keeps a per-layer timeline (host: "
                         "reads submitted, landed, layer ready; CUDA: scatter done, compute past its wait; ms)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="vLLM's synchronous scheduler: tutti's async_loads auto then loads hits layer-wise, "
                         "overlapped with the suffix's compute (the mode where a hit can beat recompute)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    if a.phase:
        emit(run_phase(a.phase, a), "PHASE_RESULT")
        return
    if a.py_spy:
        from gil_profile import find_py_spy

        if find_py_spy(a.py_spy) is None:
            raise SystemExit(f"--py-spy {a.py_spy!r}: no py-spy executable found; pip install py-spy, or "
                             "give its path, or leave --py-spy out")
    os.makedirs(a.out, exist_ok=True)
    if a.tiny:
        from tutti.tools.demo import make_tiny_model

        a.model = str(make_tiny_model(os.path.join(a.out, "tiny-model"), num_layers=4, vocab=4096,
                                      max_position=max(a.lengths) + 1024))
    else:
        a.model = make_model(os.path.join(a.out, "model"), False, a.geometry)
    shutil.rmtree(a.root, ignore_errors=True)
    out: dict = {"geometry": a.geometry, "lengths": a.lengths, "batched_tokens": a.batched_tokens,
                 "async_scheduling": not a.no_async_scheduling, "phases": {}}
    hit_extras = json.loads(a.hit_extras)
    if not isinstance(hit_extras, list) or not hit_extras or not all(isinstance(x, dict) for x in hit_extras):
        raise SystemExit(f"--hit-extras {a.hit_extras!r}: expected a JSON list of objects, e.g. '[{{}}]'")
    out["hit_extras"] = hit_extras
    phases = [("store", "store", {})] + [("hit", "hit" if i == 0 else f"hit_{i}", x) for i, x in enumerate(hit_extras)]
    for phase, name, extra in phases:
        if phase == "hit":
            out["dropped_caches"] = drop_caches()
        cmd = [sys.executable, __file__, "--phase", phase, "--model", a.model, "--root", a.root,
               "--capacity", a.capacity, "--lengths", ",".join(map(str, a.lengths)),
               "--chunk-tokens", str(a.chunk_tokens), "--batched-tokens", str(a.batched_tokens),
               "--gpu-mem", str(a.gpu_mem), "--policies", a.policies, "--repeats", str(a.repeats),
               "--tutti-extra", json.dumps({**json.loads(a.tutti_extra), **extra}), "--out", a.out,
               "--py-spy", a.py_spy, "--phase-index", str(len(out["phases"]))] + \
            (["--tiny"] if a.tiny else []) + (["--no-async-scheduling"] if a.no_async_scheduling else []) + \
            (["--trace"] if a.trace and phase == "hit" else [])
        r, err = run_case(cmd, timeout=a.timeout, marker="PHASE_RESULT", progress="LOC_PROGRESS")
        r["tutti_log"] = [l[-400:] for l in err.splitlines() if "tutti" in l and "ready" in l][-4:]
        r["extra"] = extra
        out["phases"][name] = r
        print(f"LOC {name} " + json.dumps({k: v for k, v in r.items() if k not in ("tutti_log",)})[:3000], flush=True)
        with open(os.path.join(a.out, f"load_or_compute_{a.geometry}.json"), "w") as f:
            json.dump(out, f, indent=1)  # each phase as it ends: a call stopped at its limit keeps them
        if "error" in r:
            break
    for _, name, extra in phases[1:]:
        if "error" not in out["phases"].get(name, {"error": 1}):
            rows = summarize(out["phases"]["store"], out["phases"][name], a.lengths, a.policies.split(","))
            out["summary" if name == "hit" else f"summary_{name}"] = rows
            for row in rows:
                print("LOC_ROW " + json.dumps({"phase": name, **row, **({"extra": extra} if extra else {})}), flush=True)
    with open(os.path.join(a.out, f"load_or_compute_{a.geometry}.json"), "w") as f:
        json.dump(out, f, indent=1)
    shutil.rmtree(a.root, ignore_errors=True)


if __name__ == "__main__":
    main()
