"""The connector's scheduler half over a planner built here, without a vLLM engine: what
test_may_load_async.py and the vLLM 0.34 API check (test_api_check.py, in a process importing
0.34's extracted code) share. Imports nothing from vLLM at module level."""

from __future__ import annotations

from types import SimpleNamespace

from tutti.engine.hostcost import HookClock
from tutti.engine.keys import namespace_seed
from tutti.engine.plan import WorkerReport
from tutti.engine.sched.planner import Planner

T = 16  # tokens a chunk (one vLLM block)
SLOT = 4096  # bytes a chunk


def planner(**kw) -> Planner:
    return Planner(num_slots=64, chunk_tokens=T, block_size=T, seed=namespace_seed("may_load_async"),
                   slot_bytes=SLOT, **kw)


def store(p: Planner, tokens: list[int], req: str = "writer") -> None:
    """Every whole chunk of `tokens` prefilled and committed, as vLLM and the workers would."""
    blocks = list(range(1000, 1000 + -(-len(tokens) // T)))
    p.match(req, tokens, 0)
    p.on_alloc(req, blocks, 0)
    p.update_request(req, tokens=tokens, all_block_ids=blocks)
    plan = p.build_step({req: len(tokens)}, {req: 0})
    p.on_report(WorkerReport(stored=[s.ticket for s in plan.stores]))
    p.finished(req)


def half(p: Planner, *, async_loads: bool = False, budgeted: bool = False):
    """A SchedulerHalf over `p` (its constructor reads vLLM's config; this sets what it would)."""
    from tutti.vllm.scheduler_side import SchedulerHalf

    h = SchedulerHalf.__new__(SchedulerHalf)
    h.setup = SimpleNamespace(async_loads=async_loads, budgeted=budgeted, hash_block_size=T, hybrid=False,
                              cfg=SimpleNamespace(store_decode=False))
    h.planner = p
    h._hooks = HookClock()
    return h


def request(req_id: str, tokens, **kw):
    """What the scheduler half reads of a vLLM Request (a real one works too)."""
    base = dict(request_id=req_id, prompt_token_ids=list(tokens), lora_request=None, mm_features=None,
                cache_salt=None, prompt_embeds=None, kv_transfer_params=None)
    base.update(kw)
    return SimpleNamespace(**base)


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 10 for i in range(n)]
