"""Fixtures for the reliability suite: the real-vLLM harness (tests/vllm/harness.py), a tiny
model, and the report every test fills in (see report.py)."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm"))  # harness.py
sys.path.insert(0, str(HERE))  # relkit.py, report.py

import harness  # noqa: E402
import report as _report  # noqa: E402

harness.set_env()  # before anything imports vllm

_ROWS: dict[str, _report.Row] = {}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama (2 KV heads, head_dim 64, float32) with a generated tokenizer."""
    pytest.importorskip("vllm")
    return harness.make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(autouse=True)
def report(request) -> _report.Row:
    """This test's row in docs/reliability.md; the test fills in what it tried and what held."""
    mod = request.node.module
    row = _report.Row(test=request.node.nodeid, area=getattr(mod, "AREA", mod.__name__))
    _ROWS[request.node.nodeid] = row
    t0 = time.perf_counter()
    yield row
    row.seconds = time.perf_counter() - t0
    if not row.tried:  # failed before it said: the module's promise, so the row still reads
        row.tried = " ".join((mod.__doc__ or "").split(".")[0].split())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    row = _ROWS.get(item.nodeid)
    if row is None:
        return
    if rep.when == "call" or (rep.when == "setup" and not rep.passed):
        if rep.skipped:
            row.outcome = "skipped"
            row.reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        elif rep.failed:
            row.outcome = "failed"
            row.reason = (rep.longreprtext or "").strip().splitlines()[-1][:200] if rep.longreprtext else "error"
        else:
            row.outcome = "passed"


def _complete_run(session) -> bool:
    """Every test file of this folder was collected and nothing was deselected by -k/-m."""
    if os.environ.get("TUTTI_RELIABILITY_DOC") in ("0", "1"):
        return os.environ["TUTTI_RELIABILITY_DOC"] == "1"
    opt = session.config.option
    if getattr(opt, "keyword", "") or getattr(opt, "markexpr", ""):
        return False
    files = {p.name for p in HERE.glob("test_*.py")}
    mine = [it for it in session.items if Path(str(it.fspath)).parent == HERE]
    ran = {Path(str(it.fspath)).name for it in mine}
    return (bool(files) and files == ran and len(_ROWS) == len(mine)  # none cut short by -x / Ctrl-C
            and all(r.outcome != "not run" for r in _ROWS.values()))


def pytest_sessionfinish(session, exitstatus):
    if not _ROWS:
        return
    rows = sorted(_ROWS.values(), key=lambda r: r.test)
    path = os.environ.get("TUTTI_RELIABILITY_JSON", str(_report.DEFAULT_JSON))
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # scripts/test.sh's parallel run: each worker ran some files; the doc needs one process
        path = f"{path}.{worker}"
    env = (f"{time.strftime('%Y-%m-%d')}, {platform.machine()} CPU x{os.cpu_count()}, Python "
           f"{platform.python_version()}, vLLM {_vllm_version()}, pytest exit status {int(exitstatus)}.")
    _report.save(path, rows, env)
    if _complete_run(session):
        _report.write_doc([vars(r) for r in rows], env=env)


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # noqa: BLE001
        return "?"
