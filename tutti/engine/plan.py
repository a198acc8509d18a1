"""Plain data passed from the planner (scheduler process) to the workers and back.

Everything here is picklable: vLLM ships the step plan to worker processes inside the
connector metadata, and ships worker reports back inside the connector output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


NULL_BLOCK = 0  # vLLM's null block: stands in for blocks a sliding-window group no longer holds


@dataclass(frozen=True)
class LoadChunk:
    """Read chunk `key` from `slot` and scatter it into `block_ids` (manager blocks).

    `skip_blocks` leading blocks of the chunk are already computed locally (vLLM's own prefix
    cache): they are not written, so shared blocks are never touched. `keep_blocks` (None: all)
    ends what is written: a hit reaching the prompt's last chunk loads all but its last block,
    which vLLM computes itself (it needs at least one token to compute). The load writes
    `block_ids[skip_blocks:keep_blocks]`; the whole chunk is still read and verified.
    """

    req_id: str
    key: bytes
    slot: int
    block_ids: tuple[int, ...]
    skip_blocks: int = 0
    source: str | None = None  # another writer of the shared namespace that holds it (None: our own store)
    keep_blocks: int | None = None  # blocks before this index are written (None: every block)
    tier: int = 0  # which of this server's tiers holds it (0: the first, fastest; see CopyChunk)


@dataclass(frozen=True)
class StoreChunk:
    """Gather chunk `key` from `block_ids` and write it to `slot`; `ticket` names this store."""

    req_id: str
    key: bytes
    slot: int
    block_ids: tuple[int, ...]
    ticket: int


@dataclass(frozen=True)
class CopyChunk:
    """Copy chunk `key` from `src_slot` of tier `src` to `dst_slot` of tier `dst` (a write-down
    to a slower tier, or a promotion to a faster one), worker to worker's own stores, off the
    forward thread; `ticket` names it. Both slots are held by the planner until it is reported.
    `source`: another writer whose chunk (in its store under tier `src`'s roots, at `src_slot`)
    is promoted into this writer's tier `dst`; None: this writer's own tier `src`."""

    key: bytes
    src: int
    src_slot: int
    dst: int
    dst_slot: int
    ticket: int
    source: str | None = None


@dataclass
class StepPlan:
    step: int
    loads: list[LoadChunk] = field(default_factory=list)
    stores: list[StoreChunk] = field(default_factory=list)
    # Requests that have stores in flight: the worker reports them in get_finished once done.
    preempted: list[str] = field(default_factory=list)
    # Loads vLLM does not wait for in this step (its asynchronous loads: the requests wait until
    # the worker reports them received); their pins are released under `async_step`.
    async_loads: list[LoadChunk] = field(default_factory=list)
    async_step: int = 0
    # vLLM scheduled no token in this step (every request it holds waits, e.g. for its load): the
    # step runs no forward pass, so the worker may wait for its asynchronous loads in it
    idle: bool = False
    # Copies between this server's tiers (tutti.engine.sched.tiers): done by a worker thread,
    # reported like stores
    copies: list[CopyChunk] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.preempted or self.async_loads or self.copies)


@dataclass
class WorkerReport:
    """What one worker (or, aggregated, all workers) did since its last report."""

    stored: list[int] = field(default_factory=list)  # tickets written durably
    store_failed: list[int] = field(default_factory=list)  # tickets that failed or were skipped
    load_failed: list[bytes] = field(default_factory=list)  # keys that failed to load (IO or checksum)
    steps_done: list[int] = field(default_factory=list)  # plan steps whose loads have finished
    workers: int = 1  # how many worker reports were merged into this one
    # counters since the last report
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    stores_skipped: int = 0
    # the hit policy's read-rate sample: bytes read in seconds while the reads were what was
    # waited for (a whole or asynchronous load: all of it; a layer-wise load: up to the last read
    # the forward stalled on; none when it hid under compute). A layer-wise load's waits alone
    # read the storage as faster than it is, and the policy then loaded more than it could hide.
    rate_bytes: int = 0
    rate_seconds: float = 0.0
    # the start-up read probe (WorkerPipeline.probe_read_rate): the hit policy's first read rate
    probe_bytes: int = 0
    probe_seconds: float = 0.0
    # the same sample from steps that read a lower tier's chunks (tutti.engine.sched.tiers prices
    # those hits by it): the slower tier sets such a step's pace
    lower_rate_bytes: int = 0
    lower_rate_seconds: float = 0.0

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        return WorkerReport(
            stored=self.stored + other.stored,
            store_failed=self.store_failed + other.store_failed,
            load_failed=self.load_failed + other.load_failed,
            steps_done=self.steps_done + other.steps_done,
            workers=self.workers + other.workers,
            bytes_loaded=self.bytes_loaded + other.bytes_loaded,
            bytes_stored=self.bytes_stored + other.bytes_stored,
            load_seconds=self.load_seconds + other.load_seconds,
            store_seconds=self.store_seconds + other.store_seconds,
            stores_skipped=self.stores_skipped + other.stores_skipped,
            rate_bytes=self.rate_bytes + other.rate_bytes,
            rate_seconds=self.rate_seconds + other.rate_seconds,
            probe_bytes=self.probe_bytes + other.probe_bytes,
            probe_seconds=max(self.probe_seconds, other.probe_seconds),
            lower_rate_bytes=self.lower_rate_bytes + other.lower_rate_bytes,
            lower_rate_seconds=self.lower_rate_seconds + other.lower_rate_seconds,
        )

    def is_empty(self) -> bool:
        return not (self.stored or self.store_failed or self.load_failed or self.steps_done
                    or self.bytes_loaded or self.bytes_stored or self.stores_skipped or self.probe_bytes)
