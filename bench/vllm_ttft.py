"""Time to first token: recompute against tutti (disk, /dev/shm) and vLLM's own connectors.

One driver, one run, the same prompts and engine settings for every case; each case runs in a
fresh process (one vLLM engine each) and prints a JSON line; the driver writes one table
(JSON, Markdown and a plot).

Cases: recompute (no connector), tutti on disk (O_DIRECT, no page cache), tutti on /dev/shm,
vLLM's OffloadingConnector (CPU tier), vLLM's ExampleConnector. For each prompt length:
  run 1: prefill (and store), max_tokens=1, timed
  settle: every store finished, vLLM's prefix cache reset
  run 2: the same prompt: a hit from the connector (recompute for the no-connector case)
  check: 16 greedy tokens from the hit, compared across cases
Decode: a batch of requests with fresh prompts, time per output token with the connector
storing, against no connector. The storage ceiling (raw reads of tutti's slab files through
io_uring and threads in the same run) sits next to tutti's load throughput.

    python3 bench/vllm_ttft.py --out results/ttft [--lengths 4096,16384,32768] [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ----------------------------------------------------------------------------- model
def make_model(path: str, tiny: bool) -> str:
    """A config.json with an 8B Llama's KV geometry (32 layers, 8 KV heads, head_dim 128)."""
    os.makedirs(path, exist_ok=True)
    if tiny:
        cfg = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, vocab_size=4096)
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
def connector_config(case: str, a) -> dict | None:
    if case == "recompute":
        return None
    if case.startswith("tutti"):
        root = a.disk_root if case == "tutti_disk" else a.shm_root
        return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
                "kv_role": "kv_both", "kv_connector_extra_config": {
                    "root": root, "capacity_bytes": a.capacity, "chunk_tokens": 256,
                    "staging_bytes": a.staging, "staging_slots": 1024, "max_inflight_stores": 1000,
                    "lookahead": 2}}
    if case == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": a.capacity_int}}
    if case == "example":
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": a.example_root}}
    raise ValueError(case)


def run_case(case: str, a) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    kvt = connector_config(case, a)
    kw = dict(model=a.model, skip_tokenizer_init=True, enforce_eager=True, load_format="dummy", seed=0,
              gpu_memory_utilization=a.gpu_mem, max_model_len=max(a.lengths) + 512,
              max_num_batched_tokens=max(a.lengths) + 512, enable_prefix_caching=True, dtype="bfloat16")
    if not torch.cuda.is_available():  # the CPU build (a smoke run of this script)
        kw.update(block_size=32, dtype="float32")
        kw.pop("gpu_memory_utilization")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    elif a.kernel_config:
        kw["kernel_config"] = {"enable_flashinfer_autotune": False, "enable_cutedsl_warmup": False}
    if kvt is not None:
        kw["kv_transfer_config"] = kvt
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    vocab = llm.llm_engine.model_config.get_vocab_size()
    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False, ignore_eos=True)
    sixteen = SamplingParams(max_tokens=16, temperature=0, detokenize=False, ignore_eos=True)

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def gen(prompts, sp):
        sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sync()
        return time.perf_counter() - t, outs

    def settle():
        worker = None
        try:
            from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

            if has_kv_transfer_group():
                worker = getattr(get_kv_transfer_group(), "worker", None)
        except ImportError:
            pass
        if worker is not None:
            worker.flush()
        for _ in range(3):  # deliver reports / let async offloads land
            gen([prompt(999, 16, vocab)], one)
            time.sleep(0.2 if worker is not None else 1.0)
        llm.reset_prefix_cache()

    gen([prompt(998, 64, vocab)], one)  # warm-up
    res = {"case": case, "engine_start_s": start_s, "lengths": {}}
    for n in a.lengths:
        p = prompt(n, n, vocab)
        llm.reset_prefix_cache()
        t1, o1 = gen([p], one)
        settle()
        if case == "tutti_disk" and a.drop_caches:
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("3\n")
            except OSError:
                pass
        t2, o2 = gen([p], one)
        llm.reset_prefix_cache()
        _, o3 = gen([p], sixteen)  # a hit again (the connector), 16 tokens to compare across cases
        res["lengths"][str(n)] = {"first_s": t1, "hit_s": t2, "cached_tokens": o2[0].num_cached_tokens,
                                  "tokens16": list(o3[0].outputs[0].token_ids),
                                  "first_token_run1": list(o1[0].outputs[0].token_ids),
                                  "first_token_run2": list(o2[0].outputs[0].token_ids)}
    # decode: fresh prompts, stores running during the batch
    batch = [prompt(5000 + i, a.decode_prompt, vocab) for i in range(a.decode_batch)]
    t_one, _ = gen(batch, one)
    batch = [prompt(6000 + i, a.decode_prompt, vocab) for i in range(a.decode_batch)]
    t_many, _ = gen(batch, SamplingParams(max_tokens=a.decode_tokens, temperature=0, detokenize=False, ignore_eos=True))
    res["decode_itl_ms"] = 1e3 * (t_many - t_one) / (a.decode_tokens - 1)
    try:
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        planner = getattr(conn, "planner", None)
        if planner is not None:
            st = vars(planner.stats)
            res["tutti"] = {k: st[k] for k in ("hit_tokens", "stores_committed", "stores_failed", "loads_failed",
                                               "bytes_loaded", "load_seconds", "bytes_stored", "stores_skipped")}
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            w = get_kv_transfer_group().worker
            res["tutti"]["backend"] = w.queue.caps().backend
            res["tutti"]["kernel"] = w.kernel.name
            res["tutti"]["layer_trace"] = (getattr(w, "trace", None) or [])[-200:]
    except Exception as exc:  # noqa: BLE001 - the timings above are worth keeping
        res["stats_error"] = repr(exc)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass
    return res


