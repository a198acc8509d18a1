"""bench/serve_workload.py's pieces that need no server: the short-word tokenizer (vLLM refuses
prompts of more than about 6 characters a token) and the /metrics parser."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import serve_workload as sw  # noqa: E402


def test_short_words_are_unique_and_at_most_three_characters():
    words = [sw.short_word(i) for i in range(4, 32000)]
    assert len(set(words)) == len(words)
    assert max(map(len, words)) <= 3 and all(w.isalnum() for w in words)


def test_metrics_are_summed_over_label_sets():
    text = "\n".join([
        "# HELP vllm:tutti_hit_tokens_total tokens",
        'vllm:tutti_hit_tokens_total{engine="0",model_name="m"} 256.0',
        'vllm:tutti_hit_tokens_total{engine="1",model_name="m"} 64.0',
        'vllm:tutti_hit_tokens_created{engine="0"} 1.7e9',
        'vllm:prefix_cache_hits_total{engine="0"} 32',
        "vllm:tutti_skipped_stores_total 3",
    ])
    m = sw.parse_metrics(text)
    assert m["vllm:tutti_hit_tokens"] == 320 and m["vllm:prefix_cache_hits"] == 32
    assert m["vllm:tutti_skipped_stores"] == 3 and m["vllm:external_prefix_cache_hits"] == 0


def test_declined_tokens_are_kept_apart_by_reason():
    text = "\n".join([
        'vllm:tutti_declined_hit_tokens_by_reason_total{engine="0",model_name="m",reason="rate"} 100.0',
        'vllm:tutti_declined_hit_tokens_by_reason_total{engine="0",model_name="m",reason="queue"} 28.0',
        'vllm:tutti_declined_hit_tokens_total{engine="0",model_name="m"} 128.0',
    ])
    m = sw.parse_metrics(text)
    assert m["vllm:tutti_declined_hit_tokens_by_reason:rate"] == 100
    assert m["vllm:tutti_declined_hit_tokens_by_reason:queue"] == 28
    assert m["vllm:tutti_declined_hit_tokens_by_reason:unmeasured"] == 0 and m["vllm:tutti_declined_hit_tokens"] == 128


def test_variants_get_roots_of_their_own_and_their_keys():
    class A:
        shm_root, disk_root, capacity_bytes, chunk_tokens, tutti_extra = "/dev/shm/t", "/tmp/d", 1 << 30, 256, "{}"
        disk_capacity_bytes = 4 << 30

    roots = {c: sw.connector(c, A)["kv_connector_extra_config"]["root"] for c in ["tutti_shm", "tutti_disk", *sw.VARIANTS]
             if not c.startswith("tutti_tiered")}
    assert len(set(roots.values())) == len(roots)  # servers started together never share a root
    assert sw.connector("tutti_shm_stores_only", A)["kv_connector_extra_config"]["hit_policy"] == "never"
    assert sw.connector("none", A) is None
    every = [d for c in ["tutti_shm", "tutti_disk", *sw.VARIANTS, *sw.TIERED] for d in sw.roots_of(c, A)]
    assert len(set(every)) == len(every)
    assert sw.connector("tutti_tiered_back", A)["kv_connector_extra_config"]["write_policy"] == "back"
    # the hierarchies: the same RAM in front, the disk's capacity behind
    tiers = sw.connector("tutti_tiered", A)["kv_connector_extra_config"]["tiers"]
    assert [t["capacity_bytes"] for t in tiers] == [1 << 30, 4 << 30] and tiers[0]["root"].startswith("/dev/shm")
    fs = sw.connector("tier_fs", A)["kv_connector_extra_config"]
    assert fs["cpu_bytes_to_use"] == 1 << 30 and fs["secondary_tiers"][0]["type"] == "fs"
    assert sw.connector("tier_tutti", A)["kv_connector_extra_config"]["secondary_tiers"][0]["capacity_bytes"] == 4 << 30
    assert sw.connector("tutti_disk", A)["kv_connector_extra_config"]["capacity_bytes"] == 4 << 30


@pytest.mark.parametrize("workload", ["zipf", "uniform"])
def test_popularity_datasets_repeat_prefixes_as_asked(tmp_path, workload):
    import collections
    import json

    class A:
        num_prefixes, repeats, prefix_len, suffix_len, output_len, vocab, zipf_s = 20, 5, 50, 4, 8, 512, 1.0

    A.workload = workload
    path = tmp_path / "d.jsonl"
    assert sw.popularity_dataset(str(path), A) == 100
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    counts = collections.Counter(" ".join(r["prompt"].split()[:50]) for r in rows)
    assert len(rows) == 100 and len({r["prompt"] for r in rows}) == 100  # every suffix fresh
    if workload == "uniform":
        assert sorted(counts.values()) == [5] * 20
    else:  # skewed: the most popular prefix far above the uniform share, the tail rarely drawn
        assert counts.most_common(1)[0][1] >= 15 and len(counts) < 20


def test_none_gpu_gives_vllms_own_cache_the_tiers_capacity_and_no_connector():
    class A:
        tiny, max_len, capacity_bytes, kv_cache_bytes, gpu_memory_utilization, profile_steps = \
            False, 4288, 32 << 30, 8 << 30, 0.2, 0

    def kv_bytes(case):
        cmd = sw.server_cmd(A, "/m", sw.connector(case, A), 8100, case)
        return int(cmd[cmd.index("--kv-cache-memory-bytes") + 1]), "--kv-transfer-config" in cmd

    assert kv_bytes("none_gpu") == (32 << 30, False)  # the most a connector of that capacity could reach
    assert kv_bytes("none") == (8 << 30, False)
    A.tiny = True
    tiny = sw.server_cmd(A, "/m", None, 8100, "none_gpu")
    assert "--num-gpu-blocks-override" not in tiny and "--num-gpu-blocks-override" in sw.server_cmd(A, "/m", None, 8100, "none")


def test_gil_samples_of_a_spawned_engine_core_are_its_own_process(tmp_path):
    """py-spy's collapsed stacks split frames at ';', and the engine core's command line (vLLM
    spawns it with `-c "from multiprocessing.spawn import spawn_main; spawn_main(...)"`) holds
    one: its threads were counted under the API server's process."""
    import gil_profile as gp

    server = 'process 548:"python3 -m vllm.entrypoints.openai.api_server --port 8102"'
    core = 'process 966:"python3 -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=46) --multiprocessing-fork"'
    f = tmp_path / "gil.txt"
    f.write_text("\n".join([
        f"{server};thread (1): MainThread;step (detokenizer.py:225) 30",
        f"{server};{core};thread (7): tutti-async-loads;upload (tutti/engine/worker/context.py:96) 10",
        f"{server};{core};thread (6): MainThread;execute_model (core.py:1403) 20",
    ]) + "\n")
    s = gp.summarize(str(f), seconds=1.0, rate=100)
    procs = {k.split()[0]: v for k, v in s["processes"].items()}
    assert set(procs) == {"548", "966"}
    assert procs["548"]["threads"]["MainThread"]["samples"] == 30 and "tutti-async-loads" not in procs["548"]["threads"]
    assert procs["966"]["threads"]["tutti-async-loads"]["share"] == 0.1 and procs["966"]["gil_share"] == 0.3
    assert gp.tutti_share(s) == 0.1


