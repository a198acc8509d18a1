"""Does the interpreter's GIL switch interval set how fast a hit loads? An A/B in one process.

Why: while a request waits outside the batch for its asynchronous load, vLLM's engine loop spins
in Python (a step with nothing to compute, again and again) and holds the GIL. Every thread of
tutti that wakes (the load thread after a read, each IO worker that completes a request) then
waits up to the switch interval (CPython's default 5 ms) for it. The file path makes one such
wake-up per segment (1 MiB), so a spinning loop would cap it near (workers x 1 MiB / 5 ms); the
mapped path makes one per group of chunks. `bench/gil_spin_load.py` shows the effect on the CPU.

vLLM's default mode (torch.compile + CUDA graphs, asynchronous scheduling), the engine core in
this process (so `sys.setswitchinterval` reaches its loop), 8B KV geometry, weights re-seeded, a
/dev/shm root, `hit_policy: always` (the whole hit loaded, whatever the rates). Per case
(`file`: mapped_loads false; `mapped`: mapped), one engine, one process:
  first prefill of an 8k and a 32k prompt (stored), stores settled
  token references for the 32k prompt: recomputed, and vLLM's own prefix cache in the hit's shape
  for each switch interval, alternating (5, 0.2, 0.5 ms, twice): the 8k and 32k hits timed
  (vLLM's prefix cache reset before each), and decode ms/token while 8 prompts of 2048 tokens are
  stored (vllm_ttft's measure)
  16 greedy tokens of the 32k hit against both references

    python3 bench/gil_interval_ab.py --out $OUT/gil [--cases file,mapped] [--tiny] [--ab idle_wait|grid|default]

Each hit also reports its asynchronous job's timeline (`hit_<n>_timeline_ms`): when vLLM's
scheduling handed it to the worker, when the load thread took it, queued it, saw it land, and
when a step told vLLM, against the first token's time.

`--ab idle_wait` alternates tutti's `idle_load_wait_s` (2 ms, off) instead: a step with nothing
to compute sleeps until an asynchronous load lands instead of returning to the spinning loop;
`--ab grid` crosses it with the switch interval; `--ab default` repeats the hits four times
with both as shipped. The CPU engine schedules synchronously, so its
hits load in the step and no step waits unless `--extra '{"async_loads": true}'` makes them
asynchronous, as they are on a GPU in default mode; then 2 ms made 2k hits 2-4x faster on both
paths (`results/idle_wait_cpu_async.json`), and on the H200 it took the 32k RAM hit from
0.160-0.185 s to 0.118-0.126 s (`results/gil_ab_h200_idle_grid.json`), when the loading
thread loaded every hit. Since vLLM's own thread launches a mapped root's loads (`async_launch`),
the wait was as fast or slower there (results/single_request.md: 7 of 8 pairs): `auto`, the default,
is 2 ms where the loading thread loads and 0 where the step's thread launches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from subcase import emit, run_case as run_subcase  # noqa: E402
from vllm_ttft import bench_engine, hit_shape, make_model, prompt, timed_generate  # noqa: E402

# (switch interval, idle_load_wait_s) per run; None: CPython's default interval
SETTINGS = {
    "interval": [(0.005, 0.0), (0.0002, 0.0), (0.0005, 0.0)] * 2,
    "idle_wait": [(None, 0.002), (None, 0.0)] * 2,  # tutti's idle_load_wait_s, the interval left alone
    "grid": [(None, 0.0), (None, 0.002), (0.0005, 0.0), (0.0005, 0.002)] * 2,  # both, crossed
    "default": [(None, None)] * 4,  # as shipped: the interval and tutti's resolved "auto" left alone
}


def hit_timeline(worker, t_start: float, t_end: float) -> list[dict] | None:
    """Where a hit's time went, per asynchronous job it made (ms from the hit's start): submitted
    (vLLM scheduled the request and the worker bound the step), started (the load thread took
    it), launched (its copies and kernels queued; the file path's reads done), landed (on the
    device, verdicts read), taken (a step told vLLM), and the end (first token out)."""
    al = getattr(worker, "async_loads", None)
    if al is None:
        return None
    out = []
    for e in list(al.timeline):
        if e.get("submitted", 0) < t_start:
            continue
        row = {"chunks": e["chunks"]}
        for k in ("submitted", "started", "launched", "landed", "taken"):
            if k in e:
                row[k] = round(1e3 * (e[k] - t_start), 2)
        row["end"] = round(1e3 * (t_end - t_start), 2)
        out.append(row)
    return out


def run_case(case: str, a) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import SamplingParams

    from tutti.tools.demo import on_cuda
    from tutti.engine.sched.hit_policy import Always, Never
    from tutti.vllm import internals

    root = f"{a.root}-{case}"
    shutil.rmtree(root, ignore_errors=True)
    extra = {"root": root, "capacity_bytes": a.capacity, "chunk_tokens": 256, "staging_bytes": a.staging,
             "staging_slots": 1024, "max_inflight_stores": 1000, "mapped_loads": case == "mapped",
             "hit_policy": "always", "gil_switch_interval_s": "off", **json.loads(a.extra)}
    kvt = {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": extra}
    t0 = time.time()
    llm = bench_engine(a.model, kvt, max_len=max(a.lengths) + 512, gpu_mem=a.gpu_mem, eager=a.tiny)
    res: dict = {"case": case, "engine_start_s": round(time.time() - t0, 1), "switch_interval_default": sys.getswitchinterval()}
    if on_cuda():
        from gpu_kv_proof import rpc_reseed

        res["reseeded_tensors"] = llm.collective_rpc(rpc_reseed, args=(1234, "plain"))[0]
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen, one, sixteen = timed_generate(llm)
    planner = internals.engine_connector(llm).planner
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    prompts = {n: prompt(n, n, vocab) for n in a.lengths}
    gen([prompt(998, 64, vocab)], one)  # warm-up, shorter than a chunk
    for n, p in prompts.items():
        llm.reset_prefix_cache()
        res[f"first_{n}_s"] = round(gen([p], one)[0], 4)
    worker.flush()
    for _ in range(3):  # deliver the stores' reports
        gen([prompt(999, 16, vocab)], one)
        time.sleep(0.2)
    n = max(a.lengths)
    p = prompts[n]
    planner.hit_policy = Never()
    llm.reset_prefix_cache()
    res["recompute_tokens16"] = list(gen([p], sixteen)[1][0].outputs[0].token_ids)
    llm.reset_prefix_cache()
    m = hit_shape(n)
    gen([p[:m]], one)
    o = gen([p], sixteen)[1][0]
    res["vllm_prefix_cache_tokens16"] = list(o.outputs[0].token_ids)
    res["vllm_prefix_cache_cached"] = o.num_cached_tokens
    planner.hit_policy = Always()

    def itl(seed: int, interval: float) -> float:
        """ms per decode step of 8 fresh 2048-token prompts while their chunks are stored."""
        t_one, _ = gen([prompt(seed + i, a.decode_prompt, vocab) for i in range(8)], one)
        t_many, _ = gen([prompt(seed + 500 + i, a.decode_prompt, vocab) for i in range(8)],
                        SamplingParams(max_tokens=64, temperature=0, detokenize=False, ignore_eos=True))
        return round(1e3 * (t_many - t_one) / 63, 3)

    import dataclasses

    runs = []
    for k, (interval, idle) in enumerate(SETTINGS[a.ab]):
        interval = res["switch_interval_default"] if interval is None else interval
        if idle is None:
            idle = worker.idle_wait_s  # the config's value as resolved at start-up
        else:
            worker.cfg = dataclasses.replace(worker.cfg, idle_load_wait_s=idle)
            worker.idle_wait_s = idle  # what the worker reads (the config's "auto" resolved at start-up)
        run: dict = {"interval_s": interval, "idle_load_wait_s": idle}
        sys.setswitchinterval(interval)
        for n2, p2 in prompts.items():
            llm.reset_prefix_cache()
            before = planner.stats.copy()
            t_start = time.perf_counter()
            t, outs = gen([p2], one)
            t_end = time.perf_counter()
            d = planner.stats.since(before)
            run[f"hit_{n2}_s"] = round(t, 4)
            run[f"hit_{n2}_timeline_ms"] = hit_timeline(worker, t_start, t_end)
            run[f"hit_{n2}_cached"] = outs[0].num_cached_tokens
            run[f"hit_{n2}_load_GBps"] = round(d["bytes_loaded"] / d["load_seconds"] / 1e9, 2) if d["load_seconds"] else None
        if k < 2:
            llm.reset_prefix_cache()
            run["hit_tokens16"] = list(gen([p], sixteen)[1][0].outputs[0].token_ids)
        if not a.no_decode:
            run["decode_while_storing_ms"] = itl(7000 + 1000 * k, interval)
        runs.append(run)
        print(f"{case} {json.dumps(run)[:400]}", file=sys.stderr, flush=True)
    sys.setswitchinterval(res["switch_interval_default"])
    res["runs"] = runs
    res["hit_equals_recompute"] = [r.get("hit_tokens16") == res["recompute_tokens16"] for r in runs if "hit_tokens16" in r]
    res["hit_equals_vllm_prefix_cache"] = [r.get("hit_tokens16") == res["vllm_prefix_cache_tokens16"]
                                           for r in runs if "hit_tokens16" in r]
    res["stats"] = {k: v for k, v in vars(planner.stats).items() if isinstance(v, (int, float))}
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    shutil.rmtree(root, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="")
    ap.add_argument("--cases", default="file,mapped")
    ap.add_argument("--out", default="/tmp/gil_ab")
    ap.add_argument("--model", default="")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--root", default="/dev/shm/tutti-gil-ab")
    ap.add_argument("--capacity", default="24GiB")
    ap.add_argument("--staging", default="8GiB")
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--decode-prompt", type=int, default=2048)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--timeout", type=int, default=200)
    ap.add_argument("--extra", default="{}", help="JSON merged into tutti's kv_connector_extra_config")
    ap.add_argument("--ab", default="interval", choices=tuple(SETTINGS),
                    help="what alternates: CPython's switch interval, tutti's idle_load_wait_s (2 ms / off), "
                         "both crossed (grid), or both as shipped (default)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    if a.case:
        emit(run_case(a.case, a))
        return
    os.makedirs(a.out, exist_ok=True)
    if not a.model:
        a.model = make_model(os.path.join(a.out, "model"), a.tiny)
    results = []
    for case in a.cases.split(","):
        cmd = [sys.executable, __file__, "--case", case, "--model", a.model, "--lengths", ",".join(map(str, a.lengths)),
               "--root", a.root, "--capacity", a.capacity, "--staging", a.staging, "--gpu-mem", str(a.gpu_mem),
               "--decode-prompt", str(a.decode_prompt), "--ab", a.ab, "--extra", a.extra] + (["--tiny"] if a.tiny else []) + \
              (["--no-decode"] if a.no_decode else [])
        r, _ = run_subcase(cmd, timeout=a.timeout, progress=case + " ")
        r.setdefault("case", case)
        results.append(r)
        print("GIL_AB " + json.dumps(r)[:4000], flush=True)
        with open(os.path.join(a.out, "gil_ab.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
