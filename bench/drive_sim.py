"""A loaded server over a drive slower than prefill, as a model: which store admission serves more?

The real Planner (lookups, the `auto` hit policy with its RateMeter, asynchronous loads, store
planning, holes) and the real admission policies, driven by a step-level model of the rest:
vLLM's scheduler (a token budget a step, FCFS, chunked prefill, `--concurrency` requests in
flight as `vllm bench serve --max-concurrency` keeps them), its GPU prefix cache (an LRU of
chunks), a GPU that computes a step in `overhead + prefill tokens / prefill rate`, and one drive
that moves reads and writes at one shared rate, reads first (tutti's `reads_first`), with a
staging ring of `--staging-chunks` stores in flight (a store past it is skipped, as the worker
skips it). The workload is serve_workload.py's prefix_repetition. Time is simulated (the
RateMeter reads the model's clock), so a run takes seconds on any machine and gives the same
figures everywhere. It is a model: it says which policy to measure on a GPU, not what a GPU does.

    python3 bench/drive_sim.py [--drive-gbps 1.6] [--admissions all,drive_share,seen_twice,share:0.5] [--out F]

`--stores` compares where chunks live: "disk" (one root on the drive, the default), "ram" (one
RAM root of `--ram-chunks`, read and written at `--ram-gbps`), "tiered", "tiered_back",
"tiered_nopromo" and "tiered_stage" (that RAM in front of the drive, `tiers` with write_policy
"through", "back", "through" with `promote: off`, or "through" with `promote: stage`: the real
planner's copies down and promotions up, which take drive time behind the hits' reads as the
worker's copier does, promotions before write-downs; steps that read the drive report their rate
apart, as the worker does):

    python3 bench/drive_sim.py --stores disk,ram,tiered --ram-chunks 409 --capacity-chunks 1638 \
        --bytes-per-token 81920 --prefill-tps 12000 --num-prefixes 32 --prefix-len 8192 --gpu-cache-chunks 204

`--gpu-kv-chunks N` bounds vLLM's whole GPU KV cache (GpuKv): the blocks of the requests in flight
and the prefix cache share N chunks, a request waits in vLLM's queue until its whole sequence fits
(vLLM's full-sequence reservation), and a hit that loads holds its blocks while it loads, where a
staged hit ("tiered_stage", while the blocks are short: `--stage-pressure`) waits in the queue
holding none. Without it (0) only the prefix cache is bounded, as the figures before it were made.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tutti.engine.sched import hit_policy as hit_policy_mod  # noqa: E402
from tutti.engine.sched import tiers as tiers_mod  # noqa: E402
from tutti.engine.sched.admission import DriveShare, get_admission  # noqa: E402
from tutti.engine.sched.hit_policy import get_policy  # noqa: E402
from tutti.engine.config.settings import EngineConfig  # noqa: E402
from tutti.engine.keys import namespace_seed  # noqa: E402
from tutti.engine.plan import WorkerReport  # noqa: E402
from tutti.engine.sched.index import ChunkIndex  # noqa: E402
from tutti.engine.sched.planner import Planner  # noqa: E402
from tutti.engine.sched.tiers import LowerTier  # noqa: E402


class Clock:
    """The model's time, for the RateMeter (it reads time.monotonic) and DriveShare."""

    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def __call__(self) -> float:
        return self.t


