"""A server's two halves (the real planner and one worker pipeline, on CPU tensors, real files,
a real IO queue) over a root: one per node's mount, as a vLLM server would build them, without
vLLM (tests/engine/test_sharing.py's Server, on a distributed file system)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "worker"))

from worker_helpers import B, T, geometry, make_caches, run_step, views  # noqa: E402

from tutti.engine.build import build_planner, build_worker  # noqa: E402
from tutti.kernels import PagedLayout  # noqa: E402

BPC = 2  # blocks a chunk (T tokens)


def cfg(root, writer, **kw) -> dict:
    c = {"root": str(root), "capacity_bytes": 8 * geometry().slot_bytes, "chunk_tokens": T, "writer_id": writer,
         "staging_bytes": 16 * 16384, "staging_slots": 16, "max_inflight_stores": 8, "lookahead": 1,
         "follow_interval_s": 0.05}
    c.update(kw)
    return c


class Server:
    """`writer` "auto": the worker takes the first free writer slot (as vLLM builds them: the
    worker first, then the scheduler, which learns the slot under `engine_id`)."""

    def __init__(self, root, writer, seed, engine_id: str = "", **kw) -> None:
        self.caches = make_caches(seed)
        v = views(self.caches)
        layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
        self.worker = build_worker(cfg(root, writer, **kw), geometry(), caches=v, layout=layout, engine_id=engine_id)
        self.planner = build_planner(cfg(root, writer, **kw), geometry(), engine_id=engine_id)
        self.writer_id = self.worker.cfg.writer_id

    def request(self, req, tokens, blocks):
        """match, allocate, one step computing the rest of the prompt; (hit tokens, failed blocks, plan)."""
        hit = self.planner.match(req, tokens, 0)
        self.planner.on_alloc(req, blocks, hit)
        plan = self.planner.build_step({req: len(tokens) - hit}, {req: hit})
        run_step(self.worker, plan)
        self.worker.flush()
        failed = self.worker.take_failed_blocks()
        self.planner.on_report(self.worker.take_report())
        self.planner.finished(req)
        return hit, failed, plan

    def close(self) -> None:
        self.planner.foreign.close()
        self.worker.close()


def prompt(seed: int, chunks: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (chunks * T + 1,), generator=g).tolist()


def wait_for(cond, timeout: float = 10.0) -> bool:
    t0 = time.monotonic()
    while not cond() and time.monotonic() - t0 < timeout:
        time.sleep(0.01)
    return cond()


__all__ = ["B", "BPC", "T", "Server", "cfg", "prompt", "wait_for"]
