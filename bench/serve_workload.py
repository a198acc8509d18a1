"""A loaded `vllm serve` with and without tutti, under vLLM's own client (`vllm bench serve`).

Each case gets vLLM's OpenAI server in its own process group and on its own port (the engine
core in its own process, vLLM's default mode). The servers start together (an 8B-sized start
takes about two minutes in default mode), then each case in turn runs `vllm bench serve` against
its server alone, with `/metrics` scraped before and after, and prints one JSON line; the driver
writes one table (JSON and Markdown) with every figure as a ratio to the no-connector case of the
same run. Besides the connectors' counters it keeps vLLM's own account of the engine's steps
(and those that computed no prompt token) and of every prompt token by source (computed, vLLM's
GPU prefix cache, the connector), alike for every case. `--sequential` starts each server only after the last one stopped.

Cases: `none` (no connector), `none_gpu` (no connector, vLLM's GPU KV cache given `--capacity`
instead of `--kv-cache-bytes`: every repeat is a prefix-cache hit of vLLM's own and nothing is
loaded, the most any connector of that capacity could reach on the workload), `offloading`
(vLLM's OffloadingConnector, a CPU tier of `--capacity`), `tutti_shm` (a /dev/shm root of the same capacity), `tutti_disk` (a disk root
of `--disk-capacity`), the hierarchies: `tier_fs` (vLLM's CPU tier of `--capacity` with its own `fs`
tier on the disk behind it, TieringOffloadingSpec; the fs tier has no capacity and never evicts),
`tier_tutti` (the same CPU tier with tutti's secondary tier of `--disk-capacity` behind it) and
`tutti_tiered` (tutti's `tiers`: a /dev/shm tier of `--capacity` in front of a disk tier of
`--disk-capacity`),
and variants of `tutti_shm` that take one part away, each on a root of its own, to tell where a
cost comes from (VARIANTS: `tutti_shm_stores_only`, `tutti_shm_noverify`, `tutti_shm_file`; each
pins its own capacity, so run them with `--sequential` or a smaller `--capacity`).
Workloads: `prefix_repetition` (vLLM's dataset: prefixes repeated in shuffled order),
`multi_turn` (conversations whose every turn repeats the whole last turn and adds to it; turns
issued in order, all conversations' first turns, then their second...), and `zipf` / `uniform`
(`--num-prefixes` prefixes, `--num-prefixes x --repeats` prompts, each a prefix and a fresh suffix;
the prefix drawn with Zipf-skewed popularity of exponent `--zipf-s`, or each prefix `--repeats`
times, in a seeded shuffled order: a custom dataset for `vllm bench serve`).

The model folder gets a generated word-level tokenizer whose words are short (vLLM refuses a
prompt of more than about 6 characters a token before tokenizing it).

    python3 bench/serve_workload.py --out /tmp/serve                      # the GPU: 8B KV geometry
    python3 bench/serve_workload.py --out /tmp/serve --tiny               # the CPU smoke run
    python3 bench/serve_workload.py --out $OUT --cases offloading,tutti_shm --profile-steps 300 --profile-delay 600
        # the GPU streams of 300 steps of each server (bench/trace_summary.py); its throughput is a
        # profiled run's, not a figure to compare with unprofiled calls
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]
from gil_profile import GilRecorder, find_py_spy, tutti_share  # noqa: E402
from trace_summary import find_traces, load_events, summarize  # noqa: E402
from vllm_ttft import make_model  # noqa: E402

# counters scraped from /metrics (each summed over its label sets), before and after a run
METRICS = ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries", "vllm:external_prefix_cache_hits",
           "vllm:external_prefix_cache_queries", "vllm:tutti_hit_tokens", "vllm:tutti_queried_tokens",
           "vllm:tutti_skipped_stores", "vllm:tutti_stored_chunks", "vllm:tutti_failed_loads",
           "vllm:tutti_declined_hit_tokens", "vllm:tutti_async_hit_tokens",
           "vllm:tutti_load_bytes", "vllm:tutti_load_seconds", "vllm:tutti_store_bytes", "vllm:tutti_store_seconds",
           "vllm:tutti_worker_hook_seconds", "vllm:tutti_worker_thread_cpu_seconds", "vllm:tutti_worker_thread_wait_seconds",
           "vllm:tutti_scheduler_hook_seconds",
           "vllm:kv_offload_total_bytes", "vllm:kv_offload_total_time", "vllm:num_preemptions",
           # how long a hit waits outside the batch for its KV: tutti's asynchronous loads, and vLLM's
           # tiers' lookups deferred while a chunk comes up from a secondary tier (its CPU-to-GPU
           # load after that is not in it)
           "vllm:tutti_async_wait_seconds", "vllm:tutti_async_waits",
           "vllm:kv_offload_lookup_async_delay_seconds_sum", "vllm:kv_offload_lookup_async_delay_seconds_count",
           # the engine's steps, and those of at most DECODE_ONLY_TOKENS tokens: with at most that many
           # requests at once, the steps that computed no prompt token (vLLM's tokens-per-step histogram)
           "vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total:decode_only")
DECODE_ONLY_TOKENS = 8  # a bucket bound of vllm:iteration_tokens_total: decode-only while --concurrency <= 8
# one counter with a `reason` label: kept apart per reason, as "NAME:REASON"
BY_REASON = "vllm:tutti_declined_hit_tokens_by_reason"
REASONS = ("rate", "queue", "unmeasured", "budget", "state")
# vLLM's own account of every prompt token, counted once per request whatever connector served it
# (lookups asked again do not inflate it, as they do vllm:prefix_cache_*): kept apart per source
BY_SOURCE = "vllm:prompt_tokens_by_source"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# counters with a `tier` label (tutti's tiers): kept apart per tier, as "NAME:TIER"
BY_TIER = ("vllm:tutti_tier_hit_tokens", "vllm:tutti_tier_evictions", "vllm:tutti_tier_writedowns")
TIERS = ("0", "1")
# each counter kept apart by one label -> that label (the values kept: REASONS, SOURCES, TIERS)
KEPT_APART = {BY_REASON: "reason", BY_SOURCE: "source", **{n: "tier" for n in BY_TIER}}
TIER_TOTALS = ("vllm:tutti_tier_promotions", "vllm:tutti_tier_dropped", "vllm:tutti_tier_staged_hits")


def short_word(i: int) -> str:
    """Token i's word: a letter, then base-36 digits; every id below 34658 gets a distinct word of
    at most 3 characters (4 with the separating space)."""
    letters, digits = "abcdefghijklmnopqrstuvwxyz", "0123456789abcdefghijklmnopqrstuvwxyz"
    n = 0
    while i >= 26 * 36 ** n:  # words of n + 1 characters: 26 x 36^n of them
        i -= 26 * 36 ** n
        n += 1
    tail = ""
    for _ in range(n):
        i, d = divmod(i, 36)
        tail = digits[d] + tail
    return letters[i] + tail


def write_tokenizer(model_dir: str, vocab: int, max_len: int) -> None:
    """A word-level tokenizer with short words: ids 0..3 special, then one word per id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    words = specials + [short_word(i) for i in range(len(specials), vocab)]
    assert len(set(words)) == len(words)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(specials)
    tok.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": max_len}, f)


