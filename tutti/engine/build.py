"""Builds the engine's two halves from a config and a geometry: the planner (scheduler
process) and the worker pipeline (each worker), with every check that needs the model's
geometry done once, before any file is touched. The connector calls these and nothing else."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping, Sequence

import torch

from tutti.engine import claims, handoff
from tutti.engine.config import resolve
from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.engine.geometry import Geometry  # noqa: F401 - also imported from here (its old home)
from tutti.engine.sched.planner import Planner, rebuild_entries
from tutti.engine.worker.pipeline import WorkerPipeline
from tutti.store.rammap import RAM_FILESYSTEMS, fs_type

log = logging.getLogger("tutti.engine")


READ_SECRET = object()  # build_planner/build_worker: read the config's secret (else: the tagger given)


def segment_mac(cfg: EngineConfig):
    """The keyed tagger of a config with a secret, else None (the secret is read, never kept in cfg)."""
    from tutti.store.integrity import SegmentMac, load_secret

    secret = load_secret(file=cfg.secret_file or None, env=cfg.secret_env or None)
    return None if secret is None else SegmentMac(secret)


def store_access(cfg: EngineConfig):
    """Private files, or shared with cfg.share_group (validated in the config)."""
    from tutti.engine.config.settings import resolve_group
    from tutti.io.safefs import PRIVATE, Access

    return Access(resolve_group(cfg.share_group)) if cfg.share_group else PRIVATE


def with_integrity(geom: Geometry, mac) -> Geometry:
    """`geom` marked with the integrity scheme of `mac` (segment_mac(cfg)); unchanged without one."""
    import dataclasses

    return geom if mac is None else dataclasses.replace(geom, integrity=mac.name)


def with_codec(geom: Geometry, cfg: EngineConfig) -> Geometry:
    """`geom` with its segments stored through cfg.codec (tutti.codec): unchanged for "identity"."""
    from tutti.codec import get_codec

    return geom.with_codec(get_codec(cfg.codec))


def check_capacity(cfg: EngineConfig, geom: Geometry, key: str = "capacity_bytes") -> int:
    num_slots = cfg.capacity_bytes // geom.slot_bytes
    if num_slots < 1:
        raise ConfigError(
            f"{key}={cfg.capacity_bytes}: smaller than one chunk "
            f"({geom.slot_bytes} B = {geom.num_layers} layers x {geom.stored_segment_bytes} B segments); "
            f"expected at least {geom.slot_bytes}"
        )
    return num_slots


def check_geometry(cfg: EngineConfig, geom: Geometry) -> int:
    """Every check that needs the model's geometry, before any file is touched; returns the slot count.

    Both halves call it first: the worker is built before the scheduler, so a check left to the
    planner would only fire after the worker had already created the store on disk.
    """
    geom = with_codec(geom, cfg)  # a codec's stride sizes the slots
    if geom.chunk_tokens % geom.block_size:
        raise ConfigError(
            f"chunk_tokens={geom.chunk_tokens}: must be a multiple of the KV cache's "
            f"block_size={geom.block_size}; try {max(1, round(geom.chunk_tokens / geom.block_size)) * geom.block_size}"
        )
    num_slots = check_capacity(cfg, geom)
    for i in range(1, 1 + len(cfg.tiers)):  # each tier below holds a chunk too, checked before any file
        check_capacity(cfg.tier(i), geom, f"tiers[{i}].capacity_bytes")
    if cfg.staging_auto:
        return num_slots  # sized for this geometry by sized_staging (the worker's half)
    if geom.segment_bytes > cfg.staging_slot_bytes:
        raise ConfigError(
            f"staging_bytes={cfg.staging_bytes}: a staging slot ({cfg.staging_slot_bytes} B "
            f"= staging_bytes / staging_slots) is smaller than one segment ({geom.segment_bytes} B); raise "
            f"staging_bytes to at least {geom.segment_bytes * cfg.staging_slots} or lower chunk_tokens"
        )
    arena = cfg.max_inflight_stores * cfg.staging_slot_bytes
    if arena < geom.chunk_bytes:  # a store region holds a chunk's raw segments
        raise ConfigError(
            f"max_inflight_stores={cfg.max_inflight_stores}: stores may hold {arena} B of "
            f"staging (max_inflight_stores x {cfg.staging_slot_bytes} B slots), less than one chunk "
            f"({geom.chunk_bytes} B = {geom.num_layers} layers x {geom.segment_bytes} B); raise staging_bytes to at "
            f"least {-(-geom.chunk_bytes // cfg.max_inflight_stores) * cfg.staging_slots} or max_inflight_stores, "
            "or lower chunk_tokens"
        )
    return num_slots


def build_planner(raw_config: "Mapping[str, Any] | EngineConfig", geom: Geometry, *, engine_id: str = "",
                  announce: bool = False, mac: Any = READ_SECRET, asynchronous: bool = False,
                  budgeted: bool = False, step_tokens: int = 8192, attention_weight: float = 0.0,
                  gpu_blocks: int = 0) -> Planner:
    """The scheduler's half: the index rebuilt from every rank's journal. `engine_id`: vLLM's,
    under which this process's worker recorded the writer id it took ("auto"). `announce`:
    chunks are announced (KV events), so this writer records its chunks' extras
    (`planner.extras`, tutti.store.extras) and follows the other writers' extras. How hits load
    (what the hit policy prices): `asynchronous` (every hit outside the batch), or `budgeted`
    (layer-wise up to the step's sync_load_budget_bytes, asynchronously past it); vLLM's step
    token budget and the model's `attention_weight` (tutti.engine.sched.hit_policy); `gpu_blocks`:
    vLLM's GPU KV blocks in all, where it says (promote "stage" stages only while they are short)."""
    from tutti.engine.sched.admission import get_admission
    from tutti.engine.sched.eviction import get_eviction
    from tutti.engine.sched.hit_policy import get_policy

    cfg = EngineConfig.of(raw_config, rank=0)  # parsed once; other ranks: cfg.for_rank
    if cfg.writer_id == claims.AUTO:  # the slot this engine's worker took (tutti.engine.claims)
        took = claims.claimed(engine_id) if engine_id else None
        if took is None and geom.num_workers == 1:  # normal where the worker runs in another process
            log.debug("tutti: no worker of engine %r in this process recorded its writer id; the scheduler "
                     "assumes the namespace's writer slot ('')", engine_id)
        cfg = dataclasses.replace(cfg, writer_id=took or "")
    num_slots = check_geometry(cfg, geom)
    mac = segment_mac(cfg) if mac is READ_SECRET else mac  # the connector read it once for its half
    geom = with_codec(with_integrity(geom, mac), cfg)
    from tutti.engine.sched.index import ChunkIndex
    from tutti.engine.sched.tiers import LowerTier

    lower = [LowerTier(ChunkIndex(check_capacity(cfg.tier(i), geom), get_eviction(cfg.tier(i).eviction_policy)),
                       cfg.tier(i).roots[0]) for i in range(1, 1 + len(cfg.tiers))]
    planner = Planner(lower=lower, write_policy=cfg.write_policy, promote=cfg.promote in ("hits", "stage"),
                      stage=cfg.promote == "stage", gpu_blocks=gpu_blocks, stage_pressure=cfg.stage_pressure,
                      num_slots=num_slots, chunk_tokens=cfg.chunk_tokens, block_size=geom.block_size,
                      seed=geom.seed() if mac is None else mac.seed(geom.seed()), num_workers=geom.num_workers, slot_bytes=geom.slot_bytes,
                      store_decode=cfg.store_decode, num_writers=geom.num_writers,
                      num_groups=max(geom.group_of_layer or [0]) + 1, state_groups=geom.state_groups,
                      hit_policy=get_policy(cfg.hit_policy), eviction=get_eviction(cfg.eviction_policy),
                      admission=get_admission(cfg.store_admission), asynchronous=asynchronous,
                      step_tokens=step_tokens, attention_weight=attention_weight,
                      sync_budget=cfg.sync_load_budget_bytes if budgeted else None, can_load_async=budgeted)
    own = _resident(cfg, geom)
    planner.rebuild(own)
    for i, tier in enumerate(lower, 1):  # each tier below from its own journals
        tier.index.rebuild(_resident(cfg.tier(i), geom))
    queued = planner.reconcile_tiers() if lower else 0  # a server killed before its write-downs were done
    if queued:
        log.info("tutti: %d chunks held by a tier and not the one below it are written down again", queued)
    probe = handoff.take_probe(engine_id) if geom.num_workers == 1 else None
    if probe is not None:  # this process's worker probed the store: a measured rate from the first lookup
        planner.seed_probe(*probe)
    planner.writer_id = cfg.writer_id
    # rates.json: this writer's measured rates from its last run, as priors (tutti.store.hints)
    planner.hints_dir = _writer_dir(cfg, geom, cfg.writer_id)
    planner.hints_access = store_access(cfg).owner_writes() if cfg.writer_id else store_access(cfg)
    from tutti.store.hints import read_hints

    hints = read_hints(planner.hints_dir, planner.hints_access)
    planner.meter.seed(hints.get("prefill_tokens_per_s"), hints.get("step_s"))
    planner.extras = _extras_writer(cfg, geom, set(own.values())) if announce else None
    # with tiers, the other writers are followed in the last tier (the one replicas share; a RAM
    # tier in front stays private), and their chunks are priced and loaded as that tier's
    planner.foreign = _foreign_index(cfg.tier(len(cfg.tiers)), geom, announce=announce)
    planner.foreign_tier = len(cfg.tiers)
    return planner


def _resident(cfg: EngineConfig, geom: Geometry) -> dict[int, bytes]:
    """The chunks every store rank holds in cfg's roots (slot -> key), from their journals."""
    per_rank = []
    for tp, pp, rank in geom.store_ranks:
        rcfg = cfg.for_rank(rank)
        try:
            store = open_store(cfg, rcfg.roots, geom.for_rank(tp, pp).fingerprint(), writer_id=cfg.writer_id)
        except FileNotFoundError:
            per_rank.append({})
            continue
        try:
            per_rank.append({slot: e.key for slot, e in store.entries().items()})
        finally:
            store.close()
    return rebuild_entries(per_rank)


def open_store(cfg: EngineConfig, roots: Sequence[str], fingerprint, *, writer_id: str, writer: bool = False,
               foreign: bool = False, medium=None, map_ram: bool = False, access=None, open_file=None):
    """The one place the engine opens a ChunkStore from its config. `foreign`: another writer's
    store, read only (its capacity and slab layout are its own, from its manifest); else this
    server's (its capacity and slots per slab)."""
    from tutti.engine.sharing import FOREIGN_CAPACITY
    from tutti.store.chunk_store import ChunkStore

    return ChunkStore(list(roots), fingerprint, capacity_bytes=FOREIGN_CAPACITY if foreign else cfg.capacity_bytes,
                      writer=writer, slots_per_slab=None if foreign else cfg.slots_per_slab,
                      access=store_access(cfg) if access is None else access, max_open_slabs=cfg.max_open_slabs,
                      map_ram=map_ram, writer_id=writer_id, medium=medium, open_file=open_file)


def _writer_dir(cfg: EngineConfig, geom: Geometry, writer_id: str) -> str:
    """A writer's directory on the first root of the first store rank (where its extras live)."""
    from tutti.store.chunk_store import WRITER_PREFIX, namespace_dir

    tp, pp, _ = geom.store_ranks[0]
    top = namespace_dir(cfg.roots[0], geom.for_rank(tp, pp).fingerprint())
    return os.path.join(top, WRITER_PREFIX + writer_id) if writer_id else top


def _extras_writer(cfg: EngineConfig, geom: Geometry, live: set[bytes]):
    """This writer's extras (tutti.store.extras), or None where its directory cannot take them:
    announcing is advisory, the store works without it."""
    from tutti.store.extras import ExtrasWriter

    access = store_access(cfg)
    try:
        return ExtrasWriter(_writer_dir(cfg, geom, cfg.writer_id),
                            access.owner_writes() if cfg.writer_id else access, live=live)
    except OSError as exc:
        log.warning("tutti: this writer's chunk extras cannot be written (%s): other servers will not "
                    "announce its chunks", exc)
        return None


def _foreign_index(cfg: EngineConfig, geom: Geometry, *, announce: bool = False):
    """The scheduler's view of the other writers of the namespace (every store rank)."""
    from tutti.engine.sharing import ForeignIndex
    from tutti.store.chunk_store import list_writers

    ranks = list(geom.store_ranks)
    rank_cfgs = [cfg.for_rank(rank) for _, _, rank in ranks]
    tp0, pp0, _ = ranks[0]

    def writers() -> list[str]:
        return list_writers(rank_cfgs[0].roots[0], geom.for_rank(tp0, pp0).fingerprint())

    def open_reader(i: int, writer: str):
        tp, pp, _ = ranks[i]
        return open_store(cfg, rank_cfgs[i].roots, geom.for_rank(tp, pp).fingerprint(), writer_id=writer, foreign=True)

    def open_extras(writer: str):
        from tutti.store.extras import ExtrasReader

        return ExtrasReader(_writer_dir(rank_cfgs[0], geom, writer), store_access(cfg))

    return ForeignIndex(own_id=cfg.writer_id, num_ranks=len(ranks), list_writers=writers, open_reader=open_reader,
                        interval_s=cfg.follow_interval_s, open_extras=open_extras if announce else None)


def _claim_store(cfg: EngineConfig, geom: Geometry, engine_id: str, *, open_file=None, access, maps, medium=None,
                 decided: resolve.Decisions | None = None):
    """The worker's writer store, and cfg with the writer id it took: the configured one, or
    for "auto" the first free one of resolve.writer_candidates (recorded under `engine_id`, and
    in `decided` with why)."""
    from tutti.store.chunk_store import StoreLockedError, WriterDirectoryTakenError

    def open_as(writer_id: str):
        return open_store(cfg, cfg.roots, geom.fingerprint(), writer_id=writer_id, writer=True, medium=medium,
                          map_ram=maps, access=access, open_file=open_file)

    if cfg.writer_id != claims.AUTO:
        return open_as(cfg.writer_id), cfg
    rule = resolve.writer_candidates(cfg.writer_id, workers=geom.num_workers, checksums=cfg.verify_checksums)
    tried = rule.value
    held = 0
    for i, wid in enumerate(tried):
        try:
            store = open_as(wid)
        except (StoreLockedError, WriterDirectoryTakenError) as exc:
            # a slot whose directory another member of the group owns is not ours: passed over
            held += isinstance(exc, StoreLockedError)
            if i + 1 < len(tried) and held <= claims.MAX_AUTO_WRITERS:
                continue
            why = rule.why if len(tried) == 1 else f"all {held} writer slots are held"
            raise StoreLockedError(
                f"store roots {list(cfg.roots)}: the namespace's writer slot is held by another server and {why}; "
                "give each server sharing this root its own \"writer_id\" (e.g. \"{host}-gpu0\")") from None
        if wid:
            log.info("tutti: the namespace's writer slot is held by another server; this one writes as %r "
                     "(writer_id auto)", wid)
        if engine_id:
            claims.record(engine_id, wid)
        if decided is not None:
            decided.take("writer_id", resolve.writer_taken(wid))
        return store, dataclasses.replace(cfg, writer_id=wid)
    raise AssertionError("unreachable")


def build_worker(raw_config: "Mapping[str, Any] | EngineConfig", geom: Geometry, *, caches: Sequence[torch.Tensor], layout,
                 kernel_blocks_per_block: int = 1, rank: int = 0, async_loads: bool | str | None = None,
                 step_tokens: int | None = None, engine_id: str = "", mac: Any = READ_SECRET) -> WorkerPipeline:
    """One worker's half: its store (writer), IO queue, kernels and staging ring. `async_loads`:
    the scheduler loads every hit asynchronously (its own staging slots and thread); "split":
    layer-wise, and hits past the step's byte budget asynchronously (a quarter of the load slots);
    None: only where the config says true ("auto" is the connector's to resolve, from what vLLM runs).
    `step_tokens`: vLLM's token budget of a step, which "auto" staging is sized for."""
    from tutti.codec import get_codec, is_identity
    from tutti.kernels import get_variant, segment_checksum

    decided = resolve.Decisions()
    cfg = EngineConfig.of(raw_config, rank=rank).sized_staging(
        segment_bytes=geom.segment_bytes, chunk_bytes=geom.chunk_bytes, step_tokens=step_tokens, decided=decided)
    check_geometry(cfg, geom)
    mac = segment_mac(cfg) if mac is READ_SECRET else mac  # the secret is read once per half, before any IO
    codec = get_codec(cfg.codec)  # how segments are stored (tutti.codec): its name and stride join the namespace
    geom = with_integrity(geom, mac).with_codec(codec)
    codec = None if is_identity(codec) else codec
    if mac is not None:  # tags right for this rank's namespace only (tests/engine/worker/test_pipeline.py::test_keyed_tags_bind_the_rank)
        mac = mac.bound(geom.fingerprint().digest())
    if layout.num_heads != geom.num_heads or layout.content_bytes != geom.content_bytes:
        raise ValueError(
            f"KV cache layout: found H={layout.num_heads}, C={layout.content_bytes} B per (head, token) in the "
            f"KV cache tensors registered, but the model config says H={geom.num_heads}, C={geom.content_bytes}"
        )
    kernel = get_variant(decided.take("kernel_variant", resolve.kernel_variant(cfg.kernel_variant,
                                                                              cuda=caches[0].is_cuda)))
    on_ram = all(fs_type(r) in RAM_FILESYSTEMS for r in cfg.roots)
    net = resolve.network_roots(cfg.mapped_loads, first_tier=[fs_type(r) for r in cfg.roots])
    q, openers = _open_queues(cfg, decided)
    cfg = dataclasses.replace(cfg, write_window_bytes=decided.take(
        "write_window_bytes", resolve.write_window_bytes(cfg.write_window_bytes, on_ram=on_ram)))
    access = store_access(cfg)
    maps = decided.take("mapped_loads", net.get("mapped_loads") or resolve.mapped_loads(
        cfg.mapped_loads, on_ram=on_ram, shared=access.shared, secret=mac is not None, codec=codec is not None))
    from tutti.store.medium import get_medium

    # where each tier's slab bytes live (tutti.store.medium), its files opened through its own queue
    media = [get_medium(cfg.tier(i).medium, lambda name, w, dir_fd, o=o: o(name, write=w, create=w, dir_fd=dir_fd))
             for i, o in enumerate(openers)]
    medium = media[0]
    if cfg.writer_id == claims.AUTO and not geom.writes:  # a reader rank: the writer rank's slot ('')
        cfg = dataclasses.replace(cfg, writer_id=decided.take("writer_id", resolve.writer_taken("", writes=False)))
    if geom.writes:
        store, cfg = _claim_store(cfg, geom, engine_id, access=access, maps=maps, medium=medium, decided=decided)
        store_roots = list(cfg.roots)
    else:  # read the writer rank's namespace, under the writer rank's roots
        wcfg = cfg.for_rank(rank - geom.tp_rank + geom.store_tp_rank)
        store_roots = list(wcfg.roots)
        # readers never map: the writer creates slabs while serving, and mapping one then would
        # register it with CUDA beside the step (a writer maps its own at start-up, map_all)
        store = ReplicaReader(list(wcfg.roots), geom.fingerprint(), capacity_bytes=cfg.capacity_bytes,
                              slots_per_slab=cfg.slots_per_slab, medium=medium, access=access,
                              max_open_slabs=cfg.max_open_slabs, map_ram=False, writer_id=cfg.writer_id)
    from tutti.store.chunk_store import StoreLockedError, WriterDirectoryTakenError

    lower = []  # the tiers below (tutti.engine.worker.tiers): this writer's own store in each, never mapped
    try:
        for i in range(1, 1 + len(cfg.tiers)):
            tcfg = cfg.tier(i)
            try:
                lower.append(open_store(tcfg, tcfg.roots, geom.fingerprint(), writer_id=cfg.writer_id,
                                        writer=geom.writes, access=access, medium=media[i]))
            except (StoreLockedError, WriterDirectoryTakenError) as exc:
                raise StoreLockedError(
                    f"tiers[{i}] roots {list(tcfg.roots)}: writer {cfg.writer_id!r} is held there by another server "
                    f"({exc}); a tier shared by several servers needs each server's own \"writer_id\" (e.g. "
                    "\"{host}-gpu0\")") from None
    except Exception:
        for st in [store, *lower]:
            st.close()
        q.close()
        raise
    from tutti.engine.sharing import ForeignStores

    fingerprint = geom.fingerprint()
    if cfg.tiers:  # other writers are followed in the last tier (see build_planner)
        store_roots = list(cfg.tier(len(cfg.tiers)).roots)
    foreign = ForeignStores(lambda writer: open_store(  # the file path: see ReplicaReader
        cfg, store_roots, fingerprint, writer_id=writer, foreign=True, medium=media[-1], access=access))
    from tutti.engine.hostcost import shorten_switch_interval

    shorten_switch_interval(None if cfg.gil_switch_interval_s == "off" else cfg.gil_switch_interval_s)
    try:
        return WorkerPipeline(cfg, caches=caches, layout=layout, store=store, io_queue=q, kernel=kernel,
                              checksum=segment_checksum, segment_bytes=geom.segment_bytes,
                              chunk_tokens=cfg.chunk_tokens, kernel_blocks_per_block=kernel_blocks_per_block,
                              writes=geom.writes, mac=mac, foreign=foreign, group_of_layer=geom.group_of_layer,
                              async_loads=cfg.async_loads is True if async_loads is None else async_loads,
                              decisions=decided, codec=codec, stored_segment_bytes=geom.stored_segment_bytes,
                              lower=lower)
    except Exception:
        for st in [store, *lower]:
            st.close()
        q.close()
        raise


def _open_queues(cfg: EngineConfig, decided: "resolve.Decisions") -> tuple[Any, list]:
    """The worker's IO queue and, per tier, the open_file its files go through: one queue per
    distinct (backend, options) among the tiers (each tier's "auto" decided from its own roots),
    routed by file where there are several (tutti.io.routed.RoutedQueue)."""
    from tutti.io.queue import open_queue
    from tutti.io.routed import RoutedQueue

    wanted: list[tuple[str, dict]] = []
    for i in range(1 + len(cfg.tiers)):
        t = cfg.tier(i)
        choice = resolve.tier_io_backend(t.io_backend, fs_types=[fs_type(r) for r in t.roots])
        wanted.append((decided.take("io_backend" if i == 0 else f"tiers[{i}].io_backend", choice),
                       dict(t.io_options)))
    distinct = [w for n, w in enumerate(wanted) if w not in wanted[:n]]
    queues = []
    try:
        for backend, options in distinct:
            queues.append(open_queue(backend, **options))
    except Exception:
        for q in queues:
            q.close()
        raise
    if len(queues) == 1:
        return queues[0], [queues[0].open_file] * len(wanted)
    routed = RoutedQueue(queues)
    return routed, [routed.opener(distinct.index(w)) for w in wanted]


class ReplicaReader:
    """A read-only view of another rank's namespace, opened once that rank has created it.

    The ranks start together, so the writer's namespace may not exist yet when a reader starts:
    until it does, the reader holds nothing (every planned load is a miss it reports).
    """

    def __init__(self, roots: list[str], fingerprint, *, capacity_bytes: int, slots_per_slab: int | None,
                 open_file=None, access=None, max_open_slabs: int = 256, map_ram: bool = False,
                 writer_id: str = "", medium=None) -> None:
        from tutti.io.safefs import PRIVATE

        self._args = dict(capacity_bytes=capacity_bytes, writer=False, slots_per_slab=slots_per_slab,
                          open_file=open_file, access=access or PRIVATE, max_open_slabs=max_open_slabs,
                          map_ram=map_ram, writer_id=writer_id, medium=medium)
        self._roots, self.fingerprint = roots, fingerprint
        self._store = None
        self._open()

    def _open(self):
        from tutti.store.chunk_store import ChunkStore

        if self._store is None:
            try:
                self._store = ChunkStore(self._roots, self.fingerprint, **self._args)
            except FileNotFoundError:
                return None
        return self._store

    def entries(self) -> dict:
        return self._store.entries() if self._store is not None else {}

    def refresh(self) -> None:
        if self._store is not None:
            self._store.refresh()
        else:
            self._open()  # opening replays the journal

    def refresh_if_changed(self) -> bool:
        if self._store is None:
            return self._open() is not None
        return self._store.refresh_if_changed()

    def location(self, slot: int, layer: int = 0) -> tuple[int, int]:
        if self._store is None:
            raise RuntimeError("ReplicaReader.location: the writer's namespace is not open (no entries yet)")
        return self._store.location(slot, layer)

    @property
    def maps_ram(self) -> bool:
        return bool(self._args["map_ram"]) and not self._args["access"].shared

    def mapped(self, slot: int, layer: int = 0, nbytes: int | None = None, sizes: dict | None = None):
        return None if self._store is None else self._store.mapped(slot, layer, nbytes, sizes)

    def map_all(self) -> int:
        return 0 if self._store is None else self._store.map_all()

    def acquire(self, slot: int, layer: int = 0) -> tuple[int, int]:
        if self._store is None:
            raise RuntimeError("ReplicaReader.acquire: the writer's namespace is not open (no entries yet)")
        return self._store.acquire(slot, layer)

    def release(self, slot: int) -> None:
        if self._store is not None:
            self._store.release(slot)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
