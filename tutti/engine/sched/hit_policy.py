"""Load or compute: how much of a stored prefix a request loads, from rates measured while serving.

Why: a hit is worth loading only while reading it is faster than computing it. From a slow disk
(the H200 prefills an 8B model's KV at about 3.5 GB/s) or behind a queue of other loads, loading
a whole hit makes a request slower than recomputing it, and under a closed-loop client the whole
server slower. The policy chooses, per request, how many of the hit's tokens to load (a chunk
boundary); vLLM computes the rest.

The interface is one method, so a policy can be tried from a notebook:

    class MyPolicy:
        def decide(self, q: HitQuery, rates: Rates) -> int:   # tokens to load, <= q.hit_tokens
            ...

chosen by `hit_policy` in the connector's config: "auto" (CostModel, the default), "always",
"never", a name given to `register_policy`, or "package.module:attr" (a class, a factory or
an instance). The planner rounds whatever comes back down to a chunk boundary.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from tutti.plugins import Registry


@dataclass(frozen=True)
class HitQuery:
    """One request's lookup, in tokens beyond what vLLM's own prefix cache already has."""

    hit_tokens: int  # the store holds this many (ends on a chunk boundary)
    prompt_tokens: int  # the prompt's tokens still to compute if nothing is loaded
    chunk_tokens: int
    bytes_per_token: float  # KV bytes one token moves on one worker (all its layers)
    step_tokens: int  # vLLM's step token budget (max_num_batched_tokens)
    asynchronous: bool  # loads run outside the batch (the request waits); else layer-wise in its step
    max_load_tokens: int | None = None  # the request's own cap (kv_transfer_params), None = none
    context_tokens: int = 0  # tokens before the prompt's uncomputed part (vLLM's own cached prefix)
    # the compute of one token attending to one earlier token, as a fraction of a token's other
    # compute (0: a token costs the same at any position). Attention makes a long prompt's back
    # dearer than its front: at 32k tokens on an 8B model the last token costs about twice the first.
    attention_weight: float = 0.0


def token_work(n: int, before: int, weight: float) -> float:
    """`n` prompt tokens after `before` others, in token-equivalents at zero context (what
    `Rates.prefill_tokens_per_s` counts): each costs 1 + weight * (the tokens before it)."""
    if n <= 0:
        return 0.0
    if weight <= 0:
        return float(n)
    return n * (1.0 + weight * (before + (n - 1) / 2.0))


def prefill_work(q: HitQuery, first: int, end: int) -> float:
    """Tokens `first`..`end` of the prompt's uncomputed part, in token-equivalents (`token_work`)."""
    return token_work(end - first, q.context_tokens + first, q.attention_weight)


def attention_weight(*, hidden: int, q_heads: int, kv_heads: int, head_dim: int, mlp: int,
                     attention_layers: int | None = None, layers: int) -> float:
    """`HitQuery.attention_weight` from a transformer's shape, in FLOPs: a token's projections and
    gated MLP cost 2 (h (2 q + 2 kv) d + 3 h f) per layer, its attention to one earlier token
    4 q d per attention layer (scores and values). An estimate: tutti measures the rate itself
    and this only says how a token's cost grows with its position (the H200's 8B steps of 4k and
    32k tokens fit 2.9e-5; this gives 3.8e-5)."""
    linear = 2.0 * layers * (hidden * (2 * q_heads + 2 * kv_heads) * head_dim + 3 * hidden * mlp)
    if linear <= 0:
        return 0.0
    attn = 4.0 * (layers if attention_layers is None else attention_layers) * q_heads * head_dim
    return max(0.0, attn / linear)


@dataclass(frozen=True)
class Rates:
    """What tutti measured while serving; None until measured."""

    load_bytes_per_s: float | None  # the storage's read rate, one worker's loads
    prefill_tokens_per_s: float | None  # the GPU's rate of computing prompt tokens (at zero context: prefill_work)
    queued_load_bytes: int = 0  # loads planned and not yet done (they are read first)
    prefill_backlog_tokens: int = 0  # prompt tokens known and not yet computed (computed first)
    load_age_s: float | None = None  # seconds since a load last measured the read rate
    load_overhead_s: float = 0.0  # a load's fixed cost beside its bytes (from loads of different sizes)
    step_s: float = 0.0  # a step's duration: an asynchronous hit is scheduled about 1.5 steps after its load
    batch_requests: int = 0  # other requests in the running batch: every step this prompt's compute lengthens delays them
    # what a layer-wise load's step took beyond max(its reads, its compute) in this model: the
    # pipeline's fill and drain, the forward's per-layer waits (RateMeter.layerwise_extra_s)
    layerwise_extra_s: float = 0.0