def test_a_profiler_trace_is_summarised_by_stream_gap_and_kernel(tmp_path):
    """bench/trace_summary.py on a real torch profiler trace (this machine has no GPU: its steps are
    vLLM-style `execute_*` annotations) with GPU events added as CUPTI writes them."""
    import json

    import torch
    import trace_summary as ts

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for i in range(3):
            with torch.profiler.record_function(f"execute_context_0(0)_generation_{i}({i})"):
                torch.ones(64).sum()
    path = tmp_path / "rank0.x.pt.trace.json"
    prof.export_chrome_trace(str(path))
    data = json.loads(path.read_text())
    k = lambda ts_, dur, name, tid=7: {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": tid,  # noqa: E731
                                       "ts": ts_, "dur": dur}
    data["traceEvents"] += [k(0, 100, "gemm"), k(150, 100, "gemm"), k(2250, 100, "attn"),  # gaps: 50 us, 2000 us
                            k(160, 30, "_paged_copy_kernel_0d1", tid=9), k(200, 20, "_checksum_kernel", tid=9),
                            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "pid": 0,
                             "tid": 11, "ts": 300, "dur": 500, "args": {"bytes": 2_000_000_000}},
                            # the steps on the GPU's timeline: a decode-only one, one that also prefills
                            {"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_0(0)_generation_2(2)",
                             "pid": 0, "tid": 7, "ts": 0, "dur": 250},
                            {"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_1(128)_generation_1(1)",
                             "pid": 0, "tid": 7, "ts": 2000, "dur": 400}]
    path.write_text(json.dumps(data))
    s = ts.summarize(ts.load_events(str(path)))
    assert s["steps"]["n"] == 3
    assert s["streams"][0]["stream"] == "7" and s["streams"][0]["kernels"] == 3
    assert s["compute"]["idle_ms"] == 2.05 and s["compute"]["gaps_over_1000us"] == {"n": 1, "ms": 2.0}
    assert s["compute"]["gaps_over_50us"]["n"] == 1  # 50 us is not over 50
    assert s["tutti_kernels"] == {"n": 2, "ms": 0.05, "streams": ["9"]}
    assert s["copies"]["HtoD"] == {"n": 1, "ms": 0.5, "GB": 2.0}
    assert s["gpu_steps"]["decode"] == {"n": 1, "mean_ms": 0.25, "busy_fraction": 0.8}  # 200 of 250 us
    assert s["gpu_steps"]["prefill+decode"] == {"n": 1, "mean_ms": 0.4, "busy_fraction": 0.25}  # 100 of 400 us
    # two requests in each step (2 decoding; 1 prefilling 128 tokens + 1 decoding): 3 tokens in 0.65 ms
    assert s["batch"] == {"running_mean": 2.0, "prefill_requests": 1, "prefill_tokens": 128, "decode_tokens": 3,
                          "decode_tokens_per_ms": round(3 / 0.65, 4)}
    assert ts.find_traces(str(tmp_path)) == [str(path)]


