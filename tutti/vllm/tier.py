"""tutti's store as a secondary tier of vLLM's OffloadingConnector (TieringOffloadingSpec).

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": ...,
        "secondary_tiers": [{"type": "TuttiTier", "module_path": "tutti.vllm.tier",
                             "root": "/mnt/nvme/tutti-tier", "capacity_bytes": "512GiB"}]}}'

vLLM's CPU tier stays in front (GPU <-> CPU is vLLM's); this tier moves whole offloaded chunks
between the CPU tier's memory and tutti's store: slab files striped over roots, a journal of
checksummed records made durable after the data, a hard capacity with LRU eviction, a keyed tag
per chunk with a secret, safe opens, fingerprinted namespaces. A chunk here is vLLM's offloaded
block as vLLM lays it out (opaque bytes: one segment of a one-layer slot), so its namespace is
its own, beside the layer-wise TuttiConnectorV1's namespaces in the same root format.

Keys are vLLM's offload keys (block hashes). As for vLLM's own `fs` tier, they are stable across
processes only with a fixed PYTHONHASHSEED (vLLM seeds its hash chain randomly otherwise), so set
it on every server that should read what another stored, or that restarts.

IO runs on a small thread pool; every method the scheduler calls returns at once.

vLLM 0.34: the tier is no longer touched on hits (recency comes from its load jobs); offloading
workers now get raw device pointers (DevicePointers), which this tier never sees (it moves the CPU
tier's bytes, not device memory); vLLM refuses secondary tiers on engines whose workers span nodes.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable

from tutti.engine.build import open_store
from tutti.engine.config.settings import EngineConfig, parse_bytes, resolve_root
from tutti.engine.sched.index import ChunkIndex
from tutti.io.buffers import open_direct
from tutti.store.fingerprint import Fingerprint
from tutti.format import FORMAT_VERSION, align_up
from tutti.store.integrity import CRC_TAG, SegmentMac, crc_tag, load_secret
from tutti.vllm import compat, identity, translate
from tutti.vllm.logs import route_tutti_logs

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering import base as _tiering

logger = init_logger(__name__)

SecondaryTierManager = _tiering.SecondaryTierManager
JobResult = _tiering.JobResult
RequestOffloadingContext = _tiering.RequestOffloadingContext if hasattr(_tiering, "RequestOffloadingContext") else \
    __import__("vllm.v1.kv_offload.base", fromlist=["RequestOffloadingContext"]).RequestOffloadingContext

_KNOWN = {"root", "roots", "capacity_bytes", "secret_file", "secret_env", "slots_per_slab", "io_threads", "locality",
          "kv_cache_dtype", "direct"}


def _resolved_dtype(raw: str, given: str | None = None) -> str:
    """The KV cache's element type: the tier's config says 'auto' when it follows the model's
    dtype, so resolve that from vLLM's config (fp16 and bf16 KV of one model are different
    bytes and must be different namespaces). `given` is the tier's own `kv_cache_dtype` key:
    used where vLLM's config cannot be found, and checked against it where it can. Raises
    when the dtype cannot be told."""
    name = raw.replace("torch.", "").lower()
    if name in ("", "auto"):
        cfg = compat.constructing_vllm_config()
        name = translate.kv_dtype_name(cfg) if cfg is not None else ""
    if given is not None:
        g = str(given).replace("torch.", "").lower()
        if name not in ("", "auto") and g != name:
            raise ValueError(f"secondary_tiers[type=tutti].kv_cache_dtype={given!r}: vLLM's KV cache is {name!r}; "
                             "remove the key or make it agree")
        name = g
    if name in ("", "auto") or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"TuttiTier: cannot tell the KV cache dtype from {raw!r} (resolved {name!r}): vLLM's "
                         "config is not reachable here; add \"kv_cache_dtype\": \"bfloat16\" (the model's "
                         "dtype) to the tier's entry in secondary_tiers")
    return name


class TuttiTier(SecondaryTierManager):
    medium = compat.tier_medium()

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str, backpressure_detector=None,
                 **config: Any) -> None:
        route_tutti_logs()
        unknown = sorted(set(config) - _KNOWN)
        if unknown:
            raise ValueError(f"secondary_tiers[type={tier_type}]: unknown key(s) {unknown}; allowed: {sorted(_KNOWN)}")
        if "root" in config and "roots" in config:
            raise ValueError(f"secondary_tiers[type={tier_type}]: give 'root' or 'roots', not both")
        roots = config.get("roots", config.get("root"))
        if isinstance(roots, str):
            roots = [roots]
        if not roots or not all(isinstance(r, str) and r for r in roots):
            raise ValueError(f"secondary_tiers[type={tier_type}].root={roots!r}: expected a directory path "
                             "(or 'roots': one per drive), e.g. \"/mnt/nvme/tutti-tier\"")
        if "capacity_bytes" not in config:
            raise ValueError(f"secondary_tiers[type={tier_type}].capacity_bytes: missing; give the tier's size, "
                             "e.g. \"512GiB\"")
        capacity = parse_bytes(f"secondary_tiers[type={tier_type}].capacity_bytes", config["capacity_bytes"])
        threads = config.get("io_threads", 16)  # as many readers as vLLM's fs tier
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
            raise ValueError(f"secondary_tiers[type={tier_type}].io_threads={threads!r}: expected an int in [1, 256]")
        if backpressure_detector is not None:  # vLLM 0.32+: the base class takes it
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        else:
            super().__init__(offloading_spec, primary_kv_view, tier_type)
        if config.get("locality") is not None:
            try:
                from vllm.v1.kv_offload.base import Locality

                self.locality = Locality(config["locality"])
            except (ImportError, ValueError) as exc:
                raise ValueError(f"secondary_tiers[type={tier_type}].locality={config['locality']!r}: expected "
                                 f"\"LOCAL\" or \"REMOTE\" ({exc})") from None
        view = memoryview(primary_kv_view)
        if view.strides is None or not view.c_contiguous:
            raise ValueError("TuttiTier: the CPU tier's memory view is not C-contiguous; this vLLM is not supported")
        self._chunk_bytes = int(view.strides[0])
        self._view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        secret = load_secret(file=config.get("secret_file") or None, env=config.get("secret_env") or None)
        self._mac = SegmentMac(secret) if secret is not None else None
        fp = self._fingerprint(offloading_spec, config.get("kv_cache_dtype"))
        if self._mac is not None:
            self._mac = self._mac.bound(fp.digest())  # tags right for this namespace (rank) only
        rank = getattr(getattr(getattr(offloading_spec, "config", None), "parallel", None), "rank", 0) or 0
        direct = config.get("direct", True)
        if not isinstance(direct, bool):
            raise ValueError(f"secondary_tiers[type={tier_type}].direct={direct!r}: expected true (O_DIRECT where "
                             "the file system and vLLM's CPU tier allow it) or false (the page cache)")
        # O_DIRECT moves whole aligned blocks between the CPU tier and the drive without a copy
        # through the page cache (vLLM's fs tier does the same); a CPU tier whose chunks are not
        # 4 KiB aligned (an odd chunk size) is read and written buffered.
        import numpy as np

        base = np.frombuffer(self._view, dtype=np.uint8).ctypes.data if len(self._view) else 0
        self.direct = direct and self._chunk_bytes % 4096 == 0 and base % 4096 == 0

        def open_slab(name: str, writer: bool, dir_fd: int) -> int:
            return open_direct(name, write=writer, dir_fd=dir_fd, prefer=self.direct)[0]

        # the engine's one store factory, over the tier's storage keys checked by the config's table
        storage = {"roots": [resolve_root(r, rank) for r in roots], "capacity_bytes": capacity}
        if config.get("slots_per_slab") is not None:
            storage["slots_per_slab"] = config["slots_per_slab"]
        try:
            store_cfg = EngineConfig.from_dict(storage)
        except ValueError as exc:
            raise ValueError(f"secondary_tiers[type={tier_type}].{exc}") from None
        self._store = open_store(store_cfg, store_cfg.roots, fp, writer_id="", writer=True, open_file=open_slab)
        self._index = ChunkIndex(self._store.num_slots)
        self._index.rebuild({slot: e.key for slot, e in self._store.entries().items()})
        self._threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tutti-tier")
        self._commit = threading.Lock()  # journal appends and syncs: one thread at a time
        self._jobs: list[tuple[Any, list[Future], list[bytes], bool]] = []  # (job id, futures, keys, is_load)
        self.loads_failed = 0
        logger.info("tutti tier: %s, %d chunks of %d B resident (capacity %d chunks)", self._store.namespaces[0],
                    len(self._index), self._chunk_bytes, self._store.num_slots)

    # ---- identity --------------------------------------------------------------------------
    def _fingerprint(self, spec, given_dtype: str | None) -> Fingerprint:
        """What the bytes of one offloaded chunk depend on: the model, its dtype and parallel
        layout, the chunk's tokens and its size as vLLM lays it out."""
        cfg = getattr(spec, "config", None)
        model = getattr(getattr(cfg, "model", None), "name", None) or "unknown-model"
        dtype = _resolved_dtype(str(getattr(getattr(cfg, "model", None), "dtype", "") or ""), given_dtype)
        par = getattr(cfg, "parallel", None)
        tokens = getattr(spec, "tokens_per_block", None) or (getattr(spec, "block_size", 0),)
        bpc = getattr(spec, "blocks_per_chunk", 1) or 1
        seg = align_up(self._chunk_bytes)
        return Fingerprint(
            model=str(model), cache_dtype=dtype,
            format_version=FORMAT_VERSION, chunk_tokens=int(tokens[0]) * int(bpc), num_layers=1, num_heads=1,
            content_bytes=self._chunk_bytes, segment_bytes=seg,
            tp_rank=int(getattr(par, "rank", 0) or 0), tp_size=int(getattr(par, "tp_size", 1) or 1),
            pp_rank=0, pp_size=int(getattr(par, "pp_size", 1) or 1),
            extra=(("layout", "vllm-offload-chunk"), ("tokens_per_block", ",".join(map(str, tokens))),
                   ("integrity", CRC_TAG if self._mac is None else SegmentMac.name), *self._identity()))

    @staticmethod
    def _identity() -> tuple[tuple[str, str], ...]:
        """What the model's name does not say (tests/vllm/test_tier.py::test_a_checkpoint_replaced_at_the_same_path_is_another_namespace), from vLLM's config
        where it is reachable: the weights' identity (a checkpoint replaced at the same path is
        another namespace) and the context-parallel sizes (refused above 1, as the connector does)."""
        vcfg = compat.constructing_vllm_config()
        if vcfg is None or getattr(getattr(vcfg, "model_config", None), "model", None) is None:
            return ()
        out = []
        try:
            out.append(("model_id", identity.model_identity(vcfg)))
        except Exception as exc:  # noqa: BLE001 - an unreadable model folder: say so, keep the name
            logger.warning("tutti tier: the model's weights cannot be identified (%s); chunks are keyed by its name", exc)
        pc = getattr(vcfg, "parallel_config", None)
        if pc is not None:
            translate.check_context_parallel(pc)
        return tuple(out)

    def _key(self, key: bytes) -> bytes:
        return hashlib.blake2b(bytes(key), digest_size=32, person=b"tutti-tier").digest()

    def _tag(self, key: bytes, data) -> int:
        if self._mac is not None:
            return self._mac.tag(key, 0, data)
        # Without a secret the tag guards against accidents, not forgery (anyone could recompute
        # any unkeyed hash), so it is a CRC as file systems use: blake2b held the tier to 0.68x of
        # vLLM's fs tier's load rate (bench/test_tier_bench.py).
        return crc_tag(data)

    # ---- what the scheduler asks -------------------------------------------------------------
    def on_new_request(self, req_context):
        return RequestOffloadingContext()

    def lookup(self, key, req_context):
        return LookupResult.HIT if self._key(key) in self._index else LookupResult.MISS

    def touch(self, keys, req_context):
        """vLLM 0.26-0.33 call this for every hit; 0.34 removed it (submit_load touches instead)."""
        # a prefix's keys, in order: touched tail first, so recency gives a prefix up from its end
        self._index.touch_prefix([self._key(k) for k in keys])

    def submit_store(self, job_metadata) -> None:
        keys = [self._key(k) for k in job_metadata.keys]
        res = self._index.plan_store(keys)
        work = [(k, res.slots[k], s) for k, s in zip(keys, compat.tier_job_slots(job_metadata)) if k in res.slots]
        futs = [self._pool.submit(self._store_chunks, piece) for piece in self._pieces(work)]
        self._jobs.append((job_metadata.job_id, futs, [k for k, _, _ in work], False))

    def submit_load(self, job_metadata) -> None:
        keys = [self._key(k) for k in job_metadata.keys]
        work = []
        for k, s in zip(keys, compat.tier_job_slots(job_metadata)):
            slot = self._index.slot_of(k)
            if slot is not None:
                self._index.pin([k])
            work.append((k, slot, s))
        held = [k for k, slot, _ in work if slot is not None]
        # recency from the loads themselves: vLLM 0.34 no longer calls touch() (compat.tier_touched_by_vllm),
        # and a promotion is this tier's hit; a job's keys come in prefix order
        self._index.touch_prefix(held)
        futs = [self._pool.submit(self._load_chunks, piece) for piece in self._pieces(work)]
        self._jobs.append((job_metadata.job_id, futs, held, True))

    def _pieces(self, work: list) -> list[list]:
        """A job's chunks in contiguous pieces, one per pool thread: one thread reading a long
        prompt's chunks one after another keeps the drive at queue depth 1 (40 s for 32k tokens
        of the 8B geometry on the H200's disk, against 2.7 s for vLLM's fs tier)."""
        n = max(1, min(self._threads, len(work)))
        step = -(-len(work) // n) if work else 1
        return [work[i:i + step] for i in range(0, len(work), step)] or [[]]

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, still = [], []
        for job_id, futs, keys, is_load in self._jobs:
            if not all(f.done() for f in futs):
                still.append((job_id, futs, keys, is_load))
                continue
            ok: dict[bytes, bool] = {}
            try:
                for f in futs:
                    ok.update(f.result())
            except Exception as exc:  # noqa: BLE001 - a failed job is a miss, never an exception upstream
                logger.warning("tutti tier: %s job failed: %s", "load" if is_load else "store", exc)
                ok = {k: False for k in keys}
            if is_load:
                self._index.unpin(keys)
                for k, good in ok.items():
                    if not good:
                        self.loads_failed += 1
                        self._index.drop(k)  # not trusted again; its slot was journaled free
            else:
                for k, good in reversed(list(ok.items())):  # a job's keys in prefix order: the tail first
                    (self._index.commit if good else self._index.abort)(k)
            out.append(JobResult(job_id=job_id, success=all(ok.values()) if ok else not is_load))
        self._jobs = still
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        for _, futs, _, _ in list(self._jobs):
            for f in futs:
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - reported by get_finished_jobs
                    pass

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()

    # ---- IO (pool threads) ----------------------------------------------------------------
    def _store_chunks(self, work: list[tuple[bytes, int, int]]) -> dict[bytes, bool]:
        """free records (synced) -> data -> fdatasync -> put records (synced): a crash never shows
        a torn chunk."""
        if not work:
            return {}
        cb = self._chunk_bytes
        with self._commit:
            self._store.free([slot for _, slot, _ in work])
        ok, tags = {}, {}
        for key, slot, src in work:
            data = self._view[src * cb:(src + 1) * cb]
            try:
                with self._store.held(slot) as (fd, off):
                    n = os.pwritev(fd, [data], off)
                ok[key] = n == cb
                tags[key] = self._tag(key, data)
            except OSError as exc:
                logger.warning("tutti tier: storing a chunk failed: %s", exc)
                ok[key] = False
        done = [(k, slot) for k, slot, _ in work if ok[k]]
        if done:
            try:
                with self._commit:
                    self._store.commit([(k, slot, [tags[k]]) for k, slot in done])
            except OSError as exc:
                logger.warning("tutti tier: making %d chunks durable failed: %s", len(done), exc)
                return {k: False for k in ok}
        return ok

    def _load_chunks(self, work: list[tuple[bytes, int | None, int]]) -> dict[bytes, bool]:
        cb = self._chunk_bytes
        ok = {}
        bad = []
        for key, slot, dst in work:
            if slot is None:  # asked for a chunk this tier no longer holds: the job fails, never
                ok[key] = False  # reports the CPU-tier slot's stale bytes as loaded (tests/vllm/test_tier.py::test_a_load_job_for_a_chunk_no_longer_held_fails)
                continue
            entry = self._store.get(slot)
            out = self._view[dst * cb:(dst + 1) * cb]
            good = False
            if entry is not None and entry.key == key:
                try:
                    with self._store.held(slot) as (fd, off):
                        n = os.preadv(fd, [out], off)
                    good = n == cb and self._tag(key, out) == entry.checksums[0]
                except OSError as exc:
                    logger.warning("tutti tier: reading a chunk failed: %s", exc)
            if not good:
                logger.warning("tutti tier: chunk %s failed its check (or is gone); vLLM recomputes it", key.hex()[:16])
                bad.append(slot)
            ok[key] = good
        if bad:
            try:
                with self._commit:
                    self._store.free(bad)
            except OSError:
                pass
        return ok