class HitPolicy(Protocol):
    def decide(self, q: HitQuery, rates: Rates) -> int: ...


#: A policy may say why it cut its last hit in `last_reason`: "rate" (its model: recomputing is
#: faster at these rates) or UNMEASURED (no read rate yet: one load measures it, the rest wait).
UNMEASURED = "unmeasured"


class Always:
    """Load every hit in full (tutti before load-or-compute)."""

    name = "always"

    def decide(self, q: HitQuery, rates: Rates) -> int:
        return q.hit_tokens


class Never:
    """Load nothing: every prompt is recomputed (stores still happen)."""

    name = "never"

    def decide(self, q: HitQuery, rates: Rates) -> int:
        return 0


class CostModel:
    """The `m` of chunk boundaries 0 .. hit that minimises the modelled latency it adds: the
    request's own time to its first token, plus what its compute adds to the steps it shares,
    once for each of the k other requests of the running batch (each waits for those steps):
        cost(m) = t(m) + k * g(m)
    Under a closed-loop client the summed latency is what sets throughput (Little's law): a
    hit that waits outside the batch for a slower read still wins when k requests would otherwise
    wait for its prefill. Ties go to loading more (it frees the GPU for the batch).

    Asynchronous loads (the request waits outside the batch): its loads queue behind the loads
    already planned, its compute behind the prompts already waiting, and the two queues drain
    side by side; a load costs a fixed o beside its bytes, and the request is scheduled about 1.5
    steps (s each) after its load ends (the receipt goes out with the end of the step it ended
    in; under asynchronous scheduling the step after that was already scheduled), so
        t(m) = max(o + (Q + m b) / R_load + 1.5 s, P / R_prefill) + W(m, n) / R_prefill   (m > 0)
        t(0) = (P + W(0, n)) / R_prefill
    Under load (P large) a slow disk still wins: it adds prefill capacity beside the GPU.
    W(a, b) is the compute of the prompt's tokens a..b (`prefill_work`): with attention counted,
    the back of a long prompt costs more per token than its front, so loading the front saves less
    than its share of the tokens and hiding its reads under the back's compute gets more time.

    and g(m) = W(m, n) / R_prefill: the batch does not wait for an asynchronous load.

    Layer-wise loads (in the step, overlapped with the suffix's compute; only the first step's
    suffix tokens overlap, so the model follows the step budget S):
        t(m) = max(o + (Q + m b) / R_load, W(m, m + c1) / R_prefill) + x + W(m + c1, n) / R_prefill,
        c1 = min(S, n - m)
    where x is what loading steps measured beyond that max (`RateMeter.layerwise_extra_s`: on the
    H200 an 8k hit whose model promised 7% over recomputing took 16% longer, 50-70 ms of fill,
    drain and per-layer waits; without x the policy chose loads at the balance point, where
    overlapping pays least and costs most)
    and g(m) = t(m) less the prefill backlog's wait: the whole step waits for the layers it loads.

    Until the read rate is measured it loads a hit whole when no other load is queued (that is
    how the rate gets measured) and recomputes otherwise, so a burst of first hits does not pile
    onto a storage of unknown speed; until the prefill rate is measured it loads. A rate that
    said "recompute" for `probe_after_s` is measured again with one hit (when no load is queued):
    the storage may have become faster, or the writes that slowed it may have stopped. Every
    candidate is evaluated, so it never chooses worse than "load all" or "recompute all" in its
    own model (with k = 0 the model is the request's time alone).
    """

    name = "auto"

    def __init__(self, probe_after_s: float = 30.0) -> None:
        self.probe_after_s = probe_after_s

    def decide(self, q: HitQuery, rates: Rates) -> int:
        self.last_reason = "rate"  # why a hit was cut, for the declined counters (UNMEASURED or the rate model)
        if q.hit_tokens <= 0:
            return 0
        rl, rp = rates.load_bytes_per_s, rates.prefill_tokens_per_s
        if not rl or rl <= 0:
            self.last_reason = UNMEASURED
            return q.hit_tokens if rates.queued_load_bytes == 0 else 0
        if not rp or rp <= 0:
            return q.hit_tokens
        ms = candidates(q)
        costs = self.costs(q, rates, ms)
        best_m, best_t = 0, self.cost(q, rates, 0)
        for m, t in zip(ms, costs):
            if t <= best_t * (1 + 1e-9):
                best_m, best_t = m, t
        if best_m == 0 and rates.queued_load_bytes == 0 and rates.load_age_s is not None \
                and rates.load_age_s > self.probe_after_s:
            return q.hit_tokens  # a probe: the rate is old
        return best_m

    @staticmethod
    def costs(q: HitQuery, rates: Rates, ms: Sequence[int]) -> list[float]:
        """`cost(q, rates, m)` for every m > 0 of `ms`, the same floats, in one loop. vLLM asks
        again at every step for a request that waits at the head of its queue, and an 8k-token hit
        has 32 candidates: priced through `cost`, they were the larger part of a lookup's time
        (`python3 bench/hook_cost.py --workload prefixes --tiers`, results/hook_cost.md).
        `tests/engine/sched/test_hit_policy.py` holds it equal to `cost`."""
        rl, rp = float(rates.load_bytes_per_s), float(rates.prefill_tokens_per_s)
        n, ctx, w, bpt = q.prompt_tokens, q.context_tokens, q.attention_weight, q.bytes_per_token
        cw = rates.prefill_backlog_tokens / rp
        o, queued, k = rates.load_overhead_s, rates.queued_load_bytes, max(0, rates.batch_requests)
        out: list[float] = []
        # prefill_work(q, a, b) written out: nn = b - a tokens after ctx + a others
        if q.asynchronous:
            wait = 1.5 * rates.step_s
            for m in ms:
                nn = n - m
                rest = (0.0 if nn <= 0 else float(nn) if w <= 0 else nn * (1.0 + w * ((ctx + m) + (nn - 1) / 2.0))) / rp
                load = o + (queued + m * bpt) / rl
                t = max(load + wait, cw) + rest
                out.append(t + k * rest)
            return out
        s1, x = max(q.step_tokens, 1), max(0.0, rates.layerwise_extra_s)
        for m in ms:
            c1 = min(s1, n - m)
            e1, n2 = m + c1, n - m - c1
            first = 0.0 if c1 <= 0 else float(c1) if w <= 0 else c1 * (1.0 + w * ((ctx + m) + (c1 - 1) / 2.0))
            rest = 0.0 if n2 <= 0 else float(n2) if w <= 0 else n2 * (1.0 + w * ((ctx + e1) + (n2 - 1) / 2.0))
            load = o + (queued + m * bpt) / rl
            t = cw + max(load, first / rp) + x + rest / rp
            out.append(t + k * (t - cw))
        return out

    @classmethod
    def cost(cls, q: HitQuery, rates: Rates, m: int) -> float:
        """The modelled latency loading `m` tokens adds, the request's and its batch's."""
        return cls.time(q, rates, m) + max(0, rates.batch_requests) * cls.shared_time(q, rates, m)

    @staticmethod
    def shared_time(q: HitQuery, rates: Rates, m: int) -> float:
        """The seconds the request's prefill (and, layer-wise, its loads) adds to shared steps."""
        rp = float(rates.prefill_tokens_per_s)
        if m <= 0:
            return prefill_work(q, 0, q.prompt_tokens) / rp
        if q.asynchronous:
            return prefill_work(q, m, q.prompt_tokens) / rp
        # layer-wise: the request's own time less its wait for the prefill backlog (the batch waits
        # for the step's loads and the prompt's compute, not for the prompts ahead of it)
        return CostModel.time(q, rates, m) - rates.prefill_backlog_tokens / rp

    @staticmethod
    def time(q: HitQuery, rates: Rates, m: int) -> float:
        """The modelled seconds to the request's first token when it loads `m` tokens."""
        rl, rp = float(rates.load_bytes_per_s), float(rates.prefill_tokens_per_s)
        n = q.prompt_tokens
        compute_wait = rates.prefill_backlog_tokens / rp
        if m <= 0:
            return compute_wait + prefill_work(q, 0, n) / rp
        load = rates.load_overhead_s + (rates.queued_load_bytes + m * q.bytes_per_token) / rl
        if q.asynchronous:  # reported at the end of the step it ends in, scheduled a step later
            return max(load + 1.5 * rates.step_s, compute_wait) + prefill_work(q, m, n) / rp
        c1 = min(max(q.step_tokens, 1), n - m)
        return compute_wait + max(load, prefill_work(q, m, m + c1) / rp) + max(0.0, rates.layerwise_extra_s) \
            + prefill_work(q, m + c1, n) / rp