def prepare_model(a) -> str:
    d = os.path.join(a.out, "model")
    if a.tiny:
        from tutti.tools.demo import make_tiny_model

        make_tiny_model(d, num_layers=4, vocab=a.vocab, max_position=a.max_len + 64)
    else:
        make_model(d, False, a.geometry)
    write_tokenizer(d, a.vocab, a.max_len)
    return d


def popularity_dataset(path: str, a) -> int:
    """`--num-prefixes` prefixes of `--prefix-len` words; `--num-prefixes x --repeats` prompts,
    each a prefix and `--suffix-len` fresh words. "uniform": every prefix `--repeats` times;
    "zipf": prefix i drawn with weight 1 / (i + 1) ** --zipf-s. Seeded, shuffled."""
    rng = random.Random(11)
    words = [short_word(i) for i in range(10, a.vocab - 10)]
    prefixes = [" ".join(rng.choice(words) for _ in range(a.prefix_len)) for _ in range(a.num_prefixes)]
    n = a.num_prefixes * a.repeats
    if a.workload == "uniform":
        order = [i for i in range(a.num_prefixes) for _ in range(a.repeats)]
        rng.shuffle(order)
    else:
        weights = [1.0 / (i + 1) ** a.zipf_s for i in range(a.num_prefixes)]
        order = rng.choices(range(a.num_prefixes), weights=weights, k=n)
    a.prefix_order = order  # which prefix each request sends, in send order (ttft_by_send)
    with open(path, "w") as f:
        for i in order:
            suffix = " ".join(rng.choice(words) for _ in range(a.suffix_len))
            f.write(json.dumps({"prompt": prefixes[i] + " " + suffix, "output_tokens": a.output_len}) + "\n")
    return n


def multi_turn_dataset(path: str, a) -> int:
    """`--conversations` conversations of `--turns` turns; turn t repeats turn t-1 whole and adds
    `--turn-len` words (a user message after a stand-in for the model's answer)."""
    rng = random.Random(7)
    words = [short_word(i) for i in range(10, a.vocab - 10)]
    convs = [[" ".join(rng.choice(words) for _ in range(a.prefix_len))] for _ in range(a.conversations)]
    n = 0
    with open(path, "w") as f:
        for t in range(a.turns):
            for c in convs:
                if t:
                    c.append(" ".join(rng.choice(words) for _ in range(a.turn_len)))
                f.write(json.dumps({"prompt": " ".join(c), "output_tokens": a.output_len}) + "\n")
                n += 1
    return n


