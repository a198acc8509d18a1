"""What a worker learned at start-up that the scheduler in its process uses from its first lookup.

vLLM builds the scheduler after the worker registered its KV caches; with one worker (TP = PP = 1)
both live in one process. The worker's start-up read probe (the store's read rate, measured
reading stored chunks) is left here under vLLM's engine id, so a server that restarts into a
burst of hits prices them with a measured rate at once, instead of loading one hit to measure it
and recomputing the rest. Where the worker runs elsewhere, the probe reaches the scheduler with
the worker's first report instead.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_probes: dict[str, tuple[int, float]] = {}  # vLLM engine id -> (bytes, seconds) of the worker's probe


def record_probe(engine_id: str, nbytes: int, seconds: float) -> None:
    if engine_id and nbytes > 0 and seconds > 0:
        with _lock:
            _probes[engine_id] = (int(nbytes), float(seconds))


def take_probe(engine_id: str) -> tuple[int, float] | None:
    """The probe this process's worker of `engine_id` recorded (taken once), or None."""
    with _lock:
        return _probes.pop(engine_id, None) if engine_id else None
