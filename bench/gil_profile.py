"""Who holds the GIL while a server serves: py-spy samples of a server's processes, summed by thread.

Why: under vLLM's asynchronous scheduling the engine core's thread prepares the next step while
the GPU runs this one; a tutti thread (writer, asynchronous loads, IO) that holds the GIL when
that thread needs it delays the next step, which shows as TPOT, not as time in tutti's hooks.
py-spy's `--gil` mode samples only the thread holding the GIL, so per process the samples split
into "held by this thread" and (what is left of rate x seconds) "held by nobody".

    rec = GilRecorder.start(py_spy, server_pid, out_path, rate=200)
    ...                      # the benchmark
    summary = rec.stop()     # {process: {"samples", "threads": {name: samples}, "top": {...}}}

`--nonblocking`: the processes are never paused to be sampled (a paused engine is a slower one).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import time

_PROC = re.compile(r'^process (\d+):"(.*)$')  # a command line with a ';' (vLLM's spawned engine core) is split: no closing quote needed
_THREAD = re.compile(r"^thread \((\d+)\): (.*)$")


def find_py_spy(path: str) -> str | None:
    """`path` if it is an executable, "auto": on PATH or in .gpu_pytest/bin (the GPU bundle)."""
    if path != "auto":
        return path if os.access(path, os.X_OK) else None
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".gpu_pytest", "bin", "py-spy")
    return shutil.which("py-spy") or (here if os.access(here, os.X_OK) else None)


class GilRecorder:
    def __init__(self, proc: subprocess.Popen, out_path: str, rate: int) -> None:
        self.proc, self.out_path, self.rate = proc, out_path, rate
        self.t0 = time.monotonic()

    @classmethod
    def start(cls, py_spy: str, pid: int, out_path: str, rate: int = 200) -> "GilRecorder":
        cmd = [py_spy, "record", "--pid", str(pid), "--subprocesses", "--gil", "--threads", "--nonblocking",
               "--format", "raw", "--rate", str(rate), "-o", out_path]
        log = open(out_path + ".log", "w")
        return cls(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), out_path, rate)

    def stop(self) -> dict:
        seconds = time.monotonic() - self.t0
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its samples on SIGINT
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return summarize(self.out_path, seconds, self.rate)


def summarize(path: str, seconds: float, rate: int, top: int = 8) -> dict:
    """Samples per process and thread name, the share of the expected samples each holds, and
    each tutti thread's and main thread's most frequent innermost frames."""
    procs: dict[str, dict] = {}
    if not os.path.exists(path):
        return {"error": f"no samples written ({path}.log says why)"}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            proc, thread, rest = "?", "?", []
            for i, fr in enumerate(frames):
                m = _PROC.match(fr)
                if m:
                    proc = f"{m.group(1)} {m.group(2)[:60]}"
                    continue
                m = _THREAD.match(fr)
                if m:
                    thread, rest = m.group(2), frames[i + 1:]
                    break
            p = procs.setdefault(proc, {"samples": 0, "threads": collections.Counter(), "leaf": {}})
            n = int(count)
            p["samples"] += n
            p["threads"][thread] += n
            leaf = rest[-1] if rest else "?"
            p["leaf"].setdefault(thread, collections.Counter())[leaf] += n
    expected = max(1.0, seconds * rate)
    out: dict = {"seconds": round(seconds, 1), "rate": rate, "processes": {}}
    for proc, p in procs.items():
        threads = {t: {"samples": c, "share": round(c / expected, 4)} for t, c in p["threads"].most_common()}
        tops = {t: [f"{leaf} x{c}" for leaf, c in p["leaf"][t].most_common(top)]
                for t in p["threads"] if t.startswith("tutti-") or t == "MainThread"}
        out["processes"][proc] = {"gil_share": round(p["samples"] / expected, 4), "threads": threads, "top": tops}
    return out


def tutti_share(summary: dict) -> float:
    """The largest share of the GIL tutti's threads held in any one process."""
    best = 0.0
    for p in summary.get("processes", {}).values():
        best = max(best, sum(v["share"] for t, v in p["threads"].items() if t.startswith("tutti-")))
    return round(best, 4)