class Drive:
    """One device: `rate` bytes a second, shared; queued reads go before queued writes (and before
    `background` work: copies between tiers, which yield to the hits' reads as the copier does;
    copies up, promotions, go before copies down, as the worker's TierCopier takes them)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.reads: deque = deque()  # [item, bytes left]
        self.writes: deque = deque()
        self.up: deque = deque()  # copies up: [item, bytes left, "r", started at]
        self.background: deque = deque()  # copies down: [item, bytes left, "w", started at]
        self.read_bytes = self.write_bytes = 0
        self.read_done_at: list[float] = []  # with advance(t0=...): when each read of the last advance landed
        self.up_seconds: dict = {}  # copy up -> seconds from the drive starting it to its end (the copier's read_s)

    def advance(self, dt: float, t0: float = 0.0) -> tuple[list, list]:
        budget = total = self.rate * dt
        done_r, done_w = [], []
        self.read_done_at = []
        for q, done, kind in ((self.reads, done_r, "r"), (self.writes, done_w, "w")):
            while q and budget > 0:
                take = min(budget, q[0][1])
                q[0][1] -= take
                budget -= take
                if kind == "r":
                    self.read_bytes += take
                else:
                    self.write_bytes += take
                if q[0][1] <= 1e-6:
                    done.append(q.popleft()[0])
                    if kind == "r":
                        self.read_done_at.append(t0 + (total - budget) / self.rate)
        for q in (self.up, self.background):  # copies: behind reads and stores
            while q and budget > 0:
                item = q[0]
                if item[3] is None:
                    item[3] = t0 + (total - budget) / self.rate
                take = min(budget, item[1])
                item[1] -= take
                budget -= take
                if item[2] == "r":
                    self.read_bytes += take
                else:
                    self.write_bytes += take
                if item[1] <= 1e-6:
                    done_w.append(q.popleft()[0])
                    if item[2] == "r":
                        self.up_seconds[item[0]] = t0 + (total - budget) / self.rate - item[3]
        return done_r, done_w


@dataclass
class Req:
    rid: str
    tokens: list[int]
    computed: int = 0
    state: str = "prefill"  # waiting (in vLLM's queue, no blocks), wait_load, ready (loaded: back in the queue), prefill, decode
    decoded: int = 0
    start: float = 0.0
    first_token: float | None = None
    loaded: int = 0
    gpu_hit: int = 0


@dataclass
class Result:
    admission: str
    seed: int
    makespan_s: float = 0.0
    requests: int = 0
    ttft_mean_s: float = 0.0
    gpu_cache_tokens: int = 0
    hit_tokens: int = 0
    declined_hit_tokens: int = 0
    stores_declined: int = 0
    stores_skipped: int = 0
    stores_committed: int = 0
    read_gb: float = 0.0
    written_gb: float = 0.0
    share: float | None = None
    stores: str = "disk"
    tier_hit_tokens: list | None = None  # with tiers: hit tokens from the RAM tier and from the drive
    writedowns: int = 0
    promotions: int = 0
    dropped: int = 0
    staged_hits: int = 0
    load_wait_s: float = 0.0  # seconds requests spent holding GPU blocks while their loads ran (summed)
    queue_wait_s: float = 0.0  # seconds requests spent in vLLM's queue without blocks (summed; --gpu-kv-chunks)
    decode_only_steps: int = 0  # steps that computed no prompt token (each costs --step-overhead-s)


def workload(a, seed: int) -> list[list[int]]:
    """serve_workload.py's prefix_repetition: each prefix `repeats` times in a shuffled order, or
    (`--popularity zipf`) as many requests drawn with prefix k's weight 1/k^s."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30000) for _ in range(a.prefix_len)] for _ in range(a.num_prefixes)]
    if getattr(a, "popularity", "uniform") == "zipf":
        order = rng.choices(range(a.num_prefixes), weights=[1.0 / (k + 1) ** a.zipf_s for k in range(a.num_prefixes)],
                            k=a.num_prefixes * a.repeats)
    else:
        order = [i for i in range(a.num_prefixes) for _ in range(a.repeats)]
        rng.shuffle(order)
    return [prefixes[i] + [rng.randrange(10, 30000) for _ in range(a.suffix_len)] for i in order]


def fixed_share(share: float) -> DriveShare:
    """DriveShare whose share never moves: `share:X` in --admissions. A grid of them bounds what any
    policy choosing a share of whole prefixes can reach on a drive (results/drive_sim.md)."""
    if not 0 < share <= 1:
        raise SystemExit(f"--admissions share:{share}: expected a share in (0, 1]")
    policy = DriveShare(floor=share)
    policy.share = share
    policy._update = lambda counters: None
    return policy


