"""tutti's connector stats, Prometheus metrics, start-up log line and NVTX ranges.

The end-to-end test starts a real `vllm serve` OpenAI server (CPU, tiny model, real files,
real io_uring) as a subprocess and reads its /metrics.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import harness

pytest.importorskip("vllm")

from tutti.vllm.stats import (  # noqa: E402
    METRICS,
    SchedulerStatsTracker,
    TuttiKVConnectorStats,
    TuttiPromMetrics,
    stats_from,
)

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ stats objects
def test_stats_aggregate_sums_counters_and_keeps_latest_gauge():
    a = TuttiKVConnectorStats(data={"bytes_loaded": 100, "hit_tokens": 64, "capacity_used_bytes": 10})
    b = TuttiKVConnectorStats(data={"bytes_loaded": 50, "bytes_stored": 7, "capacity_used_bytes": 30})
    out = a.aggregate(b)
    assert out is a
    assert a.data == {"bytes_loaded": 150, "hit_tokens": 64, "bytes_stored": 7, "capacity_used_bytes": 30}
    assert a.aggregate(TuttiKVConnectorStats()).data == a.data  # empty other: unchanged
    red = a.reduce()
    assert red["bytes_loaded"] == 150 and red["capacity_used_bytes"] == 30
    a.reset()
    assert a.is_empty() and a.data == {}


def test_stats_is_empty_and_reduce_rates():
    assert TuttiKVConnectorStats(data={"bytes_loaded": 0}).is_empty()
    assert not TuttiKVConnectorStats(data={"capacity_used_bytes": 0}).is_empty()  # a gauge is news
    s = TuttiKVConnectorStats(data={"queried_tokens": 400, "hit_tokens": 100,
                                    "bytes_loaded": 2_000_000_000, "load_seconds": 1.0})
    r = s.reduce()
    assert r["hit_rate"] == 0.25 and r["load_GBps"] == 2.0
    assert stats_from({"bytes_loaded": 0, "bytes_stored": 0}) is None
    assert stats_from({"bytes_loaded": 5, "bytes_stored": 0}).data == {"bytes_loaded": 5}


def test_stats_refuse_unknown_fields_and_other_types():
    with pytest.raises(ValueError, match="unknown field 'load_byte'"):
        TuttiKVConnectorStats(data={"load_byte": 1})
    with pytest.raises(ValueError, match="expected a number"):
        TuttiKVConnectorStats(data={"bytes_loaded": "1"})
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    other = OffloadingConnectorStats()
    other.increase_counter("x", 1)
    with pytest.raises(TypeError, match="OffloadingConnectorStats"):
        TuttiKVConnectorStats(data={"bytes_loaded": 1}).aggregate(other)


def test_stats_payload_survives_vllm_msgpack_and_rebuilds_through_the_connector_class():
    """The payload crosses vLLM's engine-core -> API-server hop as msgpack (SchedulerStats)."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from tutti.vllm.connector import TuttiConnectorV1

    s = TuttiKVConnectorStats(data={"bytes_loaded": 3, "load_seconds": 0.5, "capacity_used_bytes": 9})
    wire = MsgpackEncoder().encode(s.to_dict())
    back = MsgpackDecoder(dict).decode(wire)
    rebuilt = TuttiConnectorV1.build_kv_connector_stats(back)
    assert isinstance(rebuilt, TuttiKVConnectorStats) and rebuilt.data == s.data
    assert TuttiConnectorV1.build_kv_connector_stats(None).is_empty()