def storage_ceiling(root: str, segment: int = 1 << 20) -> dict:
    """Raw read throughput of tutti's slab files, io_uring and threads, same file system."""
    sys.path.insert(0, ROOT)
    from tutti.io.buffers import aligned_buffer
    from tutti.io.queue import IORequest, open_queue, submit_all, wait_all

    files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.startswith("slab-")]
    out = {}
    for backend in ("uring", "threads"):
        q = open_queue(backend)
        buf = aligned_buffer(64 * segment)
        q.register_buffers([buf])
        total, t = 0, 0.0
        for path in files:
            fd = q.open_file(path)
            size = os.fstat(fd).st_size // segment * segment
            reqs = [IORequest(fd, off, buf, (i % 64) * segment, segment) for i, off in enumerate(range(0, size, segment))]
            t0 = time.perf_counter()
            for i in range(0, len(reqs), 64):
                wait_all(submit_all(q, reqs[i:i + 64]))
            t += time.perf_counter() - t0
            total += size
            os.close(fd)
        q.close()
        out[backend + "_GBps"] = total / t / 1e9 if t else 0.0
    return out


# ----------------------------------------------------------------------------- driver
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="")
    ap.add_argument("--out", default="/tmp/ttft")
    ap.add_argument("--model", default="")
    ap.add_argument("--tiny", action="store_true", help="a 4-layer model (a quick check)")
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--cases", default="recompute,tutti_shm,tutti_disk,offloading,example")
    ap.add_argument("--disk-root", default="/tmp/tutti-ttft-disk")
    ap.add_argument("--shm-root", default="/dev/shm/tutti-ttft")
    ap.add_argument("--example-root", default="/dev/shm/example-ttft")
    ap.add_argument("--capacity", default="24GiB")
    ap.add_argument("--staging", default="8GiB", help="tutti's pinned host staging (a 32k-token prompt of an 8B model is 4 GiB)")
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--drop-caches", action="store_true", default=True)
    ap.add_argument("--kernel-config", action="store_true", default=True)
    ap.add_argument("--timeout", type=int, default=170)
    a = ap.parse_args()
    a.lengths = [int(x) for x in a.lengths.split(",")]
    from tutti.engine.config import parse_bytes

    a.capacity_int = parse_bytes("capacity", a.capacity)
    if a.case:
        print("CASE_RESULT " + json.dumps(run_case(a.case, a)), flush=True)
        return
    os.makedirs(a.out, exist_ok=True)
    if not a.model:
        a.model = make_model(os.path.join(a.out, "model"), a.tiny)
    for d in (a.disk_root, a.shm_root, a.example_root):
        shutil.rmtree(d, ignore_errors=True)
    results = []
    for case in a.cases.split(","):
        cmd = [sys.executable, __file__, "--case", case, "--model", a.model, "--lengths", ",".join(map(str, a.lengths)),
               "--disk-root", a.disk_root, "--shm-root", a.shm_root, "--example-root", a.example_root,
               "--capacity", a.capacity, "--staging", a.staging, "--gpu-mem", str(a.gpu_mem), "--decode-batch", str(a.decode_batch),
               "--decode-prompt", str(a.decode_prompt), "--decode-tokens", str(a.decode_tokens)]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                               env={**os.environ, "TUTTI_TRACE": "1"})
            lines = [l for l in p.stdout.splitlines() if l.startswith("CASE_RESULT ")]
            if p.returncode != 0 or not lines:
                results.append({"case": case, "error": (p.stderr or p.stdout)[-3000:]})
            else:
                results.append(json.loads(lines[-1][len("CASE_RESULT "):]))
        except subprocess.TimeoutExpired as exc:
            results.append({"case": case, "error": f"timeout after {a.timeout}s: {str(exc.stderr)[-2000:]}"})
        results[-1]["wall_s"] = time.time() - t0
        print(f"{case}: {time.time() - t0:.0f}s {'ERROR' if 'error' in results[-1] else 'ok'}", flush=True)
        with open(os.path.join(a.out, "ttft.json"), "w") as f:
            json.dump(results, f, indent=1)
    ceil = {}
    for name, root in (("disk", a.disk_root), ("shm", a.shm_root)):
        if os.path.isdir(root):
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
    for d in (a.disk_root, a.shm_root, a.example_root):
        shutil.rmtree(d, ignore_errors=True)


