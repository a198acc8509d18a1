"""Rates a writer measured while serving, kept beside its journal for its next start.

Why: a server that restarts into a burst of hits knows its store's read rate from the start-up
probe, but not how fast its GPU computes a prompt until it has computed one; without that it
either loads every hit of the burst (a slow disk then makes them wait) or guesses. The last run's
prefill rate of the same namespace (same model, geometry and ranks) on the same writer is the
best prior; the first prefill measured replaces it.

Advisory and hostile input when read: `rates.json` in the writer's directory, at most 4 KiB, a
JSON object of finite positive numbers; anything else is ignored. It never decides what KV is
served, only how much of a hit to load.
"""

from __future__ import annotations

import json
import math
import os

from tutti.io.safefs import PRIVATE, Access, check_fd, open_dir, open_file, replace_file

HINTS = "rates.json"
MAX_BYTES = 4096
KEYS = ("prefill_tokens_per_s", "step_s")


def read_hints(directory: str, access: Access = PRIVATE) -> dict[str, float]:
    """The known keys of `directory`'s rates file that are finite positive numbers ({} otherwise)."""
    try:
        d = open_dir(directory, check=True, access=access, where=f"writer directory {directory!r}")
    except OSError:
        return {}
    try:
        fd = open_file(HINTS, os.O_RDONLY, dir_fd=d, access=access, where=f"{directory}/{HINTS}")
    except OSError:
        return {}
    finally:
        os.close(d)
    try:
        check_fd(fd, f"{directory}/{HINTS}", access=access)
        raw = os.pread(fd, MAX_BYTES + 1, 0)
        data = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if k in KEYS and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v) and v > 0}


def write_hints(directory: str, hints: dict[str, float], access: Access = PRIVATE) -> None:
    """Replace the rates file atomically (a temporary made O_EXCL, then renamed over); raises OSError."""
    data = {k: float(v) for k, v in hints.items() if k in KEYS and v and math.isfinite(v) and v > 0}
    if not data:
        return
    d = open_dir(directory, check=True, access=access, where=f"writer directory {directory!r}")
    try:
        replace_file(HINTS, json.dumps(data).encode(), dir_fd=d, access=access, where=f"{directory}/{HINTS}")
    finally:
        os.close(d)