def test_scheduler_tracker_sends_deltas_and_gauges_only_on_change():
    from tutti.engine.sched.planner import PlannerStats

    ps = PlannerStats()
    t = SchedulerStatsTracker(capacity_bytes=1000)
    first = t.take(ps, 0)
    assert first.data == {"capacity_used_bytes": 0, "capacity_bytes": 1000}
    assert t.take(ps, 0) is None  # nothing new
    ps.queried_tokens, ps.hit_tokens, ps.evictions, ps.loads_failed, ps.stores_committed = 300, 128, 2, 1, 4
    s = t.take(ps, 512)
    assert s.data == {"queried_tokens": 300, "hit_tokens": 128, "evictions": 2, "loads_failed": 1,
                      "stores_committed": 4, "capacity_used_bytes": 512}
    ps.queried_tokens += 10
    assert t.take(ps, 512).data == {"queried_tokens": 10}
    assert ps.queried_tokens == 310  # the planner's own counters stay cumulative


def _private_metric_types():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    return reg, {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
                 Histogram: functools.partial(Histogram, registry=reg)}


def test_prom_metrics_observe_counts_and_sets_per_engine():
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    reg, types = _private_metric_types()
    cfg = SimpleNamespace(kv_transfer_config=None)
    prom = TuttiPromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"bytes_stored": 4096, "hit_tokens": 64, "capacity_used_bytes": 8192}, engine_idx=0)
    prom.observe({"bytes_stored": 4096, "capacity_used_bytes": 100}, engine_idx=0)
    prom.observe({"bytes_stored": 1}, engine_idx=1)
    text = generate_latest(reg).decode()
    assert 'vllm:tutti_store_bytes_total{engine="0",model_name="m"} 8192.0' in text
    assert 'vllm:tutti_store_bytes_total{engine="1",model_name="m"} 1.0' in text
    assert 'vllm:tutti_hit_tokens_total{engine="0",model_name="m"} 64.0' in text
    assert 'vllm:tutti_capacity_used_bytes{engine="0",model_name="m"} 100.0' in text
    for m in METRICS:  # every metric is registered, with its help text
        assert f"# HELP {m.exposed_name} " in text or f"# HELP {m.name} " in text, m.name


def test_declined_tokens_carry_their_reason_as_a_label():
    """One counter, vllm:tutti_declined_hit_tokens_by_reason, a `reason` label per cause; the
    scheduler sends the planner's per-reason deltas beside the total."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from tutti.engine.sched.planner import PlannerStats

    reg, types = _private_metric_types()
    prom = TuttiPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    ps = PlannerStats()
    t = SchedulerStatsTracker(capacity_bytes=1000)
    t.take(ps, 0)
    ps.declined_hit_tokens, ps.declined_unmeasured_tokens, ps.declined_queue_tokens = 320, 256, 64
    prom.observe(t.take(ps, 0).data)
    text = generate_latest(reg).decode()
    assert 'vllm:tutti_declined_hit_tokens_by_reason_total{engine="0",model_name="m",reason="unmeasured"} 256.0' in text
    assert 'vllm:tutti_declined_hit_tokens_by_reason_total{engine="0",model_name="m",reason="queue"} 64.0' in text
    assert 'vllm:tutti_declined_hit_tokens_total{engine="0",model_name="m"} 320.0' in text


def test_tier_counters_carry_their_tier_as_a_label():
    """With tiers, the scheduler sends each tier's hits, evictions and write-downs as deltas."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest

    from tutti.engine.sched.planner import PlannerStats
    from tutti.engine.sched.tiers import TierStats

    reg, types = _private_metric_types()
    prom = TuttiPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], {0: ["m", "0"]})
    ps, tiers = PlannerStats(), TierStats.new(2)
    t = SchedulerStatsTracker(capacity_bytes=1000)
    t.take(ps, 0, tiers=tiers)
    tiers.hit_tokens[0], tiers.hit_tokens[1], tiers.writedowns[1], tiers.promotions = 512, 256, 3, 2
    tiers.hit_bytes[1], tiers.borrowed = 4096, 1
    prom.observe(t.take(ps, 0, tiers=tiers).data)
    tiers.hit_tokens[1] += 64
    assert t.take(ps, 0, tiers=tiers).data == {"tier1_hit_tokens": 64}  # deltas
    text = generate_latest(reg).decode()
    assert 'vllm:tutti_tier_hit_tokens_total{engine="0",model_name="m",tier="0"} 512.0' in text
    assert 'vllm:tutti_tier_hit_tokens_total{engine="0",model_name="m",tier="1"} 256.0' in text
    assert 'vllm:tutti_tier_writedowns_total{engine="0",model_name="m",tier="1"} 3.0' in text
    assert 'vllm:tutti_tier_promotions_total{engine="0",model_name="m"} 2.0' in text
    assert 'vllm:tutti_tier_hit_bytes_total{engine="0",model_name="m",tier="1"} 4096.0' in text
    assert 'vllm:tutti_tier_borrowed_total{engine="0",model_name="m"} 1.0' in text


