"""Serving cost and time to first token: tutti against no connector and vLLM's own connectors.

vLLM's default mode (torch.compile + CUDA graphs, FULL_AND_PIECEWISE) unless --eager. One
driver, the same prompts and engine settings for every case; each case runs in a fresh process
(one vLLM engine each) and prints a JSON line; the driver writes one table (JSON, Markdown,
plot) with every figure as a ratio to the no-connector case of the same run.

Cases: recompute (no connector), recompute_piecewise (no connector, cudagraph_mode=PIECEWISE:
what forcing PIECEWISE would cost), tutti on /dev/shm (tutti_shm; tutti_shm_file: mapped_loads
off, the file path; tutti_shm_defaults: every knob at its default, auto staging; a `_gil05ms`
suffix: a GIL switch interval of 0.5 ms instead of CPython's 5 ms; a `_dma_chunk` or `_host`
suffix: `mapped_store_copy`, how stores reach the mapped slots; `_copies4`: four chunks' copies
queued at once, `store_copies_in_flight`), tutti on disk
(O_DIRECT), vLLM's
OffloadingConnector (CPU tier), vLLM's ExampleConnector. The warm-up stores nothing, so the
first hit of the first length is the first load ever (it would pay any kernel compilation).
For each prompt length:
  first prefill (and store), max_tokens=1, timed, with synchronizing CUDA calls counted
  settle: every store finished, vLLM's prefix cache reset
  hit: the same prompt (a hit from the connector; recompute without one), timed, syncs counted
  16 greedy tokens from a hit, compared across cases; a later hit, timed
Decode: time per output token of 16 requests x 128 tokens whose prompts are shorter than a
chunk (idle: nothing to store), and of 8 requests whose 2048-token prompts are being stored
while they decode. With --ceiling, the storage ceiling (raw reads of tutti's slab files through
io_uring and threads in the same run) sits next to tutti's load throughput. Each case's root is
removed once the case is done (a RAM root holds --capacity of host memory).

    python3 bench/vllm_ttft.py --out results/ttft [--lengths 8192,32768] [--eager] [--tiny]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from subcase import emit, run_case as run_subcase  # noqa: E402


# ----------------------------------------------------------------------------- model
def make_model(path: str, tiny: bool, geometry: str = "8b") -> str:
    """A config.json with an 8B Llama's KV geometry (32 layers, 8 KV heads, head_dim 128), or a
    70B-class layer (hidden 8192, 64 heads, 8 KV heads, head_dim 128) cut to 20 layers so it fits
    one H200 with random weights: the same KV bytes per layer and token as the 8B geometry, about
    4x the compute per KV byte."""
    os.makedirs(path, exist_ok=True)
    if tiny:
        cfg = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096)
    elif geometry == "70b":
        cfg = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=20, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=128, vocab_size=32000)
    else:
        cfg = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=32000)
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=40960,
               rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


# ----------------------------------------------------------------------------- one case
def run_joining(eng, requests: dict[str, tuple[list[int], int]], join: dict[str, int], sampling) -> dict[str, dict]:
    """Step an engine (`LLM.llm_engine`) with `requests` (id -> (token ids, max tokens)), each
    added at step 0 or at the step `join` names (a request joining a running decode batch);
    returns each one's tokens and cached tokens once all finished."""
    out: dict[str, dict] = {}
    step, pending = 0, dict(requests)
    while pending or eng.has_unfinished_requests():
        for rid in [r for r in pending if join.get(r, 0) <= step]:
            ids, n = pending.pop(rid)
            eng.add_request(rid, {"prompt_token_ids": ids}, sampling(n))
        for o in eng.step():
            if o.finished:
                out[o.request_id] = {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens}
        step += 1
    return out


def case_root(case: str, a) -> str:
    """A tutti case's root: each case its own, so no case loads what another stored."""
    base, plain = (a.disk_root, "tutti_disk") if case.startswith("tutti_disk") else (a.shm_root, "tutti_shm")
    return base + ("" if case == plain else "-" + case)