class FrontShare:
    """`front:X` in --admissions: the first X of every prompt's chunks, the rest never written. Why
    try it: on a drive slower than prefill the hit policy loads a hit's front and recomputes its
    back (most hit tokens are declined), so the back's writes take drive time no read ever uses."""

    name = "front"

    def __init__(self, share: float) -> None:
        if not 0 < share <= 1:
            raise SystemExit(f"--admissions front:{share}: expected a share in (0, 1]")
        self.share = share

    def admit(self, c) -> bool:
        return c.state or c.chunk < max(1, round(self.share * c.prompt_chunks))


STORES = ("disk", "ram", "tiered", "tiered_back", "tiered_nopromo", "tiered_stage")


class GpuKv:
    """vLLM's GPU KV cache under --gpu-kv-chunks: one pool of chunks for the blocks of the requests
    in flight and the prefix cache. A cached chunk a running request uses is held (referenced);
    the others are evicted least recent first when a request needs room. A request's private
    blocks (the tokens it computes or loads, its output) are `held` until it finishes; its prompt's
    chunks join the cache when its prefill ends. Without a budget (0) the cache alone is modelled,
    `--gpu-cache-chunks` of it, and requests in flight take no room (the older model)."""

    def __init__(self, chunks: int, cache_chunks: int, chunk_tokens: int) -> None:
        self.chunks, self.cache_chunks, self.chunk_tokens = chunks, cache_chunks, chunk_tokens
        self.cache: OrderedDict = OrderedDict()  # chunk prefix hash -> None, least recent first
        self.refs: dict[int, int] = {}
        self.held: dict[str, int] = {}  # request -> private chunks
        self.uses: dict[str, list[int]] = {}  # request -> cached chunks it references

    def hit(self, rid: str, hashes: list[int]) -> int:
        """The leading chunks of `hashes` cached: counted as used by `rid` (with a budget)."""
        n = 0
        for h in hashes:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            n += 1
        if self.chunks:
            self._use(rid, hashes[:n])
        return n

    def _use(self, rid: str, hashes: list[int]) -> None:
        for h in hashes:
            self.refs[h] = self.refs.get(h, 0) + 1
        self.uses.setdefault(rid, []).extend(hashes)

    def _evict(self, room: int) -> bool:
        """Make `room` chunks free by evicting unreferenced cached chunks; False: they are not there."""
        free = self.chunks - len(self.cache) - sum(self.held.values())
        if free >= room:
            return True
        victims = [h for h in self.cache if not self.refs.get(h)][:room - free]
        if len(victims) < room - free:
            return False
        for h in victims:
            del self.cache[h]
        return True

    def alloc(self, rid: str, tokens: int) -> bool:
        """Private blocks for `tokens` more tokens of `rid`; False: no room (vLLM leaves it waiting)."""
        if not self.chunks:
            return True
        need = -(-tokens // self.chunk_tokens)
        if not self._evict(need):
            return False
        self.held[rid] = self.held.get(rid, 0) + need
        return True

    def release(self, rid: str) -> None:
        """`rid` gave up its blocks: it finished, or was not scheduled after all (staged, no room)."""
        self.held.pop(rid, None)
        for h in self.uses.pop(rid, []):
            self.refs[h] -= 1

    def prefilled(self, rid: str, hashes: list[int]) -> None:
        """`rid`'s prompt is computed: its chunks are cached (its own blocks move into the cache)."""
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
                continue
            self.cache[h] = None
            if self.chunks:
                self._use(rid, [h])
                self.held[rid] = max(0, self.held.get(rid, 0) - 1)
        if not self.chunks:
            while len(self.cache) > self.cache_chunks:
                self.cache.popitem(last=False)


def run(a, admission: str, seed: int, stores: str = "disk") -> Result:
    """One run; `stores`: where the store lives (STORES)."""
    clock = Clock()
    hit_policy_mod.time = clock  # the RateMeter's clock: the model's
    tiers_mod.time = clock  # and the staged hits' wait
    requests = workload(a, seed)
    chunk_bytes = a.chunk_tokens * a.bytes_per_token
    planner = None
    policy = None
    if admission != "none":
        if admission == "drive_share":
            policy = DriveShare(clock=clock)
        elif admission.startswith("share:"):  # a fixed share of the prefixes: the bound of any share policy
            policy = fixed_share(float(admission[len("share:"):]))
        elif admission.startswith("front:"):  # the front of every prompt: what a slow drive's hits load
            policy = FrontShare(float(admission[len("front:"):]))
        else:
            policy = get_admission(admission)
        tiered = stores.startswith("tiered")
        first = int(a.ram_chunks) if stores != "disk" else int(a.capacity_chunks)
        lower = [LowerTier(ChunkIndex(int(a.capacity_chunks)), "disk")] if tiered else []
        planner = Planner(num_slots=first, chunk_tokens=a.chunk_tokens, block_size=16,
                          seed=namespace_seed("drive-sim"), slot_bytes=chunk_bytes, hit_policy=get_policy(a.hit_policy),
                          step_tokens=a.step_tokens, asynchronous=True, admission=policy, lower=lower,
                          write_policy="back" if stores == "tiered_back" else "through",
                          promote=stores != "tiered_nopromo", stage=stores == "tiered_stage",
                          gpu_blocks=a.gpu_kv_chunks * a.chunk_tokens // 16, stage_pressure=a.stage_pressure)
        # the start-up read probes: each tier's own rate, as WorkerPipeline.probe_read_rate reports them
        rate0 = a.drive_rate if stores == "disk" else a.ram_rate
        planner.on_report(WorkerReport(probe_bytes=64 << 20, probe_seconds=(64 << 20) / rate0,
                                       lower_rate_bytes=(64 << 20) if tiered else 0,
                                       lower_rate_seconds=(64 << 20) / a.drive_rate if tiered else 0.0))
    drive = Drive(a.drive_rate)
    devices = [drive if stores == "disk" else Drive(a.ram_rate), drive]  # where tier 0 and tier 1 live
    copies: set[int] = set()  # tickets of copies between tiers in flight
    reads_lower: set[int] = set()  # async steps that read the drive tier
    load_end: dict[int, float] = {}  # async step -> when its last read landed (the rate sample's end)
    kvc = GpuKv(a.gpu_kv_chunks, a.gpu_cache_chunks, a.chunk_tokens)  # vLLM's GPU KV cache and prefix cache
    pending = deque(enumerate(requests))
    active: dict[str, Req] = {}
    async_left: dict[int, int] = {}  # async step -> loads not yet read
    load_meta: dict[int, tuple[float, int]] = {}  # async step -> (submitted at, bytes)
    waiting_on: dict[int, list[str]] = {}  # async step -> requests it loads for
    inflight_stores = 0
    holed: set[str] = set()
    res = Result(admission, seed, stores=stores if admission != "none" else "none")
    ttfts = []

    def chunk_hashes(tokens: list[int]) -> list[int]:
        n = (len(tokens) - 1) // a.chunk_tokens
        return [hash(tuple(tokens[:(c + 1) * a.chunk_tokens])) for c in range(n)]

    def block_ids(r: Req, hs: list[int]) -> list[int]:
        """The request's GPU block ids (16 tokens each): shared with the requests before it where
        vLLM's prefix cache had the chunk, its own elsewhere."""
        per = a.chunk_tokens // 16
        shared = r.gpu_hit // a.chunk_tokens
        return [hash((hs[b // per], b)) if b // per < shared else hash((r.rid, b))
                for b in range(-(-len(r.tokens) // 16))]

    def schedule(r: Req) -> str:
        """vLLM takes waiting `r`: its GPU prefix hit, tutti's lookup, its blocks. "ok", "staged"
        (tutti said "later": vLLM skips it this step) or "full" (no room: vLLM stops taking requests)."""
        hs = chunk_hashes(r.tokens)
        r.gpu_hit = kvc.hit(r.rid, hs) * a.chunk_tokens
        r.computed = r.gpu_hit
        got = 0
        if planner is not None:
            got = planner.match(r.rid, r.tokens, r.gpu_hit)
            if got is None:
                kvc.release(r.rid)
                return "staged"
        # the whole sequence must fit, a hit loading asynchronously included (vLLM's
        # scheduler_reserve_full_isl, and the blocks it reserves for loads in flight): so a loaded
        # hit never waits for the rest of its blocks while holding the others
        if not kvc.alloc(r.rid, len(r.tokens) - r.gpu_hit + a.output_len):
            kvc.release(r.rid)
            return "full"
        res.gpu_cache_tokens += r.gpu_hit
        if planner is not None:
            blocks = block_ids(r, hs)
            planner.on_alloc(r.rid, blocks, got, async_load=got > 0)
            planner.update_request(r.rid, tokens=r.tokens, all_block_ids=blocks)
        r.state, r.loaded = ("wait_load", got) if got else ("prefill", 0)
        return "ok"

    while pending or active:
        while pending and len(active) < a.concurrency:
            i, tokens = pending.popleft()
            r = Req(f"r{i}", tokens, start=clock.t, state="waiting")
            active[r.rid] = r
            if not a.gpu_kv_chunks:  # the older model: looked up on arrival, never short of blocks
                schedule(r)
        # one step: decodes first, then prompts in arrival order, within the token budget; then
        # waiting requests in arrival order while blocks and budget last (vLLM's scheduler)
        budget, scheduled, before, prefill_tokens, decodes = a.step_tokens, {}, {}, 0, 0
        for r in active.values():
            if r.state == "decode" and budget > 0:
                scheduled[r.rid], before[r.rid] = 1, r.computed
                budget -= 1
                decodes += 1
        def prefill(r: Req) -> None:
            nonlocal budget, prefill_tokens
            n = min(len(r.tokens) - r.computed, budget)
            scheduled[r.rid], before[r.rid] = n, r.computed
            budget -= n
            prefill_tokens += n

        for r in active.values():
            if r.state == "prefill" and budget > 0:
                prefill(r)
        for r in list(active.values()):
            if r.state not in ("waiting", "ready") or budget <= 0:
                continue
            if r.state == "ready":  # (its blocks were reserved when it was scheduled)
                r.state = "prefill"
            else:
                got = schedule(r)
                if got == "staged":
                    continue
                if got == "full":
                    break
            if r.state == "prefill":
                prefill(r)
        report = WorkerReport()
        if planner is not None:
            plan = planner.build_step(scheduled, before)
            if plan.async_loads:
                nbytes = len(plan.async_loads) * chunk_bytes
                async_left[plan.async_step] = len(plan.async_loads)
                load_meta[plan.async_step] = (clock.t, nbytes)
                waiting_on[plan.async_step] = sorted({ld.req_id for ld in plan.async_loads})
                for ld in plan.async_loads:
                    devices[ld.tier].reads.append([plan.async_step, chunk_bytes])
                    if ld.tier:
                        reads_lower.add(plan.async_step)
            for st in plan.stores:
                if st.req_id in holed or inflight_stores >= a.staging_chunks:
                    holed.add(st.req_id)
                    report.store_failed.append(st.ticket)
                    report.stores_skipped += 1
                else:
                    inflight_stores += 1
                    devices[0].writes.append([st.ticket, chunk_bytes])
            for c in plan.copies:  # down: the drive writes it; up (a promotion): the drive reads it
                copies.add(c.ticket)
                if c.dst > c.src:
                    drive.background.append([c.ticket, chunk_bytes, "w", None])
                else:
                    drive.up.append([c.ticket, chunk_bytes, "r", None])
            step = plan.step
        busy = bool(scheduled)
        dt = a.step_overhead_s + decodes * a.decode_s + prefill_tokens / a.prefill_tps if busy else a.idle_tick_s
        res.decode_only_steps += busy and not prefill_tokens
        for r in active.values():
            if r.state == "wait_load":
                res.load_wait_s += dt
            elif r.state in ("waiting", "ready"):
                res.queue_wait_s += dt
        step_t0 = clock.t
        clock.t += dt
        done_r, done_w = drive.advance(dt, step_t0)
        landed = list(drive.read_done_at)
        if devices[0] is not drive:
            more_r, more_w = devices[0].advance(dt, step_t0)
            done_r, done_w = done_r + more_r, done_w + more_w
            landed += devices[0].read_done_at
        for s, at in zip(done_r, landed):  # "exact": a load's sample ends when its last read landed
            load_end[s] = max(load_end.get(s, 0.0), at if a.rate_timing == "exact" else clock.t)
        # the step's tokens
        for rid, n in scheduled.items():
            r = active[rid]
            if r.state == "prefill":
                r.computed += n
                if r.computed >= len(r.tokens):
                    r.state, r.decoded, r.first_token = "decode", 1, clock.t
                    kvc.prefilled(r.rid, chunk_hashes(r.tokens))
            else:
                r.computed += 1
                r.decoded += 1
        if planner is not None:
            report.steps_done.append(step)
            for s in done_r:
                async_left[s] -= 1
                if async_left[s] == 0:
                    t0, nbytes = load_meta.pop(s)
                    end = load_end.pop(s)
                    report.steps_done.append(s)
                    report.bytes_loaded += nbytes
                    if s in reads_lower:  # the drive tier set its pace: its own sample
                        reads_lower.discard(s)
                        report.lower_rate_bytes += nbytes
                        report.lower_rate_seconds += end - t0
                    else:
                        report.rate_bytes += nbytes
                        report.rate_seconds += end - t0
                    for rid in waiting_on.pop(s):
                        r = active.get(rid)
                        if r is not None and r.state == "wait_load":
                            r.state = "ready" if a.gpu_kv_chunks else "prefill"  # (its other blocks next)
                            r.computed = r.gpu_hit + r.loaded
            report.stored.extend(done_w)
            for t in done_w:  # promote "stage": the copier's reads up measure the drive tier's rate
                secs = drive.up_seconds.pop(t, None)
                if secs is not None and planner.stage and secs > 0:
                    report.lower_rate_bytes += chunk_bytes
                    report.lower_rate_seconds += secs
            n_copies = sum(1 for t in done_w if t in copies)
            copies.difference_update(done_w)
            inflight_stores -= len(done_w) - n_copies
            report.bytes_stored += (len(done_w) - n_copies) * chunk_bytes
            planner.on_report(report)
        for rid in [rid for rid, r in active.items() if r.state == "decode" and r.decoded >= a.output_len]:
            r = active.pop(rid)
            kvc.release(rid)
            ttfts.append(r.first_token - r.start)
            res.requests += 1
            if planner is not None:
                planner.finished(rid)
                holed.discard(rid)
    res.makespan_s = clock.t
    res.ttft_mean_s = sum(ttfts) / len(ttfts)
    res.read_gb, res.written_gb = drive.read_bytes / 1e9, drive.write_bytes / 1e9
    if planner is not None:
        s = planner.stats
        res.hit_tokens, res.declined_hit_tokens = s.hit_tokens, s.declined_hit_tokens
        res.stores_declined, res.stores_skipped, res.stores_committed = s.stores_declined, s.stores_skipped, s.stores_committed
    if isinstance(policy, DriveShare):
        res.share = round(policy.share, 3)
    if planner is not None and planner.lower:
        ts = planner.tier_stats
        res.tier_hit_tokens, res.writedowns = list(ts.hit_tokens), ts.writedowns[1]
        res.promotions, res.dropped, res.staged_hits = ts.promotions, ts.dropped, ts.staged_hits
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admissions", default="all,drive_share,seen_twice")
    ap.add_argument("--drive-gbps", default="1.6", help="the drive's rate, reads and writes together (GB/s); a list")
    ap.add_argument("--prefill-tps", type=float, default=40000.0,
                    help="the GPU's prefill rate (tokens/s; with the defaults no connector takes 25 s, on the H200 23.5 s)")
    ap.add_argument("--step-overhead-s", type=float, default=0.006, help="a step's time besides its prompt tokens")
    ap.add_argument("--decode-s", type=float, default=0.0,
                    help="a step's time per request decoding in it (0: a decode costs only the step's overhead)")
    ap.add_argument("--idle-tick-s", type=float, default=0.002, help="the engine loop's tick with nothing scheduled")
    ap.add_argument("--step-tokens", type=int, default=8192)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prefixes", type=int, default=48)
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--suffix-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--popularity", default="uniform", choices=["uniform", "zipf"],
                    help="uniform: each prefix --repeats times; zipf: prefix k drawn with weight 1/k^s")
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--bytes-per-token", type=int, default=131072, help="8B Llama KV: 32 layers x 8 heads x 128 x 2 x bf16")
    ap.add_argument("--gpu-cache-chunks", type=int, default=200,
                    help="vLLM's own prefix cache, in chunks (no connector then hits 176k tokens of 811k; the H200: 187k)")
    ap.add_argument("--gpu-kv-chunks", type=int, default=0,
                    help="vLLM's whole GPU KV cache, in chunks, shared by the requests in flight and the prefix cache: "
                         "a request waits in vLLM's queue, holding nothing, until its blocks fit, and a hit that loads "
                         "holds its blocks while it loads. 0: the older model, a prefix cache of --gpu-cache-chunks "
                         "beside requests that take no room")
    ap.add_argument("--stage-pressure", type=float, default=EngineConfig.stage_pressure,
                    help="tiered_stage: the stage_pressure key (a hit is staged only while the requests in flight "
                         "hold more than this share of the GPU's blocks; 0: every hit from the drive; needs "
                         "--gpu-kv-chunks, without it every hit is staged)")
    ap.add_argument("--capacity-chunks", type=int, default=1024, help="the store (32 GiB of 32 MiB chunks)")
    ap.add_argument("--staging-chunks", type=int, default=64, help="stores in flight (auto staging: two steps' worth)")
    ap.add_argument("--hit-policy", default="auto", help="tutti's hit_policy (auto, always, a name or module:attr)")
    ap.add_argument("--stores", default="disk",
                    help="where the store lives: " + ", ".join(STORES) + " (a list)")
    ap.add_argument("--ram-chunks", type=int, default=256, help="the RAM root's or RAM tier's capacity, in chunks")
    ap.add_argument("--ram-gbps", type=float, default=25.0, help="the RAM tier's rate into the GPU (GB/s)")
    ap.add_argument("--rate-timing", default="step", choices=["step", "exact"],
                    help="a load's rate sample ends at the end of the step its last read landed in (step, as "
                         "the results so far were made) or when that read landed (exact: a worker times its reads)")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    a.ram_rate = a.ram_gbps * 1e9
    rows = []
    for gbps in a.drive_gbps.split(","):
        a.drive_rate = float(gbps) * 1e9
        for seed in (int(s) for s in a.seeds.split(",")):
            base = run(a, "none", seed)
            for where in a.stores.split(","):
                if where not in STORES:
                    ap.error(f"--stores {where!r}: expected one of " + ", ".join(STORES))
                for adm in a.admissions.split(","):
                    r = run(a, adm, seed, where)
                    row = {"drive_gbps": float(gbps), **vars(r), "x_none": round(base.makespan_s / r.makespan_s, 3),
                           "none_makespan_s": round(base.makespan_s, 2), "none_gpu_cache_tokens": base.gpu_cache_tokens}
                    rows.append(row)
                    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
                          flush=True)
    means: dict[tuple[float, str, str], list[float]] = {}
    for row in rows:
        means.setdefault((row["drive_gbps"], row["stores"], row["admission"]), []).append(row["x_none"])
    summary = [{"drive_gbps": g, "stores": where, "admission": adm, "x_none_mean": round(sum(v) / len(v), 3),
                "x_none": v} for (g, where, adm), v in means.items()]
    for row in summary:
        print("MEAN " + json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items()}, "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