# ------------------------------------------------------------------ NVTX
def test_nvtx_range_is_a_shared_noop_on_cpu(monkeypatch):
    import torch

    from tutti.engine.worker import context

    if torch.cuda.is_available():
        pytest.skip("CUDA present: ranges are real")
    context._nvtx_backend.cache_clear()
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or False)

    def boom(*a, **k):
        raise AssertionError("NVTX called on the CPU")

    monkeypatch.setattr(torch.cuda.nvtx, "range", boom)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", boom)
    try:
        ctxs = {id(context.nvtx_range("read", i)) for i in range(1000)}
        with context.nvtx_range("scatter", 3), context.nvtx_range("commit"):
            pass
        # cheap: one shared null context, CUDA probed once for all calls
        assert ctxs == {id(context._NULL)} and len(calls) == 1
    finally:
        context._nvtx_backend.cache_clear()


def test_nvtx_uses_tutti_prefix_when_cuda_is_present(monkeypatch):
    import torch

    from tutti.engine.worker import context

    context._nvtx_backend.cache_clear()
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda msg: seen.append(msg) or context._NULL)
    monkeypatch.setitem(sys.modules, "nvtx", None)  # the nvtx package absent: torch with a prefix
    try:
        context.nvtx_range("load_wait", 5)
        context.nvtx_range("commit")
    finally:
        context._nvtx_backend.cache_clear()
    assert seen == ["tutti:load_wait.L5", "tutti:commit"]


def test_every_pipeline_stage_has_an_nvtx_range():
    src = "".join(p.read_text() for p in sorted((ROOT / "tutti" / "engine" / "worker").rglob("*.py")))
    stages = set(re.findall(r'nvtx_range\("([a-z_0-9]+)"', src))
    assert {"read", "io_wait", "load_wait", "verify", "scatter", "gather", "d2h_wait", "write", "commit"} <= stages, stages


# ------------------------------------------------------------------ a real server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def _metric(text: str, name: str) -> float:
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    assert vals, f"{name} not on /metrics"
    return sum(vals)