def connector_config(case: str, a) -> dict | None:
    if case.startswith("recompute"):
        return None
    if case.startswith("tutti"):
        # tutti_shm_file: the file path on a RAM root (mapped_loads off); tutti_shm_defaults: a
        # RAM root with every knob at its default (auto staging: are the stores all taken?)
        extra = {"root": case_root(case, a), "capacity_bytes": a.capacity, "chunk_tokens": 256}
        if not case.startswith("tutti_shm_defaults"):
            extra.update(staging_bytes=a.staging, staging_slots=1024, max_inflight_stores=1000, lookahead=2)
        if case in ("tutti_shm_file", "tutti_shm_file_gil05ms"):
            extra["mapped_loads"] = False
        if case.endswith("_gil05ms"):  # a GIL switch interval of 0.5 ms (CPython's own: 5 ms)
            extra["gil_switch_interval_s"] = 0.0005
        for copy in ("dma_chunk", "host"):  # how stores reach the mapped slots (default: "dma_chunk")
            if case.endswith("_" + copy):
                extra["mapped_store_copy"] = copy
        if case.endswith("_copies4"):  # dma_chunk with four chunks' copies queued at once
            extra["store_copies_in_flight"] = 4
        return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}
    if case == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": a.capacity_int}}
    if case == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": a.example_root}}
    raise ValueError(case)


