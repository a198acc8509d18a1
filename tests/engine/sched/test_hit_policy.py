"""The hit policy (load or compute) against a model of rates, and in the planner."""

import random

import pytest

from tutti.engine.sched.hit_policy import (Always, CostModel, HitQuery, Never, RateMeter, Rates, attention_weight,
                                     candidates, chunk_floor, get_policy, prefill_work, register_policy)
from tutti.engine.sched.planner import PROBE_UNDER_STEP, Planner
from tutti.engine.plan import WorkerReport

B8 = 131072  # bytes a token of the 8B geometry (bf16, 32 layers, 8 KV heads of 128)
PREFILL = 27000.0  # tokens/s, the H200's 8B prefill
W8 = attention_weight(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32)  # Llama 3 8B


def q(hit, prompt, *, asynchronous=True, step=8192, cap=None, chunk=256):
    return HitQuery(hit_tokens=hit, prompt_tokens=prompt, chunk_tokens=chunk, bytes_per_token=B8, step_tokens=step,
                    asynchronous=asynchronous, max_load_tokens=cap)


def test_unmeasured_rates_load_one_hit_at_a_time():
    """A read rate not yet measured: a hit loads whole when no load is queued (it measures the
    rate) and is recomputed otherwise (a burst of first hits does not pile onto a slow disk)."""
    assert CostModel().decide(q(8192, 8320), Rates(None, PREFILL)) == 8192
    assert CostModel().decide(q(8192, 8320), Rates(None, PREFILL, queued_load_bytes=1 << 30)) == 0
    assert CostModel().decide(q(8192, 8320), Rates(1e9, None)) == 8192


def test_an_old_rate_that_said_recompute_is_probed_again():
    slow = dict(load_bytes_per_s=1.0e9, prefill_tokens_per_s=PREFILL)
    assert CostModel().decide(q(8192, 8320), Rates(**slow, load_age_s=5.0)) == 0
    assert CostModel().decide(q(8192, 8320), Rates(**slow, load_age_s=31.0)) == 8192
    assert CostModel().decide(q(8192, 8320), Rates(**slow, load_age_s=31.0, queued_load_bytes=1)) == 0


def test_async_fast_storage_loads_slow_storage_recomputes_when_idle():
    fast, slow = Rates(20e9, PREFILL), Rates(1.0e9, PREFILL)  # 20 GB/s RAM; a 1 GB/s disk (< 3.5 GB/s of prefill KV)
    assert CostModel().decide(q(8192, 8320), fast) == 8192
    assert CostModel().decide(q(8192, 8320), slow) == 0


def test_async_slow_storage_still_loads_under_a_prefill_backlog():
    """Behind 50k prompt tokens of other requests (about 1.9 s of prefill), a 1 GB/s disk's 1.07 s
    read finishes first: the disk adds prefill capacity beside the GPU."""
    busy = Rates(1.0e9, PREFILL, prefill_backlog_tokens=50000)
    assert CostModel().decide(q(8192, 8320), busy) == 8192
    # ... but not behind a queue of other loads that takes longer than the backlog
    queued = Rates(1.0e9, PREFILL, queued_load_bytes=int(3e9), prefill_backlog_tokens=50000)
    assert CostModel().decide(q(8192, 8320), queued) == 0


def test_a_running_batch_makes_a_slow_read_worth_it():
    """Idle, a 1 GB/s disk's 4k read (0.54 s, plus 1.5 steps of 0.1 s) loses to 0.16 s of
    prefill. With 7 requests decoding beside it, each would wait those 0.16 s of prefill too, so
    the read (the batch does not wait for it) wins; behind a long queue of other reads it loses
    again."""
    qq = q(4096, 4096 + 128)
    idle = Rates(1.0e9, PREFILL, step_s=0.1)
    busy = Rates(1.0e9, PREFILL, step_s=0.1, batch_requests=7)
    assert CostModel().decide(qq, idle) == 0
    assert CostModel().decide(qq, busy) == 4096
    assert CostModel.cost(qq, busy, 4096) < CostModel.cost(qq, busy, 0)
    assert CostModel.time(qq, busy, 4096) > CostModel.time(qq, busy, 0)  # the request itself waits longer
    queued = Rates(1.0e9, PREFILL, step_s=0.1, batch_requests=7, queued_load_bytes=int(4e9))
    assert CostModel().decide(qq, queued) == 0
    # layer-wise, the batch waits for the step's reads too: a read slower than the step's compute
    # is not pushed onto the batch
    lw = q(4096, 4096 + 128, asynchronous=False)
    assert CostModel.shared_time(lw, busy, 4096) > CostModel.shared_time(lw, busy, 0) > 0