# tutti_shm or tutti_disk with one part taken away (its config keys on top of --tutti-extra)
VARIANTS: dict[str, dict] = {
    "tutti_shm_stores_only": {"hit_policy": "never"},  # stores every chunk, loads nothing
    "tutti_shm_noverify": {"verify_checksums": False},  # loads without the checksum launches
    "tutti_shm_file": {"mapped_loads": False},  # loads and stores through the file path
    "tutti_disk_nowindow": {"write_window_bytes": "off"},  # the disk, every write of a run at once
    "tutti_disk_writesfirst": {"reads_first": False},  # the disk, writes not yielding to the hits' reads
    # the disk, whole prefixes, fewer of them while the drive is the bottleneck (writes less)
    "tutti_disk_share": {"store_admission": "drive_share"},
    # a GIL switch interval of 0.5 ms in the engine core's process (CPython's own: 5 ms)
    "tutti_shm_gil05ms": {"gil_switch_interval_s": 0.0005},
    "tutti_disk_gil05ms": {"gil_switch_interval_s": 0.0005},
    # how stores reach the mapped slots (mapped_store_copy; the default "dma_chunk")
    "tutti_shm_dma": {"mapped_store_copy": "dma"},
    "tutti_shm_host": {"mapped_store_copy": "host"},
    # dma_chunk with four chunks' copies queued at once: a prefill burst's stores drain faster
    "tutti_shm_copies4": {"store_copies_in_flight": 4},
    # asynchronous loads launched by tutti's loading thread (`async_launch: thread`; the default
    # launches a mapped root's from the step's thread: async_launch)
    "tutti_shm_thread": {"async_launch": "thread"},
    # the disk's whole loads read layer by layer (`whole_loads: layer`; the default reads a
    # chunk's slot at once: tutti.engine.worker.loads.file_chunks)
    "tutti_disk_layer": {"whole_loads": "layer"},
    # the tiers, writing a chunk down only when it nears eviction from the full RAM tier
    "tutti_tiered_back": {"write_policy": "back"},
    # the tiers, never copying a hit from the disk tier back up (`promote: off`)
    "tutti_tiered_nopromo": {"promote": "off"},
    # the tiers, copying a hit's disk-tier chunks up before it loads, the request holding no GPU
    # blocks meanwhile (`promote: stage`)
    "tutti_tiered_stage": {"promote": "stage"},
}


TIERED = ("tier_fs", "tier_tutti", "tutti_tiered")


def roots_of(case: str, a) -> list[str]:
    """Every directory a case writes (removed before and after it)."""
    if case == "tier_fs" or case == "tier_tutti":
        return [f"{a.disk_root}-{case}"]
    if case.startswith("tutti_tiered"):
        tag = "tiered" + case[len("tutti_tiered"):]
        return [f"{a.shm_root}-{tag}", f"{a.disk_root}-{tag}"]
    return [root_of(case, a)] if case.startswith("tutti") else []


def root_of(case: str, a) -> str:
    if case in ("tutti_disk", "tutti_shm"):
        return a.disk_root if case == "tutti_disk" else a.shm_root
    if case.startswith("tutti_disk_"):
        return f"{a.disk_root}-{case[len('tutti_disk_'):]}"
    return f"{a.shm_root}-{case[len('tutti_shm_'):]}"