def test_the_profile_table_puts_each_servers_trace_on_a_row():
    import serve_workload as sw

    prof = {"window_ms": 1772.4, "compute": {"busy_fraction": 0.82, "idle_ms": 321.9,
                                             "gaps_over_1000us": {"n": 42, "ms": 127.8}},
            "tutti_kernels": {"ms": 9.3}, "copies": {"HtoD": {"ms": 163.7}, "DtoH": {"ms": 35.2}},
            "gpu_steps": {"decode": {"n": 192, "mean_ms": 6.576, "busy_fraction": 0.85},
                          "prefill+decode": {"n": 20, "mean_ms": 30.744, "busy_fraction": 0.71}},
            "batch": {"running_mean": 6.479, "decode_tokens_per_ms": 0.7793}}
    table = sw.profile_table([{"case": "tutti_shm", "profile": [prof]}, {"case": "none"}])
    header, rule, row = table.strip().splitlines()
    assert header.count("|") == rule.count("|") == row.count("|") == 11
    assert row.startswith("| tutti_shm | 1772.4 | 0.82 |") and row.endswith("| 6.479 / 0.7793 |")


def test_a_server_ready_past_its_deadline_counts_as_ready():
    """Servers start together and wait while earlier cases' clients run: one that is up by then
    is ready even with its start-up deadline passed; one that never answers still times out."""
    import http.server
    import socketserver
    import subprocess
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = socketserver.TCPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        sw.wait_ready(srv.server_address[1], proc, timeout=-26)  # answers: ready
        srv.shutdown()
        srv.server_close()
        with pytest.raises(TimeoutError, match="start-up deadline"):
            sw.wait_ready(srv.server_address[1], proc, timeout=-26)  # nobody answers
    finally:
        proc.kill()
        proc.wait()


def test_disk_delta_reads_the_device_that_holds_a_path(tmp_path):
    """The per-case disk figures come from the block device under the disk root (or none, on an
    overlay or tmpfs), and their rates are the counters' differences over the run's duration."""
    name = sw.block_device(str(tmp_path / "not" / "yet"))
    stats = sw.diskstats(name)
    if name is not None and stats is not None:
        assert set(stats) == {"read_bytes", "write_bytes", "busy_ms"} and stats["busy_ms"] >= 0
    d = sw.disk_delta({"read_bytes": 0, "write_bytes": 0, "busy_ms": 0},
                      {"read_bytes": 4e9, "write_bytes": 2e9, "busy_ms": 1500}, 2.0)
    assert d == {"read_gb": 4.0, "write_gb": 2.0, "read_gbps": 2.0, "write_gbps": 1.0, "busy": 0.75}
    assert sw.disk_delta(None, stats, 2.0) is None
    assert sw.disk_cell(d) == "4.0 / 2.0, 75%"


def test_wait_cell_is_a_hits_mean_wait_from_tuttis_or_vllms_counters():
    assert sw.wait_cell({"vllm:tutti_async_wait_seconds": 3.0, "vllm:tutti_async_waits": 4}) == "750 (4)"
    assert sw.wait_cell({"vllm:kv_offload_lookup_async_delay_seconds_sum": 0.5,
                         "vllm:kv_offload_lookup_async_delay_seconds_count": 2}) == "250 (2)"
    assert sw.wait_cell({"vllm:tutti_async_waits": 0}) == "-"
    m = sw.parse_metrics('vllm:tutti_async_wait_seconds_total{engine="0"} 1.5\n'
                         'vllm:kv_offload_lookup_async_delay_seconds_count{engine="0"} 3.0\n')
    assert m["vllm:tutti_async_wait_seconds"] == 1.5 and m["vllm:kv_offload_lookup_async_delay_seconds_count"] == 3.0


def test_request_ttfts_keep_the_datasets_order_and_give_the_p90():
    out = sw.request_ttfts({"ttfts": [0.3, 0.1, 0.0, 2.0] + [0.2] * 6})
    assert out["ttfts_ms"][:4] == [300.0, 100.0, None, 2000.0]  # the failed request (0.0) kept as None
    assert len(out["ttfts_ms"]) == 10
    assert out["p90_ttft_ms"] == 2000.0
    assert sw.request_ttfts({}) == {}
    assert sw.request_ttfts({"ttfts": [0.0]}) == {}