def test_layerwise_overlaps_the_load_with_the_suffixs_compute():
    """In the step (layer-wise), loading the front m tokens while the step computes the rest costs
    max(load(m), compute(rest)): from a 1.7 GB/s disk an 8k hit beats both load-all and compute-all."""
    qq, rates = q(8192, 8192 + 128, asynchronous=False), Rates(1.7e9, PREFILL)
    m = CostModel().decide(qq, rates)
    t = lambda k: CostModel.time(qq, rates, k)  # noqa: E731
    assert 0 < m < 8192 and m % 256 == 0
    assert t(m) < 0.8 * min(t(0), t(8192))
    assert t(m) == min(t(k) for k in [0] + candidates(qq))


def test_never_worse_than_either_end_in_its_own_model():
    rng = random.Random(3)
    for _ in range(2000):
        chunk = rng.choice([16, 64, 256])
        local = rng.randrange(0, 4) * 16
        hit = rng.randrange(1, 64) * chunk - local
        if hit <= 0:
            continue
        qq = HitQuery(hit, hit + rng.randrange(1, 4000), chunk, rng.choice([4096.0, B8, 4 * B8]),
                      rng.choice([512, 2048, 8192]), rng.random() < 0.5,
                      rng.choice([None, None, rng.randrange(0, hit + chunk)]),
                      context_tokens=rng.choice([0, 0, 5000]), attention_weight=rng.choice([0.0, W8, 1e-3]))
        rates = Rates(10 ** rng.uniform(7, 11), 10 ** rng.uniform(3, 5), rng.randrange(0, 1 << 32),
                      rng.randrange(0, 100000), step_s=rng.choice([0.0, 0.01, 0.2]),
                      batch_requests=rng.choice([0, 0, 3, 31]))
        m = CostModel().decide(qq, rates)
        allowed = [0] + candidates(qq)
        assert m in allowed
        ends = [CostModel.cost(qq, rates, 0)] + ([CostModel.cost(qq, rates, allowed[-1])] if len(allowed) > 1 else [])
        assert CostModel.cost(qq, rates, m) <= min(ends) * (1 + 1e-9)


def test_the_requests_cap_is_honoured_on_a_chunk_boundary():
    assert candidates(q(1000, 2000, chunk=256)) == [232, 488, 744, 1000]  # vLLM's own cache ends mid-chunk
    assert chunk_floor(Always().decide(q(8192, 9000, cap=1000), Rates(None, None)), q(8192, 9000, cap=1000)) == 768
    assert chunk_floor(8192, q(8192, 9000, cap=0)) == 0
    assert chunk_floor(300, q(8192, 9000)) == 256 and chunk_floor(-5, q(8192, 9000)) == 0
    with pytest.raises(ValueError, match="expected a number of tokens"):
        chunk_floor("all", q(8192, 9000))


class Half:
    def decide(self, query, rates):
        return query.hit_tokens // 2


def test_policies_by_name_module_attr_and_registry():
    assert isinstance(get_policy("auto"), CostModel) and isinstance(get_policy("never"), Never)
    assert isinstance(get_policy(f"{__name__}:Half"), Half)
    register_policy("half-test", Half)
    assert isinstance(get_policy("half-test"), Half)
    with pytest.raises(ValueError, match=r"hit_policy='nope': unknown; expected one of .*'auto'"):
        get_policy("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        get_policy("no_such_module_xyz:Policy")
    from tutti.engine.config.settings import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="hit_policy='nope'"):
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "hit_policy": "nope"})


def test_rate_meter_ignores_decode_steps_and_idle_gaps():
    m = RateMeter()
    m.on_step(8192, now=0.0)
    m.on_step(8192, now=0.3)   # the first step took 0.3 s for 8192 tokens
    m.on_step(8, now=0.6)      # the second, 0.3 s
    m.on_step(8192, now=0.61)  # a decode step (8 tokens): not a prefill rate
    m.on_step(8192, now=60.0)  # an idle server between: not a step
    assert m.prefill_rate == pytest.approx(8192 / 0.3)
    assert m.load_rate is None
    m.on_loads(2 << 30, 1.0)
    m.on_loads(0, 0.0)
    assert m.load_rate == pytest.approx(2 << 30)
    m.on_loads(1 << 30, 0.0)  # a layer-wise load the forward never waited for: fast storage
    assert m.load_rate > 2.9 * (1 << 30)


def planner(policy, chunk=32, slot_bytes=32 * 1000):
    p = Planner(num_slots=64, chunk_tokens=chunk, block_size=16, seed=b"s" * 32, slot_bytes=slot_bytes,
                hit_policy=policy, asynchronous=True)
    return p


