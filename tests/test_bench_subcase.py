"""bench/subcase.py: a benchmark case in its own process, its result read from a marker line."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from subcase import run_case  # noqa: E402


def case(code: str) -> list[str]:
    return [sys.executable, "-c", "import sys, time\nsys.path.insert(0, %r)\nfrom subcase import emit\n%s"
            % (os.path.join(ROOT, "bench"), code)]


def test_the_last_marker_line_is_the_result():
    r, err = run_case(case("print('CASE_RESULT {\"x\": 1}'); emit({'x': 2}); print('warn', file=sys.stderr)"),
                      timeout=60)
    assert r["x"] == 2 and "exit_code" not in r and r["wall_s"] >= 0 and "warn" in err


def test_a_case_that_died_after_its_result_keeps_it_with_its_exit_code():
    r, _ = run_case(case("emit({'x': 3}); sys.exit(7)"), timeout=60)
    assert r["x"] == 3 and r["exit_code"] == 7


def test_a_case_without_a_result_is_an_error_with_its_tail():
    r, _ = run_case(case("print('boom at step 4', file=sys.stderr); sys.exit(2)"), timeout=60)
    assert "error" in r and "exit code 2" in r["error"] and "boom at step 4" in r["error"]


def test_a_case_that_ran_out_of_time_says_how_far_it_got():
    r, _ = run_case(case("print('P engine started', file=sys.stderr, flush=True)\n"
                         "print('INFO scheduler waits for a load', flush=True)\n"
                         "print('P first prefill', file=sys.stderr, flush=True)\ntime.sleep(60)"),
                    timeout=3, progress="P ")
    assert r["error"].startswith("timed out after 3 s")
    assert r["progress"] == ["P engine started", "P first prefill"]
    assert r["stdout_tail"] == ["INFO scheduler waits for a load"]  # vLLM's log lines are on stdout


def test_a_result_printed_before_a_hang_at_shutdown_counts():
    r, _ = run_case(case("emit({'x': 4}, 'PHASE')\ntime.sleep(60)"), timeout=3, marker="PHASE")
    assert r["x"] == 4 and "error" not in r
