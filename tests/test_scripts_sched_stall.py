"""scripts/sched_stall.py on the installed vLLM's real Scheduler: a request answered "later"
while the requests behind it load asynchronously. vLLM 0.31 and later take the waiting requests
that hold blocks first, so every request finishes, with or without the guard that tutti's staged
hits use (tutti.engine.sched.tiers: `_waits_for_blocks`); on vLLM 0.26 the same grid stalls
without it (results/sched_stall.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sched_stall.py"


def test_a_deferred_request_under_kv_pressure_leaves_no_request_stranded(tmp_path):
    from tutti.tools.demo import make_tiny_model

    model = make_tiny_model(tmp_path / "model")  # (only its config is read)
    for guard in ([], ["--guard"]):
        # 23 usable blocks: the two loaders hold 20 of them while the deferred request needs 10
        p = subprocess.run([sys.executable, str(SCRIPT), "--model", str(model), "--blocks", "24", "--loaders", "2",
                            "--defer-steps", "1", "--load-steps", "1", *guard], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        assert p.returncode == 0, p.stderr[-3000:]
        r = json.loads(p.stdout.strip().splitlines()[-1])
        assert not r["stalled"] and r["finished"] == r["requests"] == 3, r
        assert r["free_blocks"] == 23  # every block back
