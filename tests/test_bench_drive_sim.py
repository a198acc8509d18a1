"""bench/drive_sim.py: the real Planner and admission policies over a modelled drive and GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sim(tmp_path, gbps: str) -> dict:
    out = tmp_path / f"sim{gbps}.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--drive-gbps", gbps, "--seeds", "1",
                    "--num-prefixes", "12", "--repeats", "3", "--admissions", "all,drive_share", "--gpu-cache-chunks", "40",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    return {r["admission"]: r for r in json.load(open(out))["rows"]}


def test_drive_share_is_all_on_a_fast_drive_and_declines_whole_prefixes_on_a_slow_one(tmp_path):
    fast = sim(tmp_path, "50")
    assert fast["drive_share"]["share"] == 1.0 and fast["all"]["stores_skipped"] == 0
    for k in ("hit_tokens", "written_gb", "makespan_s", "stores_committed"):
        assert fast["drive_share"][k] == fast["all"][k]
    assert fast["all"]["hit_tokens"] > 0 and fast["all"]["x_none"] > 1.0  # hits served from the store
    slow = sim(tmp_path, "0.4")
    assert slow["all"]["stores_skipped"] > 0  # the drive cannot keep up: stores are skipped
    assert slow["drive_share"]["share"] < 1.0 and slow["drive_share"]["stores_declined"] > 0
    # whole prefixes declined up front instead of chunks skipped (and holes) once staging is full
    assert slow["drive_share"]["stores_skipped"] < slow["all"]["stores_skipped"]


def test_a_fixed_share_admits_that_share_of_the_prefixes_and_never_moves(tmp_path):
    out = tmp_path / "share.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--drive-gbps", "0.4", "--seeds", "1",
                    "--num-prefixes", "12", "--repeats", "3", "--admissions", "all,share:0.25,share:1",
                    "--gpu-cache-chunks", "40", "--out", str(out)], check=True, capture_output=True, timeout=300)
    d = json.load(open(out))
    rows = {r["admission"]: r for r in d["rows"]}
    assert rows["share:0.25"]["share"] == 0.25  # the slow drive's pressure did not move it
    assert rows["share:0.25"]["written_gb"] < rows["share:1"]["written_gb"]
    for k in ("stores_declined", "written_gb", "hit_tokens"):  # share 1 admits what "all" admits
        assert rows["share:1"][k] == rows["all"][k]
    assert {(s["admission"], s["drive_gbps"]) for s in d["summary"]} == {(a, 0.4) for a in rows}
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--admissions", "share:0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "expected a share in (0, 1]" in bad.stderr


def test_a_front_share_writes_only_the_front_of_every_prompt(tmp_path):
    out = tmp_path / "front.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--drive-gbps", "50", "--seeds", "1",
                    "--num-prefixes", "12", "--repeats", "3", "--admissions", "all,front:0.5,front:1",
                    "--gpu-cache-chunks", "40", "--out", str(out)], check=True, capture_output=True, timeout=300)
    rows = {r["admission"]: r for r in json.load(open(out))["rows"]}
    for k in ("stores_declined", "written_gb", "hit_tokens"):  # front 1 admits what "all" admits
        assert rows["front:1"][k] == rows["all"][k]
    # half of every prompt's chunks written; its hits reach no further than that half
    assert 0 < rows["front:0.5"]["written_gb"] <= 0.55 * rows["all"]["written_gb"]
    assert 0 < rows["front:0.5"]["hit_tokens"] < rows["all"]["hit_tokens"]


def test_the_tiers_in_the_model_serve_from_both_tiers_and_promote_only_when_asked(tmp_path):
    """--stores: a RAM tier in front of the drive (the real planner's copies between them), a RAM
    root alone, and the tiers with promotions off; the RAM alone holds a fifth of the working set.
    A drive of 6.4 GB/s: slower ones keep write-downs waiting all run, and promotions yield to them."""
    out = tmp_path / "tiers.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--drive-gbps", "6.4", "--seeds", "1",
                    "--num-prefixes", "12", "--repeats", "3", "--admissions", "all", "--gpu-cache-chunks", "40",
                    "--stores", "disk,ram,tiered,tiered_nopromo", "--ram-chunks", "40", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    rows = {r["stores"]: r for r in json.load(open(out))["rows"]}
    assert rows["disk"]["tier_hit_tokens"] is None and rows["ram"]["read_gb"] == 0  # the RAM root never reads the drive
    ram_hits, disk_hits = rows["tiered"]["tier_hit_tokens"]
    assert ram_hits > 0 and disk_hits > 0 and rows["tiered"]["writedowns"] > 0
    assert rows["tiered"]["promotions"] > 0 and rows["tiered_nopromo"]["promotions"] == 0
    assert rows["tiered"]["hit_tokens"] > rows["ram"]["hit_tokens"]  # the drive behind keeps what RAM gave up
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--stores", "nvme"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "expected one of disk, ram, tiered" in bad.stderr


def test_a_gpu_kv_budget_queues_requests_and_a_staged_hit_waits_holding_no_blocks(tmp_path):
    """--gpu-kv-chunks: the requests in flight and the prefix cache share the GPU's blocks. A hit
    loading from the drive holds its blocks while it loads; with promote "stage" it waits in vLLM's
    queue holding none while its chunks are copied up, but only while blocks are short
    (--stage-pressure, the stage_pressure key)."""
    def rows(*extra):
        out = tmp_path / "kv.json"
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--drive-gbps", "1.6", "--seeds", "1",
                        "--num-prefixes", "12", "--repeats", "3", "--admissions", "all", "--stores", "tiered,tiered_stage",
                        "--ram-chunks", "40", "--out", str(out), *extra], check=True, capture_output=True, timeout=300)
        return {r["stores"]: r for r in json.load(open(out))["rows"]}
    kv = rows("--gpu-kv-chunks", "60", "--stage-pressure", "0")
    hits, stage = kv["tiered"], kv["tiered_stage"]
    assert hits["queue_wait_s"] > 0  # requests waited for blocks
    assert hits["staged_hits"] == 0 and stage["staged_hits"] > 0 and stage["tier_hit_tokens"][0] > 0
    assert stage["load_wait_s"] < hits["load_wait_s"]  # less time holding blocks idle
    # 36 requests of 64 output tokens, at most 8 at once: decode-only steps between 36 * 64 / 8 and
    # 36 * 64, and fewer when no hit holds blocks idle while the decodes run alone
    assert 36 * 64 / 8 <= stage["decode_only_steps"] < hits["decode_only_steps"] <= 36 * 64
    roomy = rows("--gpu-kv-chunks", "400")  # the default stage_pressure: blocks are never short here
    assert roomy["tiered_stage"]["staged_hits"] == 0
    old = rows("--gpu-cache-chunks", "40")  # no budget: requests never wait for blocks, every hit is staged
    assert old["tiered"]["queue_wait_s"] == 0 and old["tiered"]["load_wait_s"] > 0
    assert old["tiered_stage"]["staged_hits"] > 0


def test_a_decode_cost_lengthens_the_steps_that_decode(tmp_path):
    """--decode-s: each request decoding in a step adds to it, with and without a connector; 0 (the
    default) leaves a decode only the step's overhead, as every earlier figure of the model."""
    def row(decode_s):
        out = tmp_path / f"d{decode_s}.json"
        subprocess.run([sys.executable, os.path.join(ROOT, "bench", "drive_sim.py"), "--drive-gbps", "1.6", "--seeds", "1",
                        "--num-prefixes", "12", "--repeats", "3", "--admissions", "all", "--gpu-cache-chunks", "40",
                        "--decode-s", str(decode_s), "--out", str(out)], check=True, capture_output=True, timeout=300)
        return json.load(open(out))["rows"][0]
    free, dear = row(0), row(0.002)
    # 36 requests of 64 output tokens, one from its prefill: 36 * 63 decodes of 2 ms each (4.5 s)
    assert dear["none_makespan_s"] >= free["none_makespan_s"] + 0.9 * 36 * 63 * 0.002
    assert dear["makespan_s"] > free["makespan_s"]