def summarize(results: list[dict], ceil: dict, a) -> dict:
    ok = {r["case"]: r for r in results if "error" not in r}
    ref = ok.get("recompute")
    rows = []
    md = ["| prompt tokens | case | TTFT run 1 (s) | TTFT hit (s) | cached tokens | x recompute | tokens = recompute |",
          "|---|---|---|---|---|---|---|"]
    for n in a.lengths:
        key = str(n)
        base = ref["lengths"][key]["hit_s"] if ref else None
        for case, r in ok.items():
            d = r["lengths"][key]
            same = ref is not None and d["tokens16"] == ref["lengths"][key]["tokens16"]
            speed = base / d["hit_s"] if base else None
            rows.append({"n": n, "case": case, **{k: d[k] for k in ("first_s", "hit_s", "cached_tokens")},
                         "speedup": speed, "same_tokens": same})
            md.append(f"| {n} | {case} | {d['first_s']:.3f} | {d['hit_s']:.3f} | {d['cached_tokens']} | "
                      f"{speed:.2f} | {same} |" if speed else f"| {n} | {case} | {d['first_s']:.3f} | {d['hit_s']:.3f} | "
                      f"{d['cached_tokens']} | - | {same} |")
    md.append("")
    md.append("| case | decode ITL (ms) | x no connector |")
    md.append("|---|---|---|")
    for case, r in ok.items():
        rel = r["decode_itl_ms"] / ref["decode_itl_ms"] if ref else float("nan")
        md.append(f"| {case} | {r['decode_itl_ms']:.2f} | {rel:.3f} |")
    md.append("")
    for case in ("tutti_disk", "tutti_shm"):
        if case in ok and "tutti" in ok[case]:
            t = ok[case]["tutti"]
            gbps = t["bytes_loaded"] / t["load_seconds"] / 1e9 if t["load_seconds"] else 0.0
            c = ceil.get("disk" if case == "tutti_disk" else "shm", {})
            md.append(f"- {case}: pipeline load {gbps:.2f} GB/s (bytes loaded / seconds from step start to last layer); "
                      f"storage ceiling io_uring {c.get('uring_GBps', float('nan')):.2f} GB/s, threads "
                      f"{c.get('threads_GBps', float('nan')):.2f} GB/s; backend {t.get('backend')}, kernel {t.get('kernel')}; "
                      f"stores committed {t['stores_committed']}, failed {t['stores_failed']}, load failures {t['loads_failed']}")
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