def test_ttft_by_send_keeps_each_prefixs_first_send_apart_from_its_repeats():
    out = sw.ttft_by_send([900.0, 800.0, 100.0, 700.0, 200.0, 300.0], [0, 1, 0, 2, 1, 0])
    assert out["ttft_first_sends_ms"] == {"n": 3, "mean": 800.0, "p50": 800.0, "p90": 900.0}
    assert out["ttft_repeats_ms"] == {"n": 3, "mean": 200.0, "p50": 200.0, "p90": 300.0}
    assert sw.ttft_by_send([None, 5.0], [0, 0])["ttft_repeats_ms"]["n"] == 1  # a failed first send still was one
    assert sw.ttft_by_send([1.0], [0, 1]) == {}  # lengths differ: nothing lines up
    assert sw.ttft_by_send(None, [0]) == {}


def test_the_popularity_dataset_records_which_prefix_each_request_sends(tmp_path):
    a = argparse.Namespace(workload="zipf", num_prefixes=5, repeats=4, prefix_len=3, suffix_len=2,
                           output_len=4, zipf_s=1.0, vocab=512)
    n = sw.popularity_dataset(str(tmp_path / "z.jsonl"), a)
    rows = [json.loads(x)["prompt"] for x in (tmp_path / "z.jsonl").read_text().splitlines()]
    assert n == len(rows) == len(a.prefix_order) == 20
    for row, i in zip(rows, a.prefix_order):  # the same prefix index, the same first words
        j = a.prefix_order.index(i)
        assert row.split()[:3] == rows[j].split()[:3]


def test_the_ttft_cell_adds_the_p90_and_first_sends_against_repeats_where_recorded():
    r = {"mean_ttft_ms": 596.2, "median_ttft_ms": 290.1, "p99_ttft_ms": 4158.0}
    assert sw.ttft_cell(r) == "596 / 290 / - / 4158"
    r.update({"p90_ttft_ms": 1500.0, "ttft_first_sends_ms": {"n": 30, "mean": 1800.4},
              "ttft_repeats_ms": {"n": 98, "mean": 230.0}})
    assert sw.ttft_cell(r) == "596 / 290 / 1500 / 4158; 1800 / 230"


def test_the_tpot_cell_adds_a_requests_mean_latency_where_recorded():
    r = {"mean_tpot_ms": 19.24, "p99_tpot_ms": 30.0}
    assert sw.tpot_cell(r) == "19.2 / 30.0"
    assert sw.tpot_cell({**r, "mean_e2el_ms": 2618.5}) == "19.2 / 30.0; 2618"


def test_staged_hits_are_parsed_and_shown_in_the_tier_cell():
    m = sw.parse_metrics('vllm:tutti_tier_hit_tokens_total{tier="0"} 544\n'
                         'vllm:tutti_tier_staged_hits_total{engine="0"} 3\n')
    assert m["vllm:tutti_tier_staged_hits"] == 3
    assert sw.tier_cell(m).endswith("(3 hits staged)")
    assert "staged" not in sw.tier_cell({**m, "vllm:tutti_tier_staged_hits": 0})


def test_engine_steps_and_decode_only_steps_come_from_vllms_tokens_per_step_histogram():
    """vLLM's tokens-per-step histogram: its count is the engine's steps, its bucket of at most 8
    tokens the steps that computed no prompt token (at most 8 requests at once)."""
    text = ('vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3\n'
            'vllm:iteration_tokens_total_bucket{engine="0",le="8.0"} 70\n'
            'vllm:iteration_tokens_total_bucket{engine="0",le="16.0"} 71\n'
            'vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 100\n'
            'vllm:iteration_tokens_total_count{engine="0"} 100\n'
            'vllm:iteration_tokens_total_sum{engine="0"} 52000\n')
    m = sw.parse_metrics(text)
    assert m["vllm:iteration_tokens_total_count"] == 100 and m["vllm:iteration_tokens_total:decode_only"] == 70
    assert sw.steps_cell(m) == "100 (70)" and sw.steps_cell(sw.parse_metrics("")) == "-"


def test_prompt_tokens_are_kept_apart_by_the_source_vllm_counts():
    """vLLM counts each prompt token once, by where it came from: computed, its own GPU prefix
    cache, or the connector; summed over engines, kept apart by source."""
    text = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 700\n'
            'vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 300\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 64\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 2048\n')
    m = sw.parse_metrics(text)
    assert sw.sources_cell(m) == "1000 / 64 / 2048" and sw.sources_cell(sw.parse_metrics("")) == "-"
