"""The planner: the scheduler-side half of the engine.

It tracks each request's chunks, answers prefix lookups, decides what each step loads and
stores (reserving slots in the index) and turns worker reports into commits, aborts and
drops. It knows nothing of vLLM: the connector feeds it plain ids, tokens and block lists.

One idea (a request's chunks from lookup to commit): the decisions it asks for live behind
seams of their own (tutti.engine.sched.hit_policy, admission, eviction; the slots in tutti.engine.sched.index).
"""

from __future__ import annotations

import itertools
import logging
from typing import Iterable, Mapping, Sequence

from tutti.engine.sched.admission import AdmissionPolicy, AdmitAll
from tutti.engine.sched.hit_policy import Always, HitPolicy, RateMeter
from tutti.engine.sched.index import ChunkIndex
from tutti.engine.sched.hits import HitPlanning
from tutti.engine.sched.requests import (  # noqa: F401 - PROBE_UNDER_STEP: the planner's, importable here
    PROBE_UNDER_STEP, PlannerStats, RequestState, StoreTicket,
)
from tutti.engine.sched.steps import StepPlanning
from tutti.engine.sched.tiers import WRITE_POLICIES, LowerTier, TierPlanning, TierStats

log = logging.getLogger("tutti.engine")


class Planner(HitPlanning, StepPlanning, TierPlanning):
    """The scheduler-side half of the engine: lookups (hits.py), steps (steps.py) and the copies
    between tiers (tiers.py) over one state."""

    def __init__(self, *, num_slots: int, chunk_tokens: int, block_size: int, seed: bytes,
                 num_workers: int = 1, slot_bytes: int = 0, store_decode: bool = False,
                 num_writers: int | None = None, foreign=None, num_groups: int = 1,
                 state_groups: Sequence[int] = (), hit_policy: HitPolicy | None = None,
                 step_tokens: int = 8192, asynchronous: bool = False, eviction=None,
                 admission: AdmissionPolicy | None = None, attention_weight: float = 0.0,
                 sync_budget: int | str | None = None, can_load_async: bool = False,
                 lower: Sequence[LowerTier] = (), write_policy: str = "through", promote: bool = True,
                 stage: bool = False, gpu_blocks: int = 0, stage_pressure: float = 0.0) -> None:
        if chunk_tokens % block_size:
            raise ValueError(
                f"chunk_tokens={chunk_tokens}: must be a multiple of the KV cache's block_size={block_size}; "
                f"try {max(1, round(chunk_tokens / block_size)) * block_size}"
            )
        self.index = ChunkIndex(num_slots, eviction)  # eviction: tutti.engine.sched.eviction (LRU when None)
        # the tiers below this one (tutti.engine.sched.tiers), slowest last, and how chunks reach them
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy={write_policy!r}: expected one of {list(WRITE_POLICIES)}")
        self.lower: list[LowerTier] = list(lower)
        self.write_policy = write_policy
        self.promote = promote  # a hit from a lower tier is copied up into tier 0 (tiers.py)
        # ... before it loads, the request waiting without GPU blocks (promote "stage": tiers.py)
        self.stage = stage and bool(self.lower)
        self.gpu_blocks = gpu_blocks  # vLLM's GPU KV blocks in all (0: unknown)
        self.stage_pressure = stage_pressure  # staging only while they are this short (tiers.py: _short_of_blocks)
        # block id -> requests in flight holding it, kept only where that decides something
        self._block_refs: dict[int, int] | None = {} if self.stage and gpu_blocks else None
        # ... and the blocks their prompts still need beyond those (vLLM reserves them), summed
        self._reserved_blocks = 0
        self._stage: list[tuple[bytes, int]] = []  # (key, tier) to copy up for a waiting request
        self._up_in_flight = 0  # copies up (promotions) planned and not reported
        self.tier_stats = TierStats.new(1 + len(self.lower))
        # a full tier gives up chunks held below first: under "back" its dirty ones wait for
        # admission's verdict, under "through" for their write-down's turn (a drive slower than
        # the stores), so a chunk is lost only when no clean one is near the evicting end
        for t in range(len(self.lower)):
            self.tier_index(t).dirty = self._dirty(t)
            # "through": a chunk whose write-down is still to come is kept, and a new store that finds
            # nothing else to evict is declined (counted), so a lagging drive (or a restart's
            # backlog of write-downs) loses no stored chunk; one whose write-down failed may go
            self.tier_index(t).keep_dirty = write_policy == "through"
        self._unwritable: set[bytes] = set()  # chunks whose write-down failed or found no room below
        self._burst = 0  # the most chunks a recent step stored (decaying): what "back" keeps clean ahead
        self._down_in_flight = [0] * (1 + len(self.lower))  # write-downs planned and not reported, per source tier
        self._down: list[tuple[bytes, int]] = []  # committed in a tier, to be copied to the next one down
        # loaded from a lower tier, to be promoted into tier 0: (key, tier, other writer or None, its slot)
        self._up: list[tuple[bytes, int, str | None, int]] = []
        self._borrowed: set[bytes] = set()  # tier 0's chunks promoted from other writers' (held below by them)
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size
        self.blocks_per_chunk = chunk_tokens // block_size
        self.seed = seed
        self.num_workers = num_workers  # every worker reports each step's loads done
        # Workers that store each chunk: all ranks hold a shard, so a chunk is resident once all
        # of them committed it (fewer under MLA, where TP rank 0 alone stores the shared latent).
        self.num_writers = num_workers if num_writers is None else num_writers
        if not 1 <= self.num_writers <= num_workers:
            raise ValueError(f"num_writers={num_writers}: expected 1 <= num_writers <= num_workers={num_workers}")
        self.slot_bytes = slot_bytes
        self.store_decode = store_decode
        # vLLM's KV cache groups (hybrid models: full and sliding-window attention): each request
        # has one block list per group, and a chunk's blocks are every group's, group by group.
        self.num_groups = num_groups
        # State-space groups (Mamba / linear attention, vLLM's "align" mode: the state after each
        # block boundary lives in that block's column). Their state is valid only where it was
        # taken, so a chunk entry carries the attention groups' KV and a separate state entry
        # (tutti.engine.keys.state_key) the state groups' state at the chunk's end; a hit must end
        # on a chunk whose state is stored.
        self.state_groups = frozenset(state_groups)
        if any(not 0 <= g < num_groups for g in self.state_groups):
            raise ValueError(f"state_groups={sorted(self.state_groups)}: expected group indices below {num_groups}")
        self.stats = PlannerStats()
        self._reqs: dict[str, RequestState] = {}
        self._tickets: dict[int, StoreTicket] = {}
        self._ticket_ids = itertools.count(1)
        self._steps = itertools.count(1)
        self._step_pins: dict[int, list[bytes]] = {}
        self._step_done_count: dict[int, int] = {}
        self._events: list[tuple[str, list[bytes]]] = []  # ("stored"|"removed", keys)
        self._preempted: list[str] = []
        self._bad: set[bytes] = set()  # keys that failed to load, dropped once unpinned
        # The other writers of a shared namespace (tutti.engine.sharing.ForeignIndex), or None.
        self.foreign = foreign
        self.foreign_tier = 0  # the tier whose roots the other writers are followed in (build_planner: the last)
        self.writer_id = ""  # the writer slot this server took (set by build_planner)
        self.extras = None  # tutti.store.extras.ExtrasWriter where chunks are announced (build_planner)
        self._foreign_loads: dict[bytes, tuple[str, int]] = {}  # in flight: key -> (writer, slot)
        self._step_foreign: dict[int, list[bytes]] = {}
        # Load or compute (tutti.engine.sched.hit_policy): the policy, the rates it is given, and the
        # queues it weighs (bytes of loads planned and not done, prompt tokens not computed).
        self.hit_policy: HitPolicy = hit_policy if hit_policy is not None else Always()
        self.meter = RateMeter()
        self.lower_meter = RateMeter()  # the read rate of steps that load from a lower tier (tiers.py)
        self.step_tokens = step_tokens
        # a token's compute per earlier token it attends to, relative to its other compute
        # (tutti.engine.sched.hit_policy.HitQuery.attention_weight; the connector sets it from the model)
        self.attention_weight = attention_weight
        self.asynchronous = asynchronous  # the connector's load mode: outside the batch, or in the step
        self.admission = admission if admission is not None else AdmitAll()  # tutti.engine.sched.admission
        # Layer-wise mode only: the bytes one step may load in the step ("auto": what the read rate
        # moves while the GPU computes a full step; None: no budget), and whether a hit past it
        # can load asynchronously instead (the connector says; the worker then has async slots).
        self.sync_budget: int | str | None = sync_budget
        self.can_load_async = can_load_async
        self._step_sync_bytes = 0  # loaded in the step being scheduled
        self._unsent_load_bytes = 0
        self._step_load_bytes: dict[int, int] = {}
        # the same, of loads from tiers below the first (their reads queue apart from the RAM's)
        self._unsent_lower_bytes = 0
        self._step_lower_bytes: dict[int, int] = {}
        self._backlog = 0  # prompt tokens not computed, as of the last step (plus lookups since)
        self._batch_ids: frozenset[str] = frozenset()  # requests of the last step: a prompt computed now
        # lengthens their steps (while they run: a finished one waits for nothing)
        self.probe_seeded = False  # the worker's start-up probe came in process (seed_probe), not by report
        self.hints_dir: str | None = None  # where this writer keeps its measured rates (tutti.store.hints)
        self.hints_access = None  # and how its files are made (tutti.io.safefs.Access)

    def save_hints(self) -> None:
        """Keep the rates measured in this run for the next start (tutti.store.hints); advisory:
        a failure is logged, never raised."""
        if self.hints_dir is None or not self.meter.prefill_rate:
            return
        from tutti.store.hints import write_hints

        try:
            write_hints(self.hints_dir, {"prefill_tokens_per_s": self.meter.prefill_rate,
                                         "step_s": self.meter.step_time}, self.hints_access)
        except OSError as exc:
            log.debug("tutti: the measured rates were not kept for the next start: %s", exc)

    def seed_probe(self, nbytes: int, seconds: float) -> None:
        """The worker's start-up read probe (bytes, seconds), before the first lookup: taken as a
        rate under a step (PROBE_UNDER_STEP), and not counted again when its report arrives."""
        self.meter.on_loads(nbytes, seconds / PROBE_UNDER_STEP)
        self.probe_seeded = True


def rebuild_entries(per_rank: Iterable[Mapping[int, bytes]]) -> dict[int, bytes]:
    """Slots whose chunk every rank holds (same key in the same slot): those are resident."""
    per_rank = list(per_rank)
    if not per_rank:
        return {}
    first, rest = per_rank[0], per_rank[1:]
    return {slot: key for slot, key in first.items() if all(other.get(slot) == key for other in rest)}
