"""Fresh processes for engine phases, without paying vLLM's import in each one.

Why: importing vLLM costs about 10 s of CPU on the 2-core CI machine, and the real-engine tests
start dozens of fresh processes (a store, then a hit in a process that never saw the store's
memory). A fork server (multiprocessing's "forkserver") imports vLLM and the harness once, runs
no engine and holds no KV cache, and forks one child per phase: the child has no engine, no
cache memory and no connector state from anyone, as a fresh interpreter would, and starts in
milliseconds. Set TUTTI_TEST_FRESH_INTERPRETER=1 to start each phase as a new interpreter instead.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass

PRELOAD = ["harness", "vllm", "vllm.v1.engine.llm_engine", "vllm.entrypoints.llm"]

_ctx = None


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def enabled() -> bool:
    return os.environ.get("TUTTI_TEST_FRESH_INTERPRETER", "") not in ("1", "true", "yes")


def _context():
    global _ctx
    if _ctx is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _ctx = ctx
    return _ctx


def _child(code: str, argv: list[str], cwd: str, out_path: str, err_path: str) -> None:
    """Runs in the forked child: stdout and stderr to files, the code as a script's __main__."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    sys.argv = ["-c", *argv]
    code_rc = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        code_rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code_rc = 1
    try:
        atexit._run_exitfuncs()  # what an interpreter's normal exit runs (engines' shutdown hooks)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code_rc)


def run(code: str, argv: list[str] | tuple[str, ...] = (), *, cwd: str, timeout: float,
        env: dict[str, str], fork: bool = True) -> Completed:
    """`python -c code *argv`: its exit code and output. Forked from the server where `fork` and
    `enabled()` (the fork inherits this process's environment); else a new interpreter with `env`
    (a phase that sets its own environment must pass fork=False)."""
    if not (fork and enabled()):
        p = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True,
                           timeout=timeout, cwd=cwd)
        return Completed(p.returncode, p.stdout, p.stderr)
    with tempfile.TemporaryDirectory(prefix="tutti-zygote-") as d:
        out_path, err_path = os.path.join(d, "out"), os.path.join(d, "err")
        for path in (out_path, err_path):
            open(path, "w").close()
        p = _context().Process(target=_child, args=(code, list(argv), cwd, out_path, err_path))
        p.start()
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(["-c", code[:200]], timeout)
        with open(out_path, errors="replace") as f:
            out = f.read()
        with open(err_path, errors="replace") as f:
            err = f.read()
        rc = p.exitcode if p.exitcode is not None else 1
        return Completed(rc if rc >= 0 else 128 - rc, out, err)
