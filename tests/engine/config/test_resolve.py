"""Every "auto" is decided in tutti.engine.config.resolve, from the facts it names, with a reason;
a configured value passes through unchanged and says no reason."""

import pytest

from tutti.engine.config import resolve
from tutti.engine.config.values import DEFAULT_WRITE_WINDOW


def test_each_auto_follows_its_facts():
    assert resolve.io_backend("auto", on_ram=True).value == "threads"
    assert resolve.io_backend("auto", on_ram=False).value == "auto"  # the queue's own auto (io_uring or threads)
    assert resolve.write_window_bytes("auto", on_ram=True).value is None
    assert resolve.write_window_bytes("auto", on_ram=False).value == DEFAULT_WRITE_WINDOW
    assert resolve.mapped_loads("auto", on_ram=True, shared=False, secret=False).value is True
    assert resolve.mapped_loads("auto", on_ram=True, shared=True, secret=False).value is False
    assert resolve.mapped_loads(True, on_ram=True, shared=False, secret=True).value is False  # never with a secret
    assert resolve.reads_first("auto", window=DEFAULT_WRITE_WINDOW).value is True
    assert resolve.reads_first(True, window=None).value is False  # no window: nothing to yield
    assert resolve.async_loads("auto", hybrid=False, schedules_async=True).value is True
    assert resolve.async_loads(False, hybrid=True, schedules_async=False).value is True  # hybrid: always
    assert resolve.async_launch("auto", can=True, cuda=False).value == "thread"
    assert resolve.async_launch("auto", can=True, cuda=True).value == "step"
    assert resolve.async_launch("step", can=False, cuda=True).value == "thread"
    assert resolve.idle_load_wait_s("auto", on_step=False).value == resolve.IDLE_WAIT_THREAD_S
    assert resolve.idle_load_wait_s("auto", on_step=True).value == 0.0
    assert resolve.mapped_store_copy("auto", cuda=True).value == "dma_chunk"
    assert resolve.mapped_store_copy("dma", cuda=False).value == "host"
    assert resolve.lookahead("auto", num_layers=32).value == 32
    assert resolve.kernel_variant("auto", cuda=False).value == "torch"


def test_a_configured_value_passes_through_without_a_reason():
    for choice in (resolve.io_backend("uring", on_ram=True), resolve.write_window_bytes(1 << 20, on_ram=True),
                   resolve.lookahead(3, num_layers=32), resolve.kernel_variant("triton", cuda=False)):
        assert choice.why == ""
    assert resolve.io_backend("uring", on_ram=True).value == "uring"


def test_the_ready_lines_decisions_name_each_auto_and_its_reason():
    d = resolve.Decisions()
    d.take("io_backend", resolve.io_backend("auto", on_ram=True))
    d.take("write_window_bytes", resolve.write_window_bytes("auto", on_ram=False))
    d.take("lookahead", resolve.lookahead(2, num_layers=32))  # configured: not listed
    assert d.describe() == "io_backend=threads (RAM root) write_window_bytes=64MiB (a drive)"


# ---- "auto" staging: the three numbers and why -------------------------------------------------
GIB = 1 << 30


def test_auto_staging_holds_two_steps_of_stores_and_four_chunks_of_loads():
    got = resolve.staging(("auto", "auto", "auto"), segment_bytes=1 << 20, chunk_bytes=32 << 20, chunk_tokens=256,
                          step_tokens=8192, memory_bytes=128 * GIB)
    total, slots, inflight = got.value
    assert (total, slots, inflight) == ((256 + 16) * (8 << 20), 256 + 16, 256)  # 8 MiB slots
    assert got.why == "2 steps of 8192 tokens of stores, 4 chunks of loads"
    small = resolve.staging(("auto",) * 3, segment_bytes=1 << 20, chunk_bytes=4 << 20, chunk_tokens=256,
                            step_tokens=None, memory_bytes=None)  # unknown step: 8192; no memory cap known
    assert small.value[1] - small.value[2] == 16 and small.why.endswith("16 load slots")
    given = resolve.staging((512 << 20, 64, 48), segment_bytes=1 << 20, chunk_bytes=32 << 20, chunk_tokens=256,
                            step_tokens=8192, memory_bytes=128 * GIB)
    assert given == resolve.Choice((512 << 20, 64, 48), "")


def test_auto_staging_is_capped_at_a_quarter_of_host_memory_and_says_so():
    got = resolve.staging(("auto",) * 3, segment_bytes=1 << 20, chunk_bytes=32 << 20, chunk_tokens=256,
                          step_tokens=8192, memory_bytes=4 * GIB)
    assert got.value[0] <= GIB and got.why.startswith(resolve.STAGING_CAPPED)
    assert "a step of 8192 tokens makes 32" in got.why


