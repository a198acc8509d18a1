"""bench/hook_cost.py --workload prefixes: each hook timed on a real (CPU) vLLM engine while long
prompts come back, so its figures are of lookups that hit and stores that commit."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_prefixes_workload_times_lookups_that_hit_and_stores_that_commit(tmp_path):
    out = tmp_path / "hook_cost.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "hook_cost.py"), "--workload", "prefixes", "--tiers",
                    "--repeats", "1", "--num-prefixes", "4", "--prefix-len", "512", "--suffix-len", "16",
                    "--sends", "3", "--chunk-tokens", "64", "--tokens", "4", "--requests", "4", "--gpu-blocks", "40",
                    "--json", str(out)], check=True, capture_output=True, timeout=600)
    run = json.load(open(out))["runs"][0]
    hooks, served = run["hooks"], run["tutti"]
    assert run["requests"] == 12
    assert hooks["get_num_new_matched_tokens"]["calls"] >= 12  # every request looked up at least once
    assert hooks["build_connector_meta"]["calls"] == run["steps"]
    assert served["stores_committed"] > 0 and served["hit_tokens"] > 0  # repeats came back from tutti
    assert run["us_per_step"] > 0 and all(h["us_per_call"] >= 0 for h in hooks.values())
