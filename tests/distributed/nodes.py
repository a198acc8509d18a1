"""A server's two halves (the real planner and one worker pipeline, on CPU tensors, real files,
a real IO queue) over a root: one per node's mount, as a vLLM server would build them, without
vLLM (tests/engine/worker/worker_helpers.py's Server, on a distributed file system)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "worker"))

from worker_helpers import B, T, prompt, server_cfg  # noqa: E402
from worker_helpers import Server as _Server  # noqa: E402

BPC = 2  # blocks a chunk (T tokens)
CAPACITY_CHUNKS = 8


def cfg(root, writer, **kw) -> dict:
    return server_cfg(root, writer, CAPACITY_CHUNKS, **kw)


class Server(_Server):
    """worker_helpers.Server with a node's capacity; `writer` "auto": the worker takes the first
    free writer slot, the scheduler learns it under `engine_id`."""

    def __init__(self, root, writer, seed, engine_id: str = "", **kw) -> None:
        super().__init__(root, writer, seed, engine_id=engine_id, capacity_chunks=CAPACITY_CHUNKS, **kw)


def wait_for(cond, timeout: float = 10.0) -> bool:
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return cond()


__all__ = ["B", "BPC", "T", "Server", "cfg", "prompt", "wait_for"]