def test_the_worker_records_auto_staging_in_its_decisions():
    from tutti.engine.config.settings import EngineConfig

    d = resolve.Decisions()
    cfg = EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB"}).sized_staging(
        segment_bytes=1 << 20, chunk_bytes=32 << 20, step_tokens=8192, memory_bytes=128 * GIB, decided=d)
    assert d.made[resolve.STAGING].value == (cfg.staging_bytes, cfg.staging_slots, cfg.max_inflight_stores)
    assert d.describe() == ("staging_bytes/staging_slots/max_inflight_stores=2176MiB/272/256 "
                            "(2 steps of 8192 tokens of stores, 4 chunks of loads)")


# ---- writer_id "auto": which slots are tried, and which was taken --------------------------------
def test_writer_candidates_follow_the_workers_and_checksums():
    one = resolve.writer_candidates("auto", workers=1, checksums=True)
    assert one.value[:3] == ["", "auto-1", "auto-2"] and len(one.value) == resolve.claims.MAX_AUTO_NAMES
    assert "first free auto-<n>" in one.why
    several = resolve.writer_candidates("auto", workers=2, checksums=True)
    assert several.value == [""] and "several workers" in several.why
    unchecked = resolve.writer_candidates("auto", workers=1, checksums=False)
    assert unchecked.value == [""] and "verify_checksums is off" in unchecked.why
    assert resolve.writer_candidates("w1", workers=2, checksums=True) == resolve.Choice(["w1"], "")


def test_the_writer_id_taken_says_why():
    assert resolve.writer_taken("") == resolve.Choice("", "the namespace's writer slot")
    assert resolve.writer_taken("auto-2") == resolve.Choice("auto-2", "slot held: took auto-2")
    assert resolve.writer_taken("", writes=False).why == "a reader rank: its writer rank's slot"
    d = resolve.Decisions()
    d.take("writer_id", resolve.writer_taken(""))
    assert d.describe() == "writer_id='' (the namespace's writer slot)"


def test_a_worker_records_the_writer_slot_it_took(tmp_path):
    """Two "auto" servers on one root: the first takes the namespace's slot, the second auto-1
    (the first still holds its lock), each with why in the worker's Decisions."""
    from tutti.engine import build
    from tutti.engine.config.settings import EngineConfig
    from tutti.engine.geometry import Geometry

    geom = Geometry(model="tiny", cache_dtype="float32", chunk_tokens=32, block_size=16, num_layers=2, num_heads=2,
                    content_bytes=64)
    cfg = EngineConfig.of({"root": str(tmp_path), "capacity_bytes": 8 * geom.slot_bytes, "chunk_tokens": 32})
    access = build.store_access(cfg)
    first, second = resolve.Decisions(), resolve.Decisions()
    a, acfg = build._claim_store(cfg, geom, "", access=access, maps=False, decided=first)
    try:
        b, bcfg = build._claim_store(cfg, geom, "", access=access, maps=False, decided=second)
        b.close()
    finally:
        a.close()
    assert (acfg.writer_id, bcfg.writer_id) == ("", "auto-1")
    assert first.made["writer_id"] == resolve.Choice("", "the namespace's writer slot")
    assert second.made["writer_id"] == resolve.Choice("auto-1", "slot held: took auto-1")


# ---- sync_load_budget_bytes "auto": what the read rate moves in one step -----------------------
def test_the_sync_budget_is_what_the_read_rate_moves_in_a_step():
    budget = resolve.sync_load_budget_bytes
    assert budget(rate=None, overhead=0.0, prefill_rate=1e4, step_tokens=8192) is None  # not measured yet
    assert budget(rate=1e9, overhead=0.0, prefill_rate=None, step_tokens=8192) is None
    assert budget(rate=1e9, overhead=0.0, prefill_rate=8192 / 0.3, step_tokens=8192) == pytest.approx(0.3e9)
    assert budget(rate=1e9, overhead=0.1, prefill_rate=8192 / 0.3,
                  step_tokens=8192) == pytest.approx(0.2e9)  # less the fixed cost of a load
    assert budget(rate=1e9, overhead=0.0, prefill_rate=8192 / 0.3, step_tokens=8192,
                  step_s=0.5) == pytest.approx(0.5e9)  # the prompt's own step, where longer
    assert budget(rate=1e9, overhead=1.0, prefill_rate=8192 / 0.3, step_tokens=8192) == 0.0  # never negative