def candidates(q: HitQuery) -> list[int]:
    """Loadable token counts: the hit cut at each chunk boundary it crosses (the first may be a
    partial chunk past vLLM's own cache), within the request's cap."""
    cap = q.hit_tokens if q.max_load_tokens is None else min(q.hit_tokens, max(0, q.max_load_tokens))
    first = q.hit_tokens % q.chunk_tokens or q.chunk_tokens
    return list(range(first, cap + 1, q.chunk_tokens))


@dataclass
class RateMeter:
    """Rates measured from the engine's own work: decayed sums, so a change of load shows up
    within a few dozen steps and one outlier does not decide alone."""

    decay: float = 0.9
    load_bytes: float = 0.0
    load_seconds: float = 0.0
    prefill_tokens: float = 0.0
    prefill_seconds: float = 0.0
    min_step_tokens: int = 256  # steps with fewer scheduled tokens are decode-bound: not a prefill rate
    max_gap_s: float = 5.0  # a longer gap between steps was an idle server, not a step
    step_seconds: float = 0.0  # decayed sum of every step's duration (decode steps too)
    steps: float = 0.0
    # step -> (tokens, when scheduled, loads layer-wise, work, the bytes it loads layer-wise)
    _pending: dict = field(default_factory=dict)
    # the last layer-wise loading steps' durations beyond the model's max(reads, compute)
    extras: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    _last_done: float | None = None
    _seq: int = 0
    _last_load: float | None = None
    # the last loads as (bytes, seconds): a fit of seconds = o + bytes / R gives the fixed cost o
    _samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=32))

    def on_loads(self, nbytes: int, seconds: float, now: float | None = None) -> None:
        """A read-rate sample: `nbytes` read in `seconds` while the reads were what was waited for
        (a whole load: all of it; a layer-wise load: up to its last read the forward waited on).
        (0, 0) says loads ran and hid under compute: no rate, but the rate is not stale."""
        if nbytes == 0 and seconds == 0:
            self._last_load = time.monotonic() if now is None else now
            return
        if nbytes > 0 and seconds >= 0:
            self.load_bytes = self.load_bytes * self.decay + nbytes
            self.load_seconds = self.load_seconds * self.decay + max(seconds, 1e-6)
            self._last_load = time.monotonic() if now is None else now
            self._samples.append((float(nbytes), float(seconds)))
        elif nbytes == 0 and seconds > 0 and self.load_seconds > 0:
            self.load_seconds += seconds  # time that moved nothing (failed loads): the store is slower

    def load_age(self, now: float | None = None) -> float | None:
        """Seconds since a load was last measured (None: never)."""
        if self._last_load is None:
            return None
        return (time.monotonic() if now is None else now) - self._last_load

    def on_scheduled(self, step: int, scheduled_tokens: int, now: float | None = None,
                     work: float | None = None) -> None:
        """Step `step` was scheduled with this many tokens (its duration is known when it is done);
        `work`: their compute in token-equivalents at zero context (`prefill_work`), when the
        scheduler knows their positions, so a step of long prompts does not read as a slow GPU."""
        now = time.monotonic() if now is None else now
        self._pending[step] = (scheduled_tokens, now, False, scheduled_tokens if work is None else work, 0)
        while len(self._pending) > 256:  # steps never reported (a worker that skipped them): forgotten
            self._pending.pop(next(iter(self._pending)))

    def loads_in(self, step: int, nbytes: int = 0) -> None:
        """Step `step` loads `nbytes` layer-wise: its duration includes the forward's waits for
        reads, so it is a step time but not a prefill rate (counted as one, a slow disk made the GPU
        look slow, which made loading look better: the policy's own loads fed its choice). It
        measures instead what such a step costs beyond max(reads, compute) (`layerwise_extra_s`)."""
        got = self._pending.get(step)
        if got is not None:
            self._pending[step] = (got[0], got[1], True, got[3], got[4] + int(nbytes))

    def on_done(self, step: int, now: float | None = None) -> None:
        """Step `step`'s output reached the scheduler (its worker report came with it). Its
        duration runs from when the GPU could start it, the later of its scheduling and the last
        step's end: under vLLM's asynchronous scheduling steps are scheduled a step ahead, so the
        time between schedulings is not a step's duration (it read prefill rates 5x too high)."""
        got = self._pending.pop(step, None)
        if got is None:  # another worker's copy of a step already counted, or an unknown step
            return
        now = time.monotonic() if now is None else now
        tokens, scheduled_at, loading, work, load_bytes = got
        start = scheduled_at if self._last_done is None else max(scheduled_at, self._last_done)
        self._last_done = now
        took = now - start
        if not 0 < took <= self.max_gap_s:
            return
        self.step_seconds = self.step_seconds * self.decay + took
        self.steps = self.steps * self.decay + 1
        if tokens >= self.min_step_tokens and not loading:
            self.prefill_tokens = self.prefill_tokens * self.decay + work
            self.prefill_seconds = self.prefill_seconds * self.decay + took
        elif loading and load_bytes > 0:
            o, rate = self.load_model()
            rp = self.prefill_rate
            if rate and rp:
                self.extras.append(took - max(o + load_bytes / rate, work / rp))

    @property
    def layerwise_extra_s(self) -> float:
        """What a layer-wise loading step took beyond max(its reads, its compute) as modelled from
        the rates measured before it: the lower median of the last 8 such steps, 0 until 3 were
        measured, never negative. A step slowed by something else (a 0.45 s stall on a busy
        2-core machine) must not stop the loads that follow: a policy that stops loading takes no
        new sample to correct it."""
        return max(0.0, statistics.median_low(self.extras)) if len(self.extras) >= 3 else 0.0

    def on_step(self, scheduled_tokens: int, now: float | None = None) -> None:
        """A synchronous scheduler's view, for tests and tools: a step is scheduled when the last
        one is done."""
        now = time.monotonic() if now is None else now
        self._seq += 1
        if self._seq - 1 in self._pending:
            self.on_done(self._seq - 1, now)
        self.on_scheduled(self._seq, scheduled_tokens, now)

    @property
    def load_rate(self) -> float | None:
        return self.load_bytes / self.load_seconds if self.load_seconds > 0 else None

    @property
    def step_time(self) -> float:
        """A step's recent duration (0 until two steps were seen)."""
        return self.step_seconds / self.steps if self.steps > 0 else 0.0

    def load_model(self) -> tuple[float, float | None]:
        """(fixed seconds per load, read rate): a least-squares line seconds = o + bytes / R
        through the last loads, when their sizes differ enough to tell o from R (o within
        [0, the fastest load]); else (0, the decayed rate), which then carries any fixed cost."""
        rate = self.load_rate
        pts = list(self._samples)
        if len(pts) < 4 or rate is None:
            return 0.0, rate
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        if mx <= 0 or math.sqrt(sxx / len(xs)) < 0.25 * mx:
            return 0.0, rate
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        o = min(my - slope * mx, min(ys))
        if slope <= 0 or o <= 0:
            return 0.0, rate
        return o, 1.0 / slope

    def seed(self, prefill_tokens_per_s: float | None = None, step_s: float | None = None) -> None:
        """Priors from an earlier run (tutti.store.hints), weighted as one sample each: the first
        measured steps outweigh them within a few dozen steps (the decay)."""
        if prefill_tokens_per_s and self.prefill_seconds == 0:
            self.prefill_tokens, self.prefill_seconds = float(prefill_tokens_per_s), 1.0
        if step_s and self.steps == 0:
            self.step_seconds, self.steps = float(step_s), 1.0

    @property
    def prefill_rate(self) -> float | None:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else None


_REGISTRY = Registry("hit_policy", "register_policy", {"auto": CostModel, "always": Always, "never": Never},
                     ("decide",), doc="tutti.engine.sched.hit_policy")
register_policy = _REGISTRY.register  # (name, class or no-argument factory): choosable as hit_policy
available_policies = _REGISTRY.names
get_policy = _REGISTRY.get  # a registered name, "package.module:attr", or an object with decide (passed through)


def chunk_floor(tokens: int, q: HitQuery) -> int:
    """A policy's answer as a loadable count: within [0, hit], on a candidate boundary."""
    if not isinstance(tokens, (int, float)) or isinstance(tokens, bool) or math.isnan(tokens):
        raise ValueError(f"hit policy returned {tokens!r}: expected a number of tokens")
    t = int(max(0, min(q.hit_tokens, tokens)))
    best = 0
    for m in candidates(q):
        if m <= t:
            best = m
    return best