def connector(case: str, a) -> dict | None:
    if case in ("none", "none_gpu"):
        return None
    if case == "offloading":
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"cpu_bytes_to_use": a.capacity_bytes}}
    if case in ("tier_fs", "tier_tutti"):  # vLLM's CPU tier with a secondary tier on the disk
        sec = ({"type": "fs", "root_dir": roots_of(case, a)[0]} if case == "tier_fs" else
               {"type": "tutti", "root": roots_of(case, a)[0], "capacity_bytes": a.disk_capacity_bytes})
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                              "cpu_bytes_to_use": a.capacity_bytes, "secondary_tiers": [sec]}}
    if case not in ("tutti_shm", "tutti_disk", "tutti_tiered") and case not in VARIANTS:
        raise SystemExit(f"--cases: {case!r}: expected none, none_gpu, offloading, tutti_shm, tutti_disk, "
                         f"{', '.join(TIERED)} or one of {sorted(VARIANTS)}")
    if case.startswith("tutti_tiered"):
        ram, disk = roots_of(case, a)
        where = {"tiers": [{"root": ram, "capacity_bytes": a.capacity_bytes},
                           {"root": disk, "capacity_bytes": a.disk_capacity_bytes}]}
    else:
        cap = a.disk_capacity_bytes if case.startswith("tutti_disk") else a.capacity_bytes
        where = {"root": root_of(case, a), "capacity_bytes": cap}
    extra = {**where, "chunk_tokens": a.chunk_tokens, **json.loads(a.tutti_extra), **VARIANTS.get(case, {})}
    return {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def parse_metrics(text: str) -> dict[str, float]:
    """METRICS from Prometheus text, each summed over its label sets (`_total` or not)."""
    out = dict.fromkeys(METRICS + tuple(f"{BY_REASON}:{r}" for r in REASONS) + TIER_TOTALS
                        + tuple(f"{BY_SOURCE}:{src}" for src in SOURCES)
                        + tuple(f"{n}:{t}" for n in BY_TIER for t in TIERS), 0.0)
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        base = name[:-6] if name.endswith("_total") else name
        if name == "vllm:iteration_tokens_total_bucket":
            m = re.search(r'le="([0-9.]+)"', line)
            base = "vllm:iteration_tokens_total:decode_only" if m and float(m.group(1)) == DECODE_ONLY_TOKENS else name
        elif base in KEPT_APART:
            m = re.search(f'{KEPT_APART[base]}="([^"]*)"', line)
            base = f"{base}:{m.group(1)}" if m else base
        if base in out:
            try:
                out[base] += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return out


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Polls /health until it answers; always asks once, so a server that became ready while
    earlier cases' clients ran counts as ready even when its start-up deadline has passed."""
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            if time.time() - t0 >= timeout:
                raise TimeoutError(f"the server was not ready {timeout:.0f} s before its start-up deadline") from None
            time.sleep(1)


def profile_dir(a, case: str) -> str:
    return os.path.abspath(os.path.join(a.out, f"prof_{case}"))


def profiler_config(a, case: str) -> dict:
    """vLLM's torch profiler over `--profile-steps` engine steps, `--profile-delay` steps into the
    client's run (the worker's trace only: no stacks, no shapes, no front end)."""
    return {"profiler": "torch", "torch_profiler_dir": profile_dir(a, case), "torch_profiler_with_stack": False,
            "torch_profiler_record_shapes": False, "ignore_frontend": True,
            "delay_iterations": a.profile_delay, "max_iterations": a.profile_steps}


def post(port: int, path: str, timeout: float = 120) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        r.read()


def profile_summary(a, case: str, wait_s: float = 120.0) -> list[dict]:
    """The case's traces, summarised (bench/trace_summary.py) and, without --keep-traces, removed."""
    d = profile_dir(a, case)
    end = time.time() + wait_s
    traces = find_traces(d)
    while not traces and time.time() < end:  # written when the profiler stops
        time.sleep(2)
        traces = find_traces(d)
    time.sleep(2)  # a trace still being written
    out = [{"trace": os.path.basename(t), **summarize(load_events(t))} for t in find_traces(d)]
    if not a.keep_traces:
        shutil.rmtree(d, ignore_errors=True)
    return out


def server_cmd(a, model: str, kvt: dict | None, port: int, case: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", str(a.max_len), "--seed", "0", "--enable-prefix-caching"]
    if a.tiny:
        # vLLM's own cache held to 32 blocks (1024 tokens) so that repeats miss it, as --kv-cache-bytes does on the GPU
        cmd += ["--dtype", "float32", "--block-size", "32", "--max-num-seqs", "8", "--max-num-batched-tokens",
                str(a.max_len)]
        if case != "none_gpu":  # none_gpu: the whole CPU KV space (VLLM_CPU_KVCACHE_SPACE) holds every prefix
            cmd += ["--num-gpu-blocks-override", "32"]
    else:
        kv = a.capacity_bytes if case == "none_gpu" else a.kv_cache_bytes  # none_gpu: the tiers' capacity on the GPU
        cmd += ["--load-format", "dummy", "--dtype", "bfloat16", "--kv-cache-memory-bytes", str(kv),
                "--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    if kvt is not None:
        cmd += ["--kv-transfer-config", json.dumps(kvt)]
    cmd += shlex.split(getattr(a, "server_args", "") or "")
    if getattr(a, "profile_steps", 0):
        cmd += ["--profiler-config", json.dumps(profiler_config(a, case))]
    return cmd


# `vllm bench serve` without vLLM's CLI wrapper, which asks for the distribution "vllm" (the
# vllm-cpu build fails there): the same parser and main function. Its custom (JSONL) dataset reads
# through pandas, which neither the CPU setup nor the GPU bundle has: read the same rows with json.
BENCH_SERVE = """
import json, sys
from vllm.benchmarks.datasets import datasets as D
def _load_jsonl(self):
    with open(self.dataset_path, encoding="utf-8") as f:
        self.data = [json.loads(line) for line in f if line.strip()]
D.CustomDataset.load_data = _load_jsonl  # --disable-shuffle is always given with it
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def bench_cmd(a, model: str, result_dir: str, dataset: str | None, port: int) -> list[str]:
    cmd = [sys.executable, "-c", BENCH_SERVE, "--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
           "--max-concurrency", str(a.concurrency), "--ignore-eos", "--save-result", "--result-dir", result_dir,
           "--result-filename", "result.json", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,99", "--save-detailed"]
    if a.workload == "prefix_repetition":
        cmd += ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
                "--prefix-repetition-suffix-len", str(a.suffix_len), "--prefix-repetition-num-prefixes",
                str(a.num_prefixes), "--prefix-repetition-output-len", str(a.output_len),
                "--num-prompts", str(a.num_prefixes * a.repeats)]
    else:
        n = a.conversations * a.turns if a.workload == "multi_turn" else a.num_prefixes * a.repeats
        # --custom-output-len: its default (256) overrides each row's output_tokens, and a prompt
        # near --max-model-len is then refused (400)
        cmd += ["--dataset-name", "custom", "--dataset-path", dataset, "--disable-shuffle", "--skip-chat-template",
                "--num-prompts", str(n), "--custom-output-len", str(a.output_len)]
    return cmd


def plugin_site(out: str) -> str | None:
    """A folder whose metadata declares tutti's vLLM plugin (`vllm.general_plugins`), for a
    server where tutti is on PYTHONPATH but not installed (vLLM 0.26 finds the tier type "tutti"
    only by the name the plugin registers); None where the installed distribution declares it."""
    from importlib.metadata import entry_points

    if any(ep.value.startswith("tutti.") for ep in entry_points(group="vllm.general_plugins")):
        return None
    site = os.path.join(os.path.abspath(out), "plugin_site")
    info = os.path.join(site, "tutti_kv_bench-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: tutti-kv-bench\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\ntutti = tutti.vllm.plugin:register\n")
    return site


def server_env(a) -> dict:
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
    site = getattr(a, "plugin_site", None)
    if site:  # tutti's vLLM plugin (the tier type "tutti") where tutti is not installed, only on the path
        env["PYTHONPATH"] = os.pathsep.join([site, env["PYTHONPATH"]])
    if a.tiny:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


class Server:
    """One case's OpenAI server, in its own process group, on its own port."""

    def __init__(self, case: str, a, model: str, port: int) -> None:
        self.case, self.port = case, port
        for d in roots_of(case, a):
            shutil.rmtree(d, ignore_errors=True)
        self.log_path = os.path.join(a.out, f"server_{case}.log")
        self.t0 = time.time()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(server_cmd(a, model, connector(case, a), port, case), stdout=log,
                                         stderr=subprocess.STDOUT, env=server_env(a), start_new_session=True)
        self.start_s: float | None = None

    def wait_ready(self, timeout: float) -> None:
        wait_ready(self.port, self.proc, timeout - (time.time() - self.t0))
        self.start_s = round(time.time() - self.t0, 1)

    def stop(self) -> None:
        """SIGINT, then SIGKILL after a short grace: each case's root is its own and thrown away."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def log_tail(self) -> list[str]:
        return [l.rstrip()[-400:] for l in open(self.log_path, errors="replace").readlines()
                if "tutti" in l or "Error" in l or "error" in l][-12:]


def block_device(path: str) -> str | None:
    """The /proc/diskstats name of the block device that holds `path` (its nearest existing
    parent); None where it has none (an overlay or tmpfs root)."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    dev = os.stat(path or "/").st_dev
    try:
        return os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return None


def diskstats(name: str | None) -> dict[str, float] | None:
    """Bytes read and written and milliseconds busy of one block device (/proc/diskstats), to
    tell whether a case was bound by its disk: busy / duration near 1 means it was."""
    if not name:
        return None
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if len(p) >= 13 and p[2] == name:
                    return {"read_bytes": int(p[5]) * 512, "write_bytes": int(p[9]) * 512, "busy_ms": int(p[12])}
    except OSError:
        pass
    return None


def disk_delta(before: dict | None, after: dict | None, duration: float | None) -> dict | None:
    if not before or not after or not duration:
        return None
    d = {k: after[k] - before[k] for k in before}
    return {"read_gb": d["read_bytes"] / 1e9, "write_gb": d["write_bytes"] / 1e9,
            "read_gbps": d["read_bytes"] / 1e9 / duration, "write_gbps": d["write_bytes"] / 1e9 / duration,
            "busy": d["busy_ms"] / 1e3 / duration}


def bench_case(srv: Server, a, model: str, dataset: str | None) -> dict:
    res: dict = {"case": srv.case}
    try:
        srv.wait_ready(a.start_timeout)
        res["start_s"] = srv.start_s
        before = scrape(srv.port)
        disk = block_device(a.disk_root)
        disk_before = diskstats(disk)
        rdir = os.path.join(a.out, f"bench_{srv.case}")
        shutil.rmtree(rdir, ignore_errors=True)
        rec = None
        if a.py_spy_bin:  # who holds the GIL in the server's processes while the client runs
            rec = GilRecorder.start(a.py_spy_bin, srv.proc.pid, os.path.join(a.out, f"gil_{srv.case}.txt"))
        if a.profile_steps:  # the profiler starts --profile-delay steps into the client's run
            post(srv.port, "/start_profile")
        try:
            b = subprocess.run(bench_cmd(a, model, rdir, dataset, srv.port), capture_output=True, text=True,
                               env=server_env(a), timeout=a.bench_timeout)
        finally:
            if rec is not None:
                res["gil"] = rec.stop()
            if a.profile_steps:
                try:
                    post(srv.port, "/stop_profile")  # already stopped after --profile-steps: harmless
                except Exception as exc:  # noqa: BLE001 - the trace may be written all the same
                    res["profile_stop"] = repr(exc)[-300:]
                res["profile"] = profile_summary(a, srv.case)
        if b.returncode != 0:
            raise RuntimeError(f"vllm bench serve exited {b.returncode}: {(b.stderr or b.stdout)[-2000:]}")
        disk_after = diskstats(disk)
        time.sleep(2)  # the last steps' counters reach /metrics
        after = scrape(srv.port)
        with open(os.path.join(rdir, "result.json")) as f:
            r = json.load(f)
        res.update({k: r.get(k) for k in ("completed", "request_throughput", "output_throughput", "mean_ttft_ms",
                                          "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                                          "mean_e2el_ms", "duration")})
        res.update(request_ttfts(r))
        res.update(ttft_by_send(res.get("ttfts_ms"), getattr(a, "prefix_order", None)))
        res["metrics"] = {k: after[k] - before[k] for k in after}  # METRICS, and the declined tokens by reason
        res["disk"] = disk_delta(disk_before, disk_after, r.get("duration"))
        if res["disk"] is not None:
            res["disk"]["device"] = disk
    except Exception as exc:  # noqa: BLE001 - one case's failure is reported, the others still run
        res["error"] = repr(exc)[-2000:]
    return res


def p90(srt: list[float]) -> float:
    """The 90th percentile of sorted values (at least one)."""
    return srt[min(len(srt) - 1, int(0.9 * len(srt)))]


def request_ttfts(r: dict) -> dict:
    """Each request's TTFT in ms (None: it failed), in the dataset's order, which is the order the
    client sends them in, and the p90: the tail the summary's mean, p50 and p99 leave out
    (`vllm bench serve --save-detailed`)."""
    ms = [round(t * 1000, 1) if isinstance(t, (int, float)) and t > 0 else None for t in (r.get("ttfts") or [])]
    srt = sorted(t for t in ms if t is not None)
    if not srt:
        return {}
    return {"ttfts_ms": ms, "p90_ttft_ms": p90(srt)}


def ttft_by_send(ttfts_ms: list[float | None] | None, order: list[int] | None) -> dict:
    """TTFT of each prefix's first send (nothing to hit but what is computed meanwhile) apart from
    its repeats (the hits), for the datasets this module writes (`order`: the prefix of each
    request, sent in that order): whether a case's tail comes from its hits or from its misses."""
    if not ttfts_ms or not order or len(ttfts_ms) != len(order):
        return {}
    seen: set[int] = set()
    first, repeat = [], []
    for t, i in zip(ttfts_ms, order):
        if t is not None:  # a failed request still was its prefix's first send
            (repeat if i in seen else first).append(t)
        seen.add(i)

    def stats(xs: list[float]) -> dict:
        srt = sorted(xs)
        return {"n": len(xs), "mean": round(sum(xs) / len(xs), 1), "p50": srt[len(srt) // 2],
                "p90": p90(srt)} if xs else {"n": 0}
    return {"ttft_first_sends_ms": stats(first), "ttft_repeats_ms": stats(repeat)}


def tier_cell(m: dict) -> str:
    """A tiered case's per-tier counters ("-" for a case without tiers)."""
    if not any(m.get(f"{n}:{t}") for n in BY_TIER for t in TIERS):
        return "-"
    g = lambda k: f"{m.get(k, 0):.0f}"  # noqa: E731
    return (f"{g('vllm:tutti_tier_hit_tokens:0')} / {g('vllm:tutti_tier_hit_tokens:1')}, "
            f"{g('vllm:tutti_tier_evictions:0')} / {g('vllm:tutti_tier_evictions:1')}, "
            f"{g('vllm:tutti_tier_writedowns:1')}, {g('vllm:tutti_tier_promotions')}, {g('vllm:tutti_tier_dropped')}"
            + (f" ({g('vllm:tutti_tier_staged_hits')} hits staged)" if m.get("vllm:tutti_tier_staged_hits") else ""))


def wait_cell(m: dict) -> str:
    """The mean wait of a hit outside the batch, in ms: tutti's asynchronous loads, or vLLM's
    deferred lookups of its secondary tiers ("-": none counted)."""
    for s, n in (("vllm:tutti_async_wait_seconds", "vllm:tutti_async_waits"),
                 ("vllm:kv_offload_lookup_async_delay_seconds_sum", "vllm:kv_offload_lookup_async_delay_seconds_count")):
        if m.get(n):
            return f"{1000 * m[s] / m[n]:.0f} ({m[n]:.0f})"
    return "-"


def disk_cell(d: dict | None) -> str:
    return "-" if not d else f"{d['read_gb']:.1f} / {d['write_gb']:.1f}, {100 * d['busy']:.0f}%"


def sources_cell(m: dict) -> str:
    """Prompt tokens computed / from vLLM's GPU prefix cache / from the connector, as vLLM counts
    them once per request ("-": not exported)."""
    got = [m.get(f"{BY_SOURCE}:{src}", 0) for src in SOURCES]
    return "-" if not any(got) else " / ".join(f"{x:.0f}" for x in got)


def steps_cell(m: dict) -> str:
    """The engine's steps, and in brackets those that computed no prompt token ("-": not exported)."""
    n = m.get("vllm:iteration_tokens_total_count")
    return "-" if not n else f"{n:.0f} ({m.get('vllm:iteration_tokens_total:decode_only', 0):.0f})"


def ttft_cell(r: dict) -> str:
    """TTFT mean / p50 / p90 / p99, then the means of first sends and repeats where the dataset
    says which is which ("-" for what a run did not record)."""
    p90 = r.get("p90_ttft_ms")
    cell = (f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {'-' if p90 is None else f'{p90:.0f}'} / "
            f"{r['p99_ttft_ms']:.0f}")
    first, rep = r.get("ttft_first_sends_ms", {}), r.get("ttft_repeats_ms", {})
    if first.get("n") and rep.get("n"):
        cell += f"; {first['mean']:.0f} / {rep['mean']:.0f}"
    return cell


def tpot_cell(r: dict) -> str:
    """TPOT beside the mean request latency: with --concurrency clients each sending its next request
    when the last ends, req/s is about concurrency / latency, so a longer TTFT paid back by a shorter
    decode costs nothing (results/tiers.md, "A request's whole latency")."""
    cell = f"{r['mean_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f}"
    return cell + (f"; {r['mean_e2el_ms']:.0f}" if r.get("mean_e2el_ms") is not None else "")


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["case"] == "none" and "error" not in r), None)
    rows = ["| case | req/s | x none | TTFT mean / p50 / p90 / p99 (ms); mean of first sends / repeats | TPOT mean / p99 (ms); a request's latency, mean (ms) | hit tokens (connector) | "
            "vLLM prefix-cache hits | stores skipped | tutti host s: worker hooks / threads' CPU (their waits, wall) / "
            "scheduler hooks | GIL held by tutti's threads | tiers: hit tokens 0 / 1, evictions 0 / 1, "
            "write-downs, promotions, dropped | disk: GB read / written, busy | a hit's wait outside the batch, "
            "mean ms (hits) | engine steps (decode-only) | prompt tokens computed / GPU cache / connector |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['case']} | error: {r['error'][:80]} | | | | | | | | | | | | | |")
            continue
        m = r["metrics"]
        ratio = f"{r['request_throughput'] / base['request_throughput']:.2f}" if base and base['request_throughput'] else "-"
        hit = m["vllm:tutti_hit_tokens"] or m["vllm:external_prefix_cache_hits"]
        gil = f"{100 * tutti_share(r['gil']):.1f}%" if "gil" in r else "-"
        rows.append(f"| {r['case']} | {r['request_throughput']:.2f} | {ratio} | {ttft_cell(r)} | {tpot_cell(r)} | "
                    f"{hit:.0f} | {m['vllm:prefix_cache_hits']:.0f} | "
                    f"{m['vllm:tutti_skipped_stores']:.0f} | {m['vllm:tutti_worker_hook_seconds']:.2f} / "
                    f"{m['vllm:tutti_worker_thread_cpu_seconds']:.2f} ({m['vllm:tutti_worker_thread_wait_seconds']:.2f}) / "
                    f"{m['vllm:tutti_scheduler_hook_seconds']:.2f} | {gil} | {tier_cell(m)} | {disk_cell(r.get('disk'))} | {wait_cell(m)} | "
                    f"{steps_cell(m)} | {sources_cell(m)} |")
    return "\n".join(rows)


def profile_table(results: list[dict]) -> str:
    """The traced window of each server (--profile-steps): does the compute stream wait between
    kernels (the host is late), and what else ran on the GPU beside it?"""
    rows = []
    for r in results:
        for p in r.get("profile") or []:
            c, cp, tk = p.get("compute", {}), p.get("copies", {}), p.get("tutti_kernels", {})
            gs = p.get("gpu_steps", {})
            dec, mix, bt = gs.get("decode", {}), gs.get("prefill+decode", {}), p.get("batch", {})
            rows.append(f"| {r['case']} | {p.get('window_ms', '-')} | {c.get('busy_fraction', '-')} | "
                        f"{c.get('idle_ms', '-')} | {c.get('gaps_over_1000us', {}).get('n', '-')} / "
                        f"{c.get('gaps_over_1000us', {}).get('ms', '-')} | {tk.get('ms', '-')} | "
                        f"{cp.get('HtoD', {}).get('ms', 0)} / {cp.get('DtoH', {}).get('ms', 0)} | "
                        f"{dec.get('n', '-')} / {dec.get('mean_ms', '-')} / {dec.get('busy_fraction', '-')} | "
                        f"{mix.get('n', '-')} / {mix.get('mean_ms', '-')} / {mix.get('busy_fraction', '-')} | "
                        f"{bt.get('running_mean', '-')} / {bt.get('decode_tokens_per_ms', '-')} |")
    if not rows:
        return ""
    return ("\n\n| case (trace) | GPU window ms | compute stream busy | its idle ms | idle gaps > 1 ms (n / ms) | "
            "tutti kernels ms | copies HtoD / DtoH ms | decode steps (n / mean ms / busy) | "
            "steps that prefill (n / mean ms / busy) | requests in a step (mean) / tokens decoded per ms |"
            "\n|---|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows))


def host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(cases: list[str], a) -> None:
    """Servers that start together each hold --capacity of host memory (the OffloadingConnector
    pins it, a /dev/shm root maps it): refuse before starting any when it is not there, instead of
    engine cores killed mid-start (what leftover /dev/shm roots of another command did once)."""
    held = [c for c in cases if c in ("offloading",) + TIERED or c.startswith(("tutti_shm", "tutti_tiered"))]
    need = a.capacity_bytes * (1 if a.sequential else len(held))
    have = host_memory_available()
    if held and have is not None and need > have:
        raise SystemExit(f"--cases {','.join(held)}: they hold {need / 2**30:.0f} GiB of host memory at once "
                         f"(--capacity {a.capacity} each) and {have / 2**30:.0f} GiB is available; run with "
                         "--sequential, a smaller --capacity, or free /dev/shm (leftover roots: ls /dev/shm)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/serve_workload")
    ap.add_argument("--cases", default="none,offloading,tutti_shm,tutti_disk")
    ap.add_argument("--workload", default="prefix_repetition", choices=["prefix_repetition", "multi_turn", "zipf",
                                                                         "uniform"])
    ap.add_argument("--zipf-s", type=float, default=1.0, help="the zipf workload's exponent")
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke run: a tiny seeded Llama, short prompts")
    ap.add_argument("--geometry", default="8b", choices=["8b", "70b"])
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--capacity", default="32GiB", help="the RAM each case gets: the CPU tier's, a /dev/shm root's, "
                    "the first tier's of tutti_tiered")
    ap.add_argument("--disk-capacity", default="", help="a disk root's and a disk tier's capacity (default: --capacity)")
    ap.add_argument("--kv-cache-bytes", type=int, default=8 << 30, help="vLLM's GPU KV cache (--kv-cache-memory-bytes)")
    ap.add_argument("--shm-root", default="/dev/shm/tutti-serve")
    ap.add_argument("--disk-root", default="/tmp/tutti-serve-disk")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--tutti-extra", default="{}", help="more kv_connector_extra_config keys for tutti, as JSON")
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--num-prefixes", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--server-args", default="", help="more `vllm serve` arguments for every case's server, e.g. "
                    "'--no-async-scheduling' (hits then load layer-wise, overlapped with the batch's compute)")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--bench-timeout", type=float, default=900)
    ap.add_argument("--sequential", action="store_true", help="start each case's server after the last one stopped")
    ap.add_argument("--start-stagger", type=float, default=5.0, help="seconds between the servers' starts")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                    help="each server's share (vLLM refuses to start when less is free); the KV cache is "
                         "--kv-cache-bytes whatever this is")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="trace this many engine steps of each server with vLLM's torch profiler and put a summary "
                         "of its GPU streams in the results (bench/trace_summary.py); 0 (default): off")
    ap.add_argument("--profile-delay", type=int, default=300, help="engine steps into the client's run the trace starts")
    ap.add_argument("--keep-roots", action="store_true", help="keep each tutti case's root after its case (removed by default)")
    ap.add_argument("--keep-traces", action="store_true", help="keep the traces (tens of MB each) beside the results")
    ap.add_argument("--py-spy", default="", help="sample who holds the GIL in each server while its client runs "
                    "(py-spy --gil; 'auto' finds it on PATH or in .gpu_pytest/bin); off by default")
    a = ap.parse_args()
    a.py_spy_bin = None
    if a.py_spy:
        a.py_spy_bin = find_py_spy(a.py_spy)
        if a.py_spy_bin is None:
            raise SystemExit(f"--py-spy {a.py_spy!r}: no py-spy executable found; pip install py-spy, or "
                             "run scripts/gpu_pytest_bundle.sh for the GPU machine")
    if a.tiny:
        for k, v in dict(prefix_len=384, suffix_len=32, num_prefixes=6, repeats=2, output_len=4, conversations=3,
                         turns=2, turn_len=64, concurrency=2, capacity="256MiB", chunk_tokens=64).items():
            if getattr(a, k) == ap.get_default(k):
                setattr(a, k, v)
    from tutti.engine.config.settings import parse_bytes

    a.capacity_bytes = parse_bytes("capacity", a.capacity)
    a.disk_capacity_bytes = parse_bytes("disk-capacity", a.disk_capacity) if a.disk_capacity else a.capacity_bytes
    a.vocab = 512 if a.tiny else 32000
    if a.workload != "multi_turn":
        a.max_len = a.prefix_len + a.suffix_len + a.output_len + 64
    else:
        a.max_len = a.prefix_len + (a.turns - 1) * a.turn_len + a.output_len + 64
    os.makedirs(a.out, exist_ok=True)
    model = prepare_model(a)
    dataset = None
    if a.workload == "multi_turn":
        dataset = os.path.join(a.out, "multi_turn.jsonl")
        multi_turn_dataset(dataset, a)
    elif a.workload in ("zipf", "uniform"):
        dataset = os.path.join(a.out, f"{a.workload}.jsonl")
        popularity_dataset(dataset, a)
    a.plugin_site = plugin_site(a.out)
    cases = a.cases.split(",")
    check_host_memory(cases, a)
    results = []
    # Every case's server starts at once (each holds its own GPU memory: weights, its KV cache
    # and the connector's buffers); the benchmarks then run one at a time, so each has the GPU to
    # itself while the idle servers wait on their sockets. --sequential starts each in turn.
    servers: dict[str, Server] = {}
    try:
        if not a.sequential:
            for i, case in enumerate(cases):
                servers[case] = Server(case, a, model, a.port + i)
                time.sleep(a.start_stagger)
        for i, case in enumerate(cases):
            srv = servers.get(case) or Server(case, a, model, a.port + i)
            servers[case] = srv
            r = bench_case(srv, a, model, dataset)
            # a case's server and root go once its client is done: the later cases get the GPU's
            # memory back, and disk roots of several cases need not fit the disk together
            srv.stop()
            if not a.keep_roots:
                for d in roots_of(case, a):
                    shutil.rmtree(d, ignore_errors=True)
            r["server_log_tail"] = srv.log_tail()
            results.append(r)
            print("SERVE " + json.dumps({k: v for k, v in r.items() if k != "server_log_tail"}), flush=True)
            # written after every case: a call that runs out of time still brings back the cases it ran
            md = table(results) + profile_table(results)
            with open(os.path.join(a.out, f"serve_{a.workload}.json"), "w") as f:
                json.dump({"args": {k: v for k, v in vars(a).items()}, "results": results}, f, indent=1)
            with open(os.path.join(a.out, f"serve_{a.workload}.md"), "w") as f:
                f.write(md + "\n")
    finally:
        for srv in servers.values():
            srv.stop()
    print(md)


if __name__ == "__main__":
    main()