def store_prefix(p, tokens, req="w"):
    p.match(req, tokens, 0)
    p.on_alloc(req, list(range(len(tokens) // 16 + 1)), 0)
    plan = p.build_step({req: len(tokens)}, {req: 0})
    p.on_report(WorkerReport(stored=[st.ticket for st in plan.stores], steps_done=[plan.step]))
    p.finished(req)


def test_planner_loads_what_the_policy_chose_and_counts_the_rest():
    p = planner(Half())
    toks = list(range(1, 200))
    store_prefix(p, toks)  # 6 chunks of 32
    n = p.match("r", toks + [7, 8], 0)
    assert p.match("r", toks + [7, 8], 0) == n == 96  # vLLM may look a request up again: counted once
    p.on_alloc("r", list(range(20)), n, async_load=True)
    assert p.stats.hit_tokens == 96 and p.stats.declined_hit_tokens == 96 and p.stats.async_hit_tokens == 96
    plan = p.build_step({}, {})
    assert len(plan.async_loads) == 3  # chunks 0..2 only
    assert sum(p._step_load_bytes.values()) == 3 * 32 * 1000  # queued until reported done
    p.on_report(WorkerReport(steps_done=[plan.async_step], bytes_loaded=3 * 32000, load_seconds=0.5,
                             rate_bytes=3 * 32000, rate_seconds=0.5))
    assert not p._step_load_bytes and p.meter.load_rate == pytest.approx(3 * 32000 / 0.5)


def test_a_failing_policy_loads_the_whole_hit():
    class Broken:
        def decide(self, query, rates):
            raise RuntimeError("bug in a notebook")

    p = planner(Broken())
    toks = list(range(1, 200))
    store_prefix(p, toks)
    assert p.match("r", toks + [1], 0) == 192


def test_the_cost_model_in_the_planner_declines_a_slow_store_when_idle():
    p = planner(CostModel(), slot_bytes=32 * B8)
    toks = list(range(1, 200))
    store_prefix(p, toks)
    p.meter.on_loads(int(1e9), 1.0)  # measured: 1 GB/s
    for t in (0.0, 0.3, 0.6):
        p.meter.on_step(8192, now=t)  # measured: 27k tokens/s
    assert p.match("r", toks + [1], 0) == 0
    p.on_alloc("r", list(range(20)), 0)
    assert p.stats.declined_hit_tokens == 192 and p.stats.hit_tokens == 0
    p.meter.on_loads(int(1e12), 1.0)  # the storage turned out fast: load
    for i in range(60):  # a decoding server: 1 ms steps (an asynchronous hit waits about 1.5 of them)
        p.meter.on_step(8, now=1.0 + i * 0.001)
    assert p.match("s", toks + [2], 0) == 192


def test_the_meter_fits_a_fixed_cost_per_load_beside_the_rate():
    from tutti.engine.sched.hit_policy import RateMeter

    m = RateMeter()
    for nbytes in (1e6, 4e6, 16e6, 64e6, 2e6, 32e6):  # 20 ms each, plus 1 GB/s
        m.on_loads(int(nbytes), 0.020 + nbytes / 1e9)
    o, rate = m.load_model()
    assert o == pytest.approx(0.020, rel=1e-6) and rate == pytest.approx(1e9, rel=1e-6)
    same = RateMeter()
    for _ in range(8):  # loads of one size cannot tell a fixed cost from a rate: the rate carries it
        same.on_loads(int(8e6), 0.028)
    assert same.load_model() == (0.0, pytest.approx(8e6 / 0.028))


def test_short_hits_recompute_where_a_load_costs_more_than_its_tokens():
    """Fast storage, 20 ms per load and 10 ms steps: a 2-chunk hit is recomputed (its tokens take
    2 ms), a long hit on the same storage is loaded."""
    q = lambda hit, n: HitQuery(hit_tokens=hit, prompt_tokens=n, chunk_tokens=256, bytes_per_token=131072,
                                step_tokens=8192, asynchronous=True)
    rates = Rates(load_bytes_per_s=20e9, prefill_tokens_per_s=27000, load_overhead_s=0.020, step_s=0.010)
    assert CostModel().decide(q(512, 600), rates) == 0
    assert CostModel().decide(q(16384, 16500), rates) == 16384
    assert CostModel().decide(q(512, 600), Rates(20e9, 27000)) == 512  # no fixed cost known: loaded


def test_the_start_up_probe_gives_a_fresh_planner_its_read_rate():
    """A fresh server on a slow store: without the probe the first hit would be loaded whole
    (rate unknown); with the workers' probe in their first report the cost model recomputes."""
    p = planner(CostModel(), slot_bytes=32 * B8)
    toks = list(range(1, 200))
    store_prefix(p, toks)
    for t in (0.0, 0.3, 0.6):
        p.meter.on_step(8192, now=t)  # prefill measured: 27k tokens/s
    assert p.meter.load_rate is None and p.match("a", toks + [1], 0) == 192
    p.finished("a")
    p.on_report(WorkerReport(probe_bytes=2 * 10**8, probe_seconds=0.2, workers=2))  # 0.1 GB in 0.2 s each
    # read with the GPU idle: taken as 0.8 of it under a step (PROBE_UNDER_STEP)
    assert p.meter.load_rate == pytest.approx(0.5e9 * PROBE_UNDER_STEP) and p.stats.bytes_loaded == 0
    assert p.match("b", toks + [2], 0) == 0


def test_rate_meter_times_steps_from_their_outputs_under_async_scheduling():
    """vLLM's asynchronous scheduler schedules a step before the last one is done: the time
    between schedulings is not a step's duration (it read prefill rates 5x too high on the H200).
    A step runs from the later of its scheduling and the last step's end to its output."""
    m = RateMeter()
    m.on_scheduled(1, 8192, now=0.0)
    m.on_scheduled(2, 8192, now=0.01)  # a step ahead
    m.on_done(1, now=0.3)
    m.on_scheduled(3, 8192, now=0.31)
    m.on_done(2, now=0.6)
    m.on_done(2, now=0.6)  # another worker's copy of the same step: counted once
    m.on_done(3, now=0.9)
    assert m.prefill_rate == pytest.approx(8192 / 0.3)
    assert m.step_time == pytest.approx(0.3)
    m.on_scheduled(4, 8192, now=20.0)  # after an idle server: timed from its own scheduling
    m.on_done(4, now=20.3)
    assert m.prefill_rate == pytest.approx(8192 / 0.3)


def test_the_planner_times_steps_by_their_reports():
    p = planner(CostModel())
    plan = p.build_step({}, {})
    p.meter._pending[plan.step] = (8192, p.meter._pending[plan.step][1] - 0.25, False, 8192, 0)  # scheduled 0.25 s ago
    p.on_report(WorkerReport(steps_done=[plan.step]))
    assert 8192 / 0.3 < p.meter.prefill_rate < 8192 / 0.25


def budget_planner(budget):
    p = Planner(num_slots=64, chunk_tokens=32, block_size=16, seed=b"s" * 32, slot_bytes=32 * 1000,
                hit_policy=Always(), asynchronous=False)
    p.sync_budget, p.can_load_async = budget, True
    return p


def test_a_hit_past_the_steps_sync_budget_loads_asynchronously():
    """Layer-wise mode with a byte budget per step (sync_load_budget_bytes): hits within it load
    in the step, the hit that would pass it loads asynchronously (the request waits outside the
    batch), and the next step has a fresh budget."""
    p = budget_planner(100_000)  # 1000 B a token: 100 tokens a step
    toks = list(range(1, 200))
    store_prefix(p, toks)
    assert p.match("a", toks[:70] + [1], 0) == 64 and not p.wants_async("a")  # 64 kB: within
    assert p.match("b", toks + [2], 0) == 192 and p.wants_async("b")  # 64 + 192 kB: past it
    p.on_alloc("b", list(range(13)), 192, async_load=p.wants_async("b"))
    assert p.stats.async_hit_tokens == 192
    p.build_step({}, {})
    assert p.match("c", toks[:70] + [3], 0) == 64 and not p.wants_async("c")  # a new step: within again
    off = budget_planner("off")
    store_prefix(off, toks)
    assert off.match("d", toks + [4], 0) == 192 and not off.wants_async("d")


def test_the_auto_budget_is_what_the_read_rate_moves_in_one_full_step():
    p = budget_planner("auto")
    assert p.sync_budget_bytes() is None  # nothing measured: no budget yet
    p.meter.on_loads(int(1e9), 1.0)  # 1 GB/s
    for t in (0.0, 0.3, 0.6):
        p.meter.on_step(8192, now=t)  # 27k tokens/s: a full step of 8192 tokens takes 0.3 s
    assert p.sync_budget_bytes() == pytest.approx(0.3e9, rel=1e-6)


def budgeted_32k_hit(read_bps: float, warmup_s: float):
    """An 8B 32k hit, layer-wise at a 32768-token step with the auto budget, after a read rate
    and a 4096-token warm-up prompt taking `warmup_s`: (the planner, the tokens it takes)."""
    p = Planner(num_slots=256, chunk_tokens=256, block_size=16, seed=b"s" * 32, slot_bytes=256 * B8,
                hit_policy=CostModel(), asynchronous=False, step_tokens=32768)
    p.sync_budget, p.can_load_async = "auto", True
    p.attention_weight = W8
    toks = list(range(1, 32769))
    store_prefix(p, toks)
    p.meter.on_loads(int(read_bps), 1.0)
    p.meter.prefill_tokens, p.meter.prefill_seconds = 4096 * (1 + W8 * 2047.5), warmup_s
    return p, p.match("r", toks, 0)


def test_the_auto_budget_holds_a_long_prompts_own_first_step():
    """load_or_compute/2026-12-03_8b_32k_lookahead_auto.json (H200, 8B, 32k hit at a 32768-token step budget, disk at 1.8 GB/s): counting
    attention, the policy chose to hide about 13k tokens' reads under the suffix's first step, but
    the budget, a step of fresh tokens (0.81 s), was smaller, so the hit went asynchronous and
    loaded whole (1.9x recompute). The budget now holds the prompt's own first step."""
    # the warm-up's 4096-token prompt took 0.1107 s (its steps' work over their time)
    p, took = budgeted_32k_hit(1.836e9, 0.1107)
    assert not p.wants_async("r")
    assert 9000 < took < 20000, took
    assert p.sync_budget_bytes() < took * B8  # a step of fresh tokens would not have held it


class ByMode:
    """A policy that takes `sync` tokens layer-wise and `later` asynchronously."""

    def __init__(self, sync, later):
        self.sync, self.later = sync, later

    def decide(self, q, rates):
        return min(q.hit_tokens, self.later if q.asynchronous else self.sync)


def test_a_hit_a_chunk_past_the_budget_is_cut_to_it_unless_asynchronous_loads_more():
    """The policy's layer-wise choice one chunk past the step's budget: cut to the budget (where
    asynchronously, on a slow disk, it would load nothing); asynchronous where that loads more."""
    toks = list(range(1, 200))
    p = budget_planner(100_000)  # 100 tokens of 1000 B: 3 chunks of 32
    store_prefix(p, toks)
    p.hit_policy = ByMode(sync=128, later=0)
    assert p.match("a", toks + [1], 0) == 96 and not p.wants_async("a")
    assert p.match("b", toks + [2], 0) == 0  # the step's budget is spent, and asynchronously nothing
    q = budget_planner(100_000)
    store_prefix(q, toks)
    q.hit_policy = ByMode(sync=128, later=192)
    assert q.match("c", toks + [3], 0) == 192 and q.wants_async("c")


@pytest.mark.parametrize("gbps", [1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9])
def test_a_32k_hit_on_a_slow_disk_loads_its_front_whatever_chunk_the_balance_falls_on(gbps):
    """H200, 8B, 32k hit, a 32768-token step: the policy's balance point fell a chunk past the
    budget (the same balance, computed apart) in one call of two, and the hit went asynchronous,
    where a 1.5 GB/s disk loads nothing: 1.00x recompute against 0.86x in the other call."""
    p, took = budgeted_32k_hit(gbps * 1e9, 4096 / 43000)
    assert not p.wants_async("r")
    assert took > 4000, took


def test_a_request_looked_up_again_is_not_queued_ahead_of_itself():
    """vLLM looks a waiting request up again every step it finds no room: its own prompt was
    counted as prefill backlog ahead of it (a recompute looked as if it waited for itself)."""
    seen = []

    class Spy:
        def decide(self, query, rates):
            seen.append(rates.prefill_backlog_tokens)
            return 0

    p = planner(Spy())
    toks = list(range(1, 200))
    store_prefix(p, toks)
    p.match("other", [5000] * 300, 0)  # a prompt of 300 tokens waiting, nothing stored
    p.match("r", toks + [1], 0)
    p.match("r", toks + [1], 0)
    p.build_step({}, {})
    p.match("r", toks + [1], 0)
    assert seen == [300, 300, 300]
    p.finished("other")  # aborted while it waited
    p.match("r", toks + [1], 0)
    assert seen[-1] == 0


def test_the_planner_hands_the_policy_its_running_batch():
    seen = []

    class Spy:
        def decide(self, query, rates):
            seen.append(rates.batch_requests)
            return query.hit_tokens

    p = planner(Spy())
    toks = list(range(1, 200))
    store_prefix(p, toks)
    for i in range(3):
        p.match(f"d{i}", [9000 + i] * 40, 0)
        p.on_alloc(f"d{i}", [100 + 3 * i, 101 + 3 * i, 102 + 3 * i], 0)
    p.build_step({f"d{i}": 40 for i in range(3)}, {f"d{i}": 0 for i in range(3)})
    assert p.match("r", toks + [1], 0) == 192
    assert seen[-1] == 3
    # a request that finished waits for nothing (load_or_compute/2026-12-03_8b_32k_lookahead_auto.json: the warm-up prompt, done,
    # still counted as a batch of 1, made a 32k hit load whole from a slow disk asynchronously)
    p.finished("d0")
    p.finished("d1")
    assert p.match("r2", toks + [2], 0) == 192
    assert seen[-1] == 1


def test_a_step_that_loads_layer_wise_is_a_step_time_but_not_a_prefill_rate():
    """Its duration holds the forward's waits for reads: counted as a prefill rate, a slow disk
    made the GPU look slow and loading look better (on the H200 the meter fell from 36.9k to
    23.5k tokens/s after layer-wise hits, and the next hit loaded more)."""
    m = RateMeter()
    m.on_scheduled(1, 8192, now=0.0)
    m.on_done(1, now=0.25)  # a plain prefill step: 32.8k tokens/s
    m.on_scheduled(2, 8192, now=0.25)
    m.loads_in(2)
    m.on_done(2, now=0.75)  # the same tokens with a layer-wise load: twice as long
    assert m.prefill_rate == pytest.approx(8192 / 0.25)
    assert m.step_time == pytest.approx((0.25 * 0.9 + 0.5) / 1.9)
    m.on_loads(0, 0.0, now=1.0)  # loads that hid under compute: no rate, but a fresh one
    assert m.load_rate is None and m.load_age(now=2.0) == pytest.approx(1.0)
    assert m.layerwise_extra_s == 0.0  # no read rate to model the step with: nothing learned


def test_a_layer_wise_step_measures_what_it_took_beyond_max_reads_compute():
    """The step of a layer-wise load took max(reads, compute) plus 60 ms (the pipeline's fill and
    drain, the forward's per-layer waits): the meter learns it from three such steps, one step
    stalled by something else does not move it, and steps faster than the model take it to 0,
    never below."""
    m = RateMeter()
    m.on_scheduled(1, 8192, now=0.0)
    m.on_done(1, now=0.2)  # 40,960 tokens/s
    m.on_loads(int(1e9), 1.0, now=0.2)  # 1 GB/s
    m.on_scheduled(2, 4096, now=0.2)
    m.loads_in(2, int(0.15e9))  # reads 0.15 s, compute 0.1 s
    m.on_done(2, now=0.2 + 0.15 + 0.06)
    assert list(m.extras) == [pytest.approx(0.06)] and m.layerwise_extra_s == 0.0  # one step: not yet

    def step(k: int, nbytes: float, took: float) -> None:
        m.on_scheduled(k, 4096, now=2.0 * k)
        m.loads_in(k, int(nbytes))
        m.on_done(k, now=2.0 * k + took)

    step(3, 0.05e9, 0.1 + 0.04)  # reads 0.05 s, compute 0.1 s, 40 ms more
    step(4, 0.05e9, 0.1 + 0.45)  # one step stalled by something else: not what loads cost
    assert m.layerwise_extra_s == pytest.approx(0.06)
    step(5, 0.05e9, 0.1 + 0.05)
    assert m.layerwise_extra_s == pytest.approx(0.05)  # the lower median of four
    for k in range(5, 13):  # steps faster than the model: the extra goes to 0, not below
        step(k, 0.05e9, 0.08)
    assert m.layerwise_extra_s == 0.0


def test_the_measured_layer_wise_extra_stops_loads_at_the_balance_point():
    """H200, 8B geometry, a 1.3 GB/s disk, 40k tokens/s of prefill, an 8k hit in one step: the
    model without the extra loaded 1,536 tokens for a promised 7% over recomputing; the step took
    16% longer than recomputing (0.245 against 0.211 s). With the 60 ms such steps measured, it
    recomputes; a 32k hit, where overlapping saves more than the extra, still loads its front."""
    rates = dict(load_bytes_per_s=1.32e9, prefill_tokens_per_s=40220.0)
    eight = HitQuery(hit_tokens=8192, prompt_tokens=8192, chunk_tokens=256, bytes_per_token=B8, step_tokens=32768,
                     asynchronous=False, attention_weight=W8)
    assert CostModel().decide(eight, Rates(**rates)) > 0
    assert CostModel().decide(eight, Rates(**rates, layerwise_extra_s=0.06)) == 0
    big = HitQuery(hit_tokens=32768, prompt_tokens=32768, chunk_tokens=256, bytes_per_token=B8, step_tokens=32768,
                   asynchronous=False, attention_weight=W8)
    m = CostModel().decide(big, Rates(**rates, layerwise_extra_s=0.06))
    assert m > 0
    assert CostModel.time(big, Rates(**rates, layerwise_extra_s=0.06), m) < \
        0.9 * CostModel.time(big, Rates(**rates, layerwise_extra_s=0.06), 0)


def test_the_planner_hands_the_policy_the_measured_layer_wise_extra():
    p = Planner(num_slots=64, chunk_tokens=32, block_size=16, seed=b"s" * 32, slot_bytes=32 * 1000,
                hit_policy=Always(), asynchronous=False)
    seen = []

    class Spy:
        def decide(self, q, rates):
            seen.append(rates.layerwise_extra_s)
            return q.hit_tokens

    p.meter.extras.extend([0.05, 0.05, 0.05])
    p.hit_policy = Spy()
    toks = list(range(1, 200))
    store_prefix(p, toks)
    assert p.match("r", toks + [7], 0) == 192
    assert seen == [pytest.approx(0.05)]


def test_the_planner_marks_its_layer_wise_steps_and_takes_rate_samples_only():
    p = Planner(num_slots=64, chunk_tokens=32, block_size=16, seed=b"s" * 32, slot_bytes=32 * 1000,
                hit_policy=Always(), asynchronous=False)
    toks = list(range(1, 200))
    store_prefix(p, toks)
    assert p.match("r", toks + [7], 0) == 192
    p.on_alloc("r", list(range(20)), 192)
    plan = p.build_step({"r": 8}, {"r": 192})
    assert plan.loads and p.meter._pending[plan.step][2] is True
    assert p.meter._pending[plan.step][4] == 6 * 32000  # the bytes the step loads
    # 6 chunks read, but the forward stalled only up to 2 of them, 0.1 s in: that is the rate
    p.on_report(WorkerReport(steps_done=[plan.step], bytes_loaded=6 * 32000, load_seconds=0.5,
                             rate_bytes=2 * 32000, rate_seconds=0.1))
    assert p.meter.load_rate == pytest.approx(2 * 32000 / 0.1)


def test_prefill_work_counts_each_token_by_its_position():
    qq = HitQuery(1000, 3000, 256, B8, 8192, False, context_tokens=700, attention_weight=1e-4)
    by_token = sum(1 + 1e-4 * (700 + i) for i in range(1200, 2500))
    assert prefill_work(qq, 1200, 2500) == pytest.approx(by_token)
    assert prefill_work(qq, 0, 1200) + prefill_work(qq, 1200, 3000) == pytest.approx(prefill_work(qq, 0, 3000))
    flat = HitQuery(1000, 3000, 256, B8, 8192, False)
    assert prefill_work(flat, 1200, 2500) == 1300 and prefill_work(qq, 5, 5) == 0
    assert 3e-5 < W8 < 4.5e-5  # the H200's 8B steps of 4k and 32k tokens fit 2.9e-5
    assert attention_weight(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
                            attention_layers=8) == pytest.approx(W8 / 4)


def test_a_long_prompts_back_costs_more_so_more_of_its_front_loads():
    """The 32k hit of load_or_compute/2026-12-03_8b_32k_budget32768.json: the step's suffix was computed at the rate of a 4k prompt
    while its back, attending to 10-32k tokens, runs at about two thirds of it. Counting attention,
    the back's compute hides more reads: the policy loads more of the front, and the modelled
    time comes closer to the measured one (1.08 s for 10,752 tokens loaded at 1.3 GB/s)."""
    # the prefill rate both models measured from the same 4k prompt of 0.1107 s
    rates_flat = Rates(1.3e9, 4096 / 0.1107)
    rates_attn = Rates(1.3e9, prefill_work(HitQuery(0, 4096, 256, B8, 32768, False, attention_weight=W8), 0, 4096)
                       / 0.1107)
    flat = q(32512, 32768, asynchronous=False, step=32768)
    attn = HitQuery(**{**flat.__dict__, "attention_weight": W8})
    m_flat, m_attn = CostModel().decide(flat, rates_flat), CostModel().decide(attn, rates_attn)
    assert m_attn > m_flat * 1.3
    assert CostModel.time(attn, rates_attn, 0) > 1.2  # recompute measured 1.22 s (flat: 0.89)
    assert CostModel.time(flat, rates_flat, 0) < 0.9
    # where the model says a token costs the same anywhere, both agree
    assert CostModel().decide(HitQuery(**{**flat.__dict__, "prompt_tokens": 32640}), rates_flat) == \
        CostModel().decide(HitQuery(**{**flat.__dict__, "prompt_tokens": 32640, "attention_weight": 0.0}), rates_flat)


def test_the_meter_counts_a_steps_work_so_long_prompts_do_not_read_as_a_slow_gpu():
    """Steps deep into long prompts take longer per token; counted in work (token-equivalents at
    zero context) the rate is the same as the front's, so a 4k prompt's step predicts a 32k one's."""
    rate, m, t = 40000.0, RateMeter(), 0.0
    for step, computed in enumerate((0, 16384, 0, 24576), start=1):  # 8192-token steps, front and deep
        work = 8192 * (1 + W8 * (computed + 8191 / 2))
        m.on_scheduled(step, 8192, now=t, work=work)
        t += work / rate
        m.on_done(step, now=t)
    assert m.prefill_rate == pytest.approx(rate)
    # the planner counts each scheduled request's tokens at their positions
    p = planner(CostModel())
    p.attention_weight = W8
    plan = p.build_step({"a": 8192, "b": 1}, {"a": 16384, "b": 30000})
    expected = 8192 * (1 + W8 * (16384 + 8191 / 2)) + 1 * (1 + W8 * 30000)
    assert p.meter._pending[plan.step][3] == pytest.approx(expected)


def test_the_probe_rate_discounted_chooses_the_first_hit_as_the_measured_rate_would():
    """load_or_compute/2026-12-03_8b_32k_attention_policy.json (H200, 32k hit, a step of 32768): the probe read 2.55 GB/s with the
    GPU idle, reads under the step ran at 2.14; the first hit chose from the probe and loaded
    15,104 tokens (0.84x of recompute), the next from the measured rate 13,568 (0.73x). Taken at
    PROBE_UNDER_STEP of itself, the probe's choice is closer to the measured rate's, and in the
    model under the rate the disk really read it is the faster one."""
    prefill = 42893.0  # token-equivalents/s at zero context, measured by the run's 4k prompt
    query = HitQuery(**{**q(32512, 32768, asynchronous=False, step=32768).__dict__, "attention_weight": W8})
    raw = CostModel().decide(query, Rates(2.55e9, prefill))
    discounted = CostModel().decide(query, Rates(2.55e9 * PROBE_UNDER_STEP, prefill))
    measured = CostModel().decide(query, Rates(2.14e9, prefill))
    assert raw > discounted and abs(discounted - measured) < abs(raw - measured)
    true = Rates(2.14e9, prefill)
    assert CostModel.time(query, true, discounted) < CostModel.time(query, true, raw)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_the_one_loop_cost_is_the_models_cost_to_the_last_bit(asynchronous):
    """`CostModel.costs` (every candidate in one loop, what `decide` uses) gives the very floats
    of `CostModel.cost`, so the policy's choices are the model's whatever the rates, the context,
    the attention weight or the batch; and decide picks what the reference loop picks."""
    rng = random.Random(7 if asynchronous else 8)

    def reference(qq, rates):
        best_m, best_t = 0, CostModel.cost(qq, rates, 0)
        for m in candidates(qq):
            t = CostModel.cost(qq, rates, m)
            if t <= best_t * (1 + 1e-9):
                best_m, best_t = m, t
        return best_m

    chosen = set()
    for _ in range(400):
        prompt = rng.randrange(300, 40000)
        hit = rng.randrange(1, prompt)
        qq = HitQuery(hit_tokens=hit, prompt_tokens=prompt, chunk_tokens=rng.choice([64, 256, 1024]),
                      bytes_per_token=rng.choice([B8, 81920, 4096]), step_tokens=rng.choice([0, 512, 2048, 8192]),
                      asynchronous=asynchronous, max_load_tokens=rng.choice([None, hit // 2]),
                      context_tokens=rng.choice([0, 0, rng.randrange(0, 8192)]), attention_weight=rng.choice([0.0, W8]))
        rates = Rates(load_bytes_per_s=10 ** rng.uniform(8.5, 10.7), prefill_tokens_per_s=10 ** rng.uniform(3.5, 5),
                      queued_load_bytes=rng.choice([0, rng.randrange(0, 1 << 32)]),
                      prefill_backlog_tokens=rng.choice([0, rng.randrange(0, 100000)]),
                      load_overhead_s=rng.choice([0.0, rng.uniform(0, 0.05)]), step_s=rng.uniform(0, 0.05),
                      batch_requests=rng.choice([-1, 0, 3, 7]), layerwise_extra_s=rng.choice([-0.01, 0.0, 0.06]))
        ms = candidates(qq)
        assert CostModel.costs(qq, rates, ms) == [CostModel.cost(qq, rates, m) for m in ms]
        got = CostModel().decide(qq, rates)
        assert got == reference(qq, rates)
        chosen.add("none" if got == 0 else "all" if got == max(ms, default=0) else "part")
    assert chosen == {"none", "all", "part"}  # the draws reach every kind of choice