def count_syncs(fn):
    """Run fn() with torch's sync debug mode on: (result, {"tutti": n, "vllm": n, "other": n})
    synchronizing CUDA calls, by the file that made them."""
    import warnings

    import torch

    if not torch.cuda.is_available():
        return fn(), {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    counts = {"tutti": 0, "vllm": 0, "other": 0}
    where: dict[str, int] = {}
    for w in seen:
        if "synchroniz" not in str(w.message):
            continue
        f = w.filename.replace(os.sep, "/")
        who = "tutti" if "/tutti/" in f else "vllm" if "/vllm/" in f else "other"
        counts[who] += 1
        if who == "tutti":
            where[f"{f.split('/tutti/')[-1]}:{w.lineno}"] = where.get(f"{f.split('/tutti/')[-1]}:{w.lineno}", 0) + 1
    counts["tutti_sites"] = where
    return out, counts


def hit_shape(n: int, chunk_tokens: int = 256) -> int:
    """The tokens a full tutti hit of an n-token prompt covers: its whole chunks before the last
    token, or, for a prompt ending on a chunk's end, all but the last block (the tail hit,
    tutti.engine.sched.planner). vLLM's own prefix cache holding this many tokens is the reference a hit
    is compared with: greedy tokens of seeded weights can flip with the compute's shape."""
    from tutti.tools.demo import on_cuda

    block = 16 if on_cuda() else 32  # bench_engine's block sizes
    if n % chunk_tokens == 0 and chunk_tokens > block:
        return n - block
    return (n - 1) // chunk_tokens * chunk_tokens


def bench_engine(model: str, kvt: dict | None, *, max_len: int, gpu_mem: float, eager: bool,
                 kernel_config: bool = True, compilation_config: dict | None = None,
                 batched_tokens: int | None = None, async_scheduling: bool | None = None):
    """A vllm.LLM for the benchmarks through the demo's make_llm (one harness): vLLM's default mode
    (torch.compile + CUDA graphs) unless `eager`; on the CPU build a smoke-run engine. The step's
    token budget is the whole prompt unless `batched_tokens` says otherwise."""
    from tutti.tools.demo import make_llm, on_cuda

    kw = dict(skip_tokenizer_init=True, gpu_memory_utilization=gpu_mem, max_model_len=max_len,
              max_num_batched_tokens=batched_tokens or max_len, max_num_seqs=256, dtype="bfloat16",
              enforce_eager=bool(eager), block_size=16)
    if compilation_config and not eager:
        kw["compilation_config"] = compilation_config
    if async_scheduling is not None:  # None: vLLM's default (asynchronous where it can)
        kw["async_scheduling"] = async_scheduling
    if not on_cuda():  # the CPU build (a smoke run)
        kw.update(block_size=32, dtype="float32", enforce_eager=True)
        kw.pop("gpu_memory_utilization")
        kw.pop("compilation_config", None)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    elif kernel_config:
        kw["kernel_config"] = {"enable_flashinfer_autotune": False, "enable_cutedsl_warmup": False}
    return make_llm(model, kv_transfer_config=kvt, **kw)


def timed_generate(llm):
    """gen(prompts, sampling) -> (seconds, outputs), the device synchronized around each call;
    plus greedy SamplingParams of 1 and 16 tokens."""
    import torch
    from vllm import SamplingParams

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def gen(prompts, sp):
        sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync()
        return time.perf_counter() - t, outs

    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    sixteen = SamplingParams(max_tokens=16, temperature=0, detokenize=False, ignore_eos=True)
    return gen, one, sixteen


def run_case(case: str, a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import SamplingParams

    t0 = time.time()
    llm = bench_engine(a.model, connector_config(case, a), max_len=max(a.lengths) + 512, gpu_mem=a.gpu_mem,
                       eager=a.eager, kernel_config=a.kernel_config,
                       compilation_config={"cudagraph_mode": "PIECEWISE"} if case == "recompute_piecewise" else None)
    start_s = time.time() - t0
    reseeded = 0
    from tutti.tools.demo import on_cuda

    if on_cuda():  # dummy weights give the same tokens whatever the KV holds; seeded ones do not
        sys.path.insert(0, os.path.join(ROOT, "scripts"))
        from gpu_kv_proof import rpc_reseed

        reseeded = llm.collective_rpc(rpc_reseed, args=(1234, "plain"))[0]
    vocab = llm.llm_engine.model_config.get_vocab_size()
    gen, one, sixteen = timed_generate(llm)

    def settle():
        worker = None
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

            if has_kv_transfer_group():
                worker = getattr(get_kv_transfer_group(), "worker", None)
        except ImportError:
            pass
        t_flush = time.perf_counter()
        if worker is not None:
            worker.flush()
        flushed = time.perf_counter() - t_flush  # the stores still in flight after the first token
        for _ in range(3):  # deliver reports / let async offloads land
            gen([prompt(999, 16, vocab)], one)
            time.sleep(0.2 if worker is not None else 1.0)
        llm.reset_prefix_cache()
        return flushed

    gen([prompt(998, 64, vocab)], one)  # warm-up: shorter than a chunk, nothing stored or loaded
    res = {"case": case, "engine_start_s": start_s, "lengths": {}, "reseeded_tensors": reseeded,
           "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    for n in a.lengths:
        p = prompt(n, n, vocab)
        llm.reset_prefix_cache()
        (t1, o1), sync1 = count_syncs(lambda: gen([p], one))
        settled_after_s = settle()
        if case.startswith("tutti_disk") and a.drop_caches:
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            except OSError:
                pass
        (t2, o2), sync2 = count_syncs(lambda: gen([p], one))
        llm.reset_prefix_cache()
        _, o3 = gen([p], sixteen)  # a hit again (the connector), 16 tokens to compare across cases
        llm.reset_prefix_cache()
        t4, _ = gen([p], one)  # a later hit: the first one had nothing left to compile
        res["lengths"][str(n)] = {"first_s": t1, "hit_s": t2, "later_hit_s": t4, "stores_settled_after_s": settled_after_s,
                                  "cached_tokens": o2[0].num_cached_tokens,
                                  "syncs_first": sync1, "syncs_hit": sync2,
                                  "tokens16": list(o3[0].outputs[0].token_ids),
                                  "first_token_run1": list(o1[0].outputs[0].token_ids),
                                  "first_token_run2": list(o2[0].outputs[0].token_ids)}
        if case == "recompute":
            # the reference in a hit's shape: vLLM's own prefix cache holding the prompt's whole
            # chunks (KV of a prefill of them alone) and the rest computed, as a connector's hit
            # computes it; greedy tokens of seeded weights can flip with the compute shape
            llm.reset_prefix_cache()
            m = hit_shape(n)
            gen([p[:m]], one)
            _, o5 = gen([p], sixteen)
            res["lengths"][str(n)].update(shape_ref_tokens16=list(o5[0].outputs[0].token_ids),
                                          shape_ref_cached=o5[0].num_cached_tokens)
        llm.reset_prefix_cache()

    def itl(seed: int, batch: int, plen: int, tokens: int) -> float:
        """ms per decode step: (batch x tokens) minus (batch x 1) over fresh prompts of the same shape."""
        t_one, _ = gen([prompt(seed + i, plen, vocab) for i in range(batch)], one)
        t_many, _ = gen([prompt(seed + 500 + i, plen, vocab) for i in range(batch)],
                        SamplingParams(max_tokens=tokens, temperature=0, detokenize=False, ignore_eos=True))
        return 1e3 * (t_many - t_one) / (tokens - 1)

    if not a.no_decode:
        # decode, idle: prompts shorter than a chunk, nothing to store
        res["decode_idle_ms"] = itl(4000, a.idle_batch, a.idle_prompt, a.idle_tokens)
        # decode while storing: fresh long prompts whose chunks are written while they decode
        res["decode_itl_ms"] = itl(5000, a.decode_batch, a.decode_prompt, a.decode_tokens)
    try:
        from tutti.vllm import internals

        conn = internals.engine_connector(llm)
        planner = getattr(conn, "planner", None)
        if planner is not None:
            st = vars(planner.stats)
            res["tutti"] = {k: st[k] for k in ("hit_tokens", "stores_committed", "stores_failed", "loads_failed",
                                               "bytes_loaded", "load_seconds", "bytes_stored", "stores_skipped")}
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            w = get_kv_transfer_group().worker
            res["tutti"]["backend"] = w.queue.caps().backend
            res["tutti"]["mapped_loads"] = bool(getattr(w.store, "maps_ram", False))
            res["tutti"]["mapped_bytes"] = getattr(w, "mapped_bytes", 0)
            res["tutti"]["kernel"] = w.kernel.name
            res["tutti"]["warmup_s"] = w.warmup_seconds
            res["tutti"]["whole_steps"] = dict(w.whole_steps)
            res["tutti"]["layer_trace"] = (getattr(w, "trace", None) or [])[-200:]
    except Exception as exc:  # noqa: BLE001 - the timings above are worth keeping
        res["stats_error"] = repr(exc)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return res


def storage_ceiling(root: str) -> dict:
    """Raw read rates of tutti's slab files (threads; io_uring off tmpfs), pinned host-to-device
    copies, and on tmpfs copies straight from a registered mapping: bench/load_rate.py's ceilings."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, HERE)
    from load_rate import ceilings

    return ceilings(root, 1 << 40)


# ----------------------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="")
    ap.add_argument("--out", default="/tmp/ttft")
    ap.add_argument("--model", default="")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model (a quick check)")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--cases", default="recompute,recompute_piecewise,tutti_shm,offloading",
                    help="also: tutti_disk, example")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (host-bound steps; not the default)")
    ap.add_argument("--disk-root", default="/tmp/tutti-ttft-disk")
    ap.add_argument("--shm-root", default="/dev/shm/tutti-ttft")
    ap.add_argument("--example-root", default="/dev/shm/example-ttft")
    ap.add_argument("--capacity", default="24GiB")
    ap.add_argument("--staging", default="8GiB", help="tutti's pinned host staging (a 32k-token prompt of an 8B model is 4 GiB)")
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--idle-batch", type=int, default=16)
    ap.add_argument("--idle-prompt", type=int, default=128)
    ap.add_argument("--idle-tokens", type=int, default=128)
    ap.add_argument("--drop-caches", action="store_true", default=True)
    ap.add_argument("--kernel-config", action="store_true", default=True)
    ap.add_argument("--timeout", type=int, default=170)
    ap.add_argument("--geometry", default="8b", choices=("8b", "70b"))
    ap.add_argument("--no-decode", action="store_true", help="skip the decode measurements")
    ap.add_argument("--ceiling", action="store_true",
                    help="also read tutti_shm's and tutti_disk's slab files raw (the storage ceiling; minutes)")
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    from tutti.engine.config.settings import parse_bytes

    a.capacity_int = parse_bytes("capacity", a.capacity)
    if a.case:
        emit(run_case(a.case, a))
        return
    os.makedirs(a.out, exist_ok=True)
    if not a.model:
        a.model = make_model(os.path.join(a.out, "model"), a.tiny, a.geometry)
    for d in (a.disk_root, a.shm_root, a.example_root, *glob.glob(a.shm_root + "-tutti_*"), *glob.glob(a.disk_root + "-tutti_*")):
        shutil.rmtree(d, ignore_errors=True)
    results = []
    for case in a.cases.split(","):
        cmd = [sys.executable, __file__, "--case", case, "--model", a.model, "--lengths", ",".join(map(str, a.lengths)),
               "--disk-root", a.disk_root, "--shm-root", a.shm_root, "--example-root", a.example_root,
               "--capacity", a.capacity, "--staging", a.staging, "--gpu-mem", str(a.gpu_mem), "--decode-batch", str(a.decode_batch),
               "--decode-prompt", str(a.decode_prompt), "--decode-tokens", str(a.decode_tokens),
               "--idle-batch", str(a.idle_batch), "--idle-prompt", str(a.idle_prompt),
               "--idle-tokens", str(a.idle_tokens)] + (["--eager"] if a.eager else []) + \
              (["--no-decode"] if a.no_decode else [])
        r, _ = run_subcase(cmd, timeout=a.timeout, env={**os.environ, "TUTTI_TRACE": "1"})
        r.setdefault("case", case)
        results.append(r)
        if case.startswith("tutti") and not (a.ceiling and case in ("tutti_shm", "tutti_disk")):
            # a RAM root holds --capacity of host memory: the next case (or the next command on the
            # machine) must not start without it
            shutil.rmtree(case_root(case, a), ignore_errors=True)
        print(f"{case}: {r['wall_s']:.0f}s {'ERROR' if 'error' in r else 'ok'}", flush=True)
        with open(os.path.join(a.out, "ttft.json"), "w") as f:
            json.dump(results, f, indent=1)
    ceil = {}
    for name, root in (("disk", a.disk_root), ("shm", a.shm_root)):
        if a.ceiling and os.path.isdir(root):
            try:
                ceil[name] = storage_ceiling(root)
            except Exception as exc:  # noqa: BLE001
                ceil[name] = {"error": str(exc)}
    table = summarize(results, ceil, a)
    with open(os.path.join(a.out, "ttft.json"), "w") as f:
        json.dump({"results": results, "ceiling": ceil, "table": table}, f, indent=1)
    with open(os.path.join(a.out, "ttft.md"), "w") as f:
        f.write(table["markdown"])
    print(table["markdown"])
    try:
        plot(table, os.path.join(a.out, "ttft.png"))
    except Exception as exc:  # noqa: BLE001
        print("plot failed:", exc)
    for d in (a.disk_root, a.shm_root, a.example_root, *glob.glob(a.shm_root + "-tutti_*"), *glob.glob(a.disk_root + "-tutti_*")):
        shutil.rmtree(d, ignore_errors=True)


def _ratio(x, y) -> str:
    return f"{x / y:.2f}x" if x and y else "-"


def summarize(results: list[dict], ceil: dict, a) -> dict:
    ok = {r["case"]: r for r in results if "error" not in r}
    ref = ok.get("recompute")
    mode = "eager (enforce_eager=True)" if a.eager else "default (torch.compile + CUDA graphs)"
    mode += f"; KV geometry {a.geometry}"
    rows = []
    md = [f"vLLM mode: {mode}. Ratios: to the no-connector case (recompute) of this run.", "",
          "| prompt tokens | case | first prefill (s) | x | hit (s) | x | later hit (s) | first hit / later | "
          "cached tokens | tokens = recompute (/ = vLLM's prefix cache in the hit's shape) | tutti syncs first / hit | stores settled after first token (s) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in a.lengths:
        key = str(n)
        base = ref["lengths"][key] if ref else {}
        for case, r in ok.items():
            d = r["lengths"][key]
            same = ref is not None and d["tokens16"] == base["tokens16"]
            if ref is not None and "shape_ref_tokens16" in base:  # and vLLM's prefix cache in the hit's shape
                same = f"{same} / {d['tokens16'] == base['shape_ref_tokens16']}"
            syncs = f"{d['syncs_first'].get('tutti', '-')} / {d['syncs_hit'].get('tutti', '-')}"
            rows.append({"n": n, "case": case, **{k: d[k] for k in ("first_s", "hit_s", "later_hit_s", "cached_tokens")},
                         "first_x": d["first_s"] / base["first_s"] if base else None,
                         "hit_x": d["hit_s"] / base["hit_s"] if base else None,
                         "same_tokens": same, "syncs_first": d["syncs_first"], "syncs_hit": d["syncs_hit"]})
            md.append(f"| {n} | {case} | {d['first_s']:.3f} | {_ratio(d['first_s'], base.get('first_s'))} | "
                      f"{d['hit_s']:.3f} | {_ratio(d['hit_s'], base.get('hit_s'))} | {d['later_hit_s']:.3f} | "
                      f"{_ratio(d['hit_s'], d['later_hit_s'])} | {d['cached_tokens']} | {same} | {syncs} | "
                      f"{d.get('stores_settled_after_s', float('nan')):.3f} |")
    md += ["", "| case | decode ms/token idle | x | decode ms/token while storing | x | cudagraph mode |",
           "|---|---|---|---|---|---|"]
    for case, r in ok.items():
        if "decode_idle_ms" not in r:
            continue
        md.append(f"| {case} | {r['decode_idle_ms']:.2f} | {_ratio(r['decode_idle_ms'], ref and ref['decode_idle_ms'])} | "
                  f"{r['decode_itl_ms']:.2f} | {_ratio(r['decode_itl_ms'], ref and ref['decode_itl_ms'])} | "
                  f"{r.get('cudagraph_mode')} |")
    md.append("")
    for case in ("tutti_disk", "tutti_shm"):
        if case in ok and "tutti" in ok[case]:
            t = ok[case]["tutti"]
            gbps = t["bytes_loaded"] / t["load_seconds"] / 1e9 if t["load_seconds"] else 0.0
            c = ceil.get("disk" if case == "tutti_disk" else "shm", {})
            md.append(f"- {case}: pipeline load {gbps:.2f} GB/s (bytes loaded / host seconds from step start to last "
                      f"layer); ceilings of this run: reads threads {c.get('read_threads_GBps', float('nan')):.2f} GB/s, "
                      f"io_uring {c.get('read_uring_GBps', float('nan')):.2f} GB/s, pinned host-to-device "
                      f"{c.get('h2d_pinned_GBps', float('nan')):.2f} GB/s, from a registered tmpfs mapping "
                      f"{c.get('h2d_mapped_GBps', float('nan')):.2f} GB/s; backend {t.get('backend')}, kernel {t.get('kernel')}; "
                      f"mapped loads {t.get('mapped_loads')} ({t.get('mapped_bytes', 0) / 2**30:.2f} GiB mapped at start); "
                      f"kernels warmed up in {t.get('warmup_s', 0):.2f} s at start-up; steps without hooks (FULL "
                      f"graphs) with loads/stores {t.get('whole_steps')}; stores committed {t['stores_committed']}, "
                      f"skipped {t['stores_skipped']}, failed {t['stores_failed']}, load failures {t['loads_failed']}")
    for case, r in ok.items():
        sites = {}
        for d in r["lengths"].values():
            for k in ("syncs_first", "syncs_hit"):
                for site, c in d[k].get("tutti_sites", {}).items():
                    sites[site] = sites.get(site, 0) + c
        if sites:
            md.append(f"- {case}: tutti's synchronizing calls by site: {sites}")
    for r in results:
        if "error" in r:
            md.append(f"- {r['case']}: ERROR {r['error'][-400:]!r}")
    return {"rows": rows, "markdown": "\n".join(md) + "\n"}


def plot(table: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = table["rows"]
    cases = sorted({r["case"] for r in rows})
    ns = sorted({r["n"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(cases))
    for i, c in enumerate(cases):
        ys = [next((r["hit_s"] for r in rows if r["case"] == c and r["n"] == n), 0) for n in ns]
        ax.bar([j + i * width for j in range(len(ns))], ys, width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ns))], [str(n) for n in ns])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT of a repeated prompt (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