def _start_server(cmd, env, log_path):
    """A server process group, once /health answers (fails the test with its log otherwise)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                start_new_session=True)
    port = cmd[cmd.index("--port") + 1]
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited rc={proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            _stop_server(proc)
            pytest.fail(f"server not up in 120 s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)


def _stop_server(proc):
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_metrics_and_startup_line_on_a_running_vllm_server(tiny_model, tmp_path):
    """vLLM's OpenAI server started as the README says (`tutti serve`, the engine core in its own
    process), completions over HTTP with token-id prompts; then the server is stopped and a new
    one started over the same root: it hits what the first stored, with the same text. The tiny
    model's seeded weights make the text depend on the KV cache."""
    port = _free_port()
    kvt = {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"root": str(tmp_path / "kv"), "capacity_bytes": "64MiB", "chunk_tokens": 64}}
    env = dict(os.environ)
    env.update(harness.ENV_DEFAULTS)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the API server runs the engine core in its own process
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    # vLLM's own prefix cache off: the second request's prefix must come from tutti
    cmd = [sys.executable, "-m", "tutti", "serve", str(tiny_model),
           "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4",
           "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(kvt)]
    log_path = tmp_path / "server.log"
    base = f"http://127.0.0.1:{port}"
    proc = _start_server(cmd, env, log_path)
    try:
        rng = random.Random(7)
        shared = [rng.randrange(4, 500) for _ in range(300)]  # 4 whole chunks of 64 tokens
        body = {"model": str(tiny_model), "prompt": shared, "max_tokens": 4, "temperature": 0.0}
        first = _post(base + "/v1/completions", body)
        # let the first request's stores become durable and be reported (a step must run after
        # the writer finished): poll /metrics while sending tiny requests
        deadline = time.monotonic() + 30
        while True:
            text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            if "vllm:tutti_stored_chunks_total" in text and _metric(text, "vllm:tutti_stored_chunks_total") >= 4:
                break
            assert time.monotonic() < deadline, "stores never committed"
            _post(base + "/v1/completions", {**body, "prompt": [5, 6, 7], "max_tokens": 1})
        second = _post(base + "/v1/completions", body)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    finally:
        _stop_server(proc)
    restarted_log = tmp_path / "server2.log"
    proc = _start_server(cmd, env, restarted_log)
    try:
        third = _post(base + "/v1/completions", body)
        restarted = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    finally:
        _stop_server(proc)
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
    assert _metric(restarted, "vllm:tutti_hit_tokens_total") == 4 * 64  # the restarted server's own count
    seg = 64 * 2 * 2 * 64 * 4  # tokens x KV heads x (K|V) x head_dim x fp32
    assert _metric(text, "vllm:tutti_store_bytes_total") >= 4 * 2 * seg  # 4 chunks x 2 layers
    assert _metric(text, "vllm:tutti_hit_tokens_total") == 4 * 64
    assert _metric(text, "vllm:tutti_load_bytes_total") == 4 * 2 * seg
    # host costs are counted (tutti.engine.hostcost): both halves' hooks, and the writer's thread
    assert _metric(text, "vllm:tutti_worker_hook_seconds_total") > 0
    assert _metric(text, "vllm:tutti_scheduler_hook_seconds_total") > 0
    assert _metric(text, "vllm:tutti_worker_thread_cpu_seconds_total") > 0
    assert _metric(text, "vllm:tutti_queried_tokens_total") >= 600
    assert _metric(text, "vllm:tutti_failed_loads_total") == 0
    assert _metric(text, "vllm:tutti_capacity_used_bytes") == 4 * 2 * seg
    assert _metric(text, "vllm:tutti_capacity_bytes") > 0
    for name in ("vllm:tutti_load_seconds_total", "vllm:tutti_store_seconds_total",
                 "vllm:tutti_evictions_total", "vllm:tutti_skipped_stores_total"):
        assert name in text
    assert _metric(text, "vllm:tutti_store_seconds_total") > 0
    ready = [line for line in log_path.read_text().splitlines() if "tutti: ready:" in line]
    assert len(ready) == 1, ready
    assert " INFO " in ready[0]
    for part in ("backend=", "roots=['" + str(tmp_path / "kv"), "capacity=64.0 MiB", "hits=layerwise+async_past_budget "
                 "(vLLM schedules synchronously)", "read probe: nothing stored yet"):  # vLLM on the CPU: synchronous
        assert part in ready[0], (part, ready[0])
    line = ready[0].split("tutti: ready:", 1)[1]
    assert len(line) < 300 and "layout=" not in line, line  # short: the layout and the rest are at DEBUG
    assert "tutti: details:" not in log_path.read_text()
    again = [ln for ln in restarted_log.read_text().splitlines() if "tutti: ready:" in ln]
    assert len(again) == 1 and "GB/s" in again[0] and "(4 chunks of 64 tokens stored)" in again[0], again
