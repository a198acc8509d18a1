"""One benchmark case in a process of its own, its result read back from a marker line.

Why: every GPU benchmark runs each case (an engine, a connector setting) in a fresh process, so
one case's engine, CUDA context, GIL setting or crash never leaks into the next, and a case that
hangs is cut off by its timeout while the others' figures survive. The case prints one line,
`<marker> <json>`, on stdout; the driver keeps the last such line. A case that printed its result
and then died (vLLM's shutdown can) still counts, with its exit code beside it; one that printed
nothing, or ran out of time, comes back as `{"error": ...}` with the tail of what it wrote (stderr
in the error, stdout's last lines in `stdout_tail`: vLLM logs there), and
the progress lines it printed before (`progress`), so a timed-out case says how far it got.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Sequence

MARK = "CASE_RESULT"


def emit(result: dict, marker: str = MARK) -> None:
    """In the case's process: its result, the one line the driver reads."""
    print(f"{marker} {json.dumps(result)}", flush=True)


def run_case(cmd: Sequence[str], *, timeout: float, marker: str = MARK, env: dict | None = None,
             progress: str | None = None, tail: int = 3000) -> tuple[dict, str]:
    """Run `cmd` (a case process) and return (its result, its stderr). The result gains `wall_s`,
    `exit_code` where the process failed after its result, and `progress`: the stderr lines
    starting with `progress` (when given), kept also when the case ran out of time."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env)
        out, err, code = p.stdout, p.stderr, p.returncode
        res = parse(out, marker)
        if res is None:
            res = {"error": f"exit code {code}, no {marker} line: {(err or out)[-tail:]}"}
        elif code != 0:
            res["exit_code"] = code
    except subprocess.TimeoutExpired as exc:
        out, err = _text(exc.stdout), _text(exc.stderr)
        res = parse(out, marker) or {"error": f"timed out after {timeout:g} s: {err[-tail:]}"}
    if "error" in res and out:  # vLLM logs on stdout: where a failed or hung case's engine got to
        res["stdout_tail"] = [ln[-300:] for ln in out.splitlines() if "it/s]" not in ln][-20:]
    if progress:
        res["progress"] = [ln for ln in (out + "\n" + err).splitlines() if ln.startswith(progress)]
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res, err


def parse(stdout: str, marker: str = MARK) -> dict | None:
    """The last `<marker> <json>` line of `stdout`, or None."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith(marker + " ")]
    return json.loads(lines[-1][len(marker) + 1:]) if lines else None


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")
