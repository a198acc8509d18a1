"""Scheduler-level cases with vLLM's real Scheduler driving TuttiConnectorV1 (CPU, in-process)."""

from __future__ import annotations

import threading

import pytest

import harness
from connector_kit import CHUNK, kv_config, prompt


def core_of(llm):
    return llm.llm_engine.engine_core.engine_core


def connector_of(llm):
    return core_of(llm).scheduler.connector


def manual_step(llm, before_execute=None):
    """One engine step by hand (vLLM's EngineCore.step), with a hook between schedule and execute."""
    core = core_of(llm)
    so = core.scheduler.schedule()
    if before_execute is not None:
        before_execute(so)
    out = core.model_executor.execute_model(so)
    if out is None:
        out = core.model_executor.sample_tokens(core.scheduler.get_grammar_bitmask(so))
    return core.scheduler.update_from_output(so, out)


@pytest.fixture(scope="module")
def stored(tiny_model, tmp_path_factory):
    """An engine whose store holds the 4 chunks of a 300-token prompt, with references."""
    p = prompt(7, 300)
    lengths = (63, 64, 65, 128, 129, 300)
    ref = harness.make_llm(tiny_model)
    want = {n: list(o.outputs[0].token_ids) for n, o in zip(lengths, harness.generate_ids(ref, [p[:n] for n in lengths], 4))}
    harness.shutdown_llm(ref)
    llm = harness.make_llm(tiny_model, kv_transfer_config=kv_config(tmp_path_factory.mktemp("kv")))
    harness.generate_ids(llm, [p], 1)
    harness.settle(llm)
    assert len(connector_of(llm).planner.index) == 4
    yield llm, p, want
    harness.shutdown_llm(llm)


def test_hits_are_chunk_aligned_and_leave_the_last_token(stored):
    llm, p, want = stored
    for n in (63, 64, 65, 128, 129, 300):
        llm.reset_prefix_cache()
        out = harness.generate_ids(llm, [p[:n]], 4)[0]
        # a prompt ending on a stored chunk's end (past the first) loads it but its last block (32)
        tail = n % CHUNK == 0 and n > CHUNK
        assert out.num_cached_tokens == (n - 32 if tail else (n - 1) // CHUNK * CHUNK), n
        assert list(out.outputs[0].token_ids) == want[n], n


def test_abort_between_schedule_and_load(stored):
    llm, p, want = stored
    conn = connector_of(llm)
    llm.reset_prefix_cache()
    llm.llm_engine.add_request("abort-me", {"prompt_token_ids": p}, harness.greedy(4))
    core = core_of(llm)

    def abort(so):
        assert conn.planner.index._pins, "the load should have pinned its chunks"
        llm.llm_engine.abort_request(["abort-me"])  # as a client disconnect would, mid-step
        assert not core.scheduler.requests

    manual_step(llm, abort)
    harness.settle(llm)
    assert not conn.planner.index._pins  # unpinned once the step's report arrived
    assert not core.scheduler.requests
    llm.reset_prefix_cache()
    out = harness.generate_ids(llm, [p], 4)[0]
    assert out.num_cached_tokens == 256 and list(out.outputs[0].token_ids) == want[300]


class GatedQueue:
    """A real IO queue whose writes wait for a gate: stores stay in flight while we look."""

    def __init__(self, inner):
        self.inner, self.gate = inner, threading.Event()
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, requests):
        if any(r.op == "write" for r in requests):
            self.gate.wait(60)
        return self.inner.submit(requests)


def test_request_finished_while_its_store_is_in_flight(stored):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm, _, _ = stored
    conn = connector_of(llm)
    worker = get_kv_transfer_group().worker
    gated = GatedQueue(worker.queue)
    worker.queue = gated
    try:
        q = prompt(8, 200)  # 3 new chunks
        llm.llm_engine.add_request("slow-store", {"prompt_token_ids": q}, harness.greedy(1))
        core = core_of(llm)
        finished = False
        for _ in range(5):
            outs = manual_step(llm)
            finished |= any(o.finished for eo in outs.values() for o in eo.outputs)
            if finished:
                break
        assert finished, "the request should finish after its prefill"
        # tokens are out, the store is not: vLLM keeps the blocks (request_finished said so)
        assert core.scheduler.requests, "blocks must stay allocated while the store is in flight"
        before = len(conn.planner.index)
        gated.gate.set()
        for _ in range(50):
            worker.flush(5)
            manual_step(llm) if core.scheduler.has_requests() else None
            if not core.scheduler.requests:
                break
        assert not core.scheduler.requests  # released through get_finished
        assert len(conn.planner.index) == before + 3
    finally:
        gated.gate.set()
        worker.queue = gated.inner
