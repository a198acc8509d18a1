"""The engine's configuration: parsed from a plain dict (vLLM's kv_connector_extra_config),
validated once at start-up, every error naming the key, the value and the allowed range. Which
keys there are, how each is parsed and what each means is the table in spec.py; the parsers are
values.py's."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

from tutti.engine.config import resolve
from tutti.engine.config.values import (  # noqa: F401 - the configuration's names, importable from here
    ASYNC_LAUNCHES, DEFAULT_WRITE_WINDOW, MAPPED_STORE_COPIES, MAX_BYTES, READS_FIRST_BYTES, WHOLE_LOADS, ConfigError,
    TierConfig,
    check_zmq_endpoint, host_memory_bytes, human, parse_bytes, resolve_group, resolve_root, resolve_writer_id,
)

log = logging.getLogger("tutti.engine")

@dataclass(frozen=True)
class EngineConfig:
    """The parsed configuration. What each key takes and does is its row in spec.KEYS (and
    docs/configuration.md); the defaults are here. "auto" values are decided at start-up from
    what the server runs on (the roots' file systems, vLLM's scheduling, the model)."""

    roots: tuple[str, ...]
    capacity_bytes: int
    chunk_tokens: int = 256
    io_backend: str = "auto"
    kernel_variant: str = "auto"
    lookahead: Any = 2
    io_timeout_s: float = 10.0
    # "auto" (all three left out): sized at start-up from the geometry and vLLM's step token
    # budget (`sized_staging`); any of them given: the others default to 512 MiB, 64, 48
    staging_bytes: Any = "auto"
    staging_slots: Any = "auto"
    max_inflight_stores: Any = "auto"
    verify_checksums: bool = True
    slots_per_slab: int = 64
    io_options: Mapping[str, Any] = field(default_factory=dict)
    max_open_slabs: int = 256
    mapped_loads: Any = "auto"
    # "auto": where vLLM schedules asynchronously (its default): there a step is scheduled before
    # the last one's output is read, so a layer-wise load that fails its checksum would already
    # have a token sampled from its KV in flight
    async_loads: Any = "auto"
    # "auto": "step" where it can (CUDA, a mapped root, one KV cache group, no secret): the
    # loading thread's Python between launches, beside vLLM's eager attention, took turns at the
    # GIL with the step (bench/serve_workload.py --trace shows the stretched steps)
    async_launch: str = "auto"
    # "layer": the layer-wise path's items for a whole load: 32x the IO requests of "chunk" for a
    # 4k-token hit of an 8B model (bench/whole_load_calls.py); kept to compare
    whole_loads: str = "chunk"
    sync_load_budget_bytes: Any = "auto"
    write_window_bytes: Any = "auto"  # resolved by build_worker (DEFAULT_WRITE_WINDOW on a drive; None = off)
    reads_first: Any = "auto"
    gil_switch_interval_s: Any = "off"
    # 2 ms: with asynchronous loads on the CPU engine (bench/gil_interval_ab.py --ab grid --tiny
    # --extra '{"async_loads": true}') it made 2k hits 2-4x faster: without it the loading thread
    # waited for the GIL behind vLLM's spinning loop
    idle_load_wait_s: Any = "auto"
    # "auto" = "dma_chunk": decode while storing kept closest to no connector
    # (bench/vllm_ttft.py's _dma_chunk, _dma and _host cases)
    mapped_store_copy: str = "auto"
    store_copies_in_flight: int = 1
    store_decode: bool = False
    hit_policy: str = "auto"
    eviction_policy: str = "lru"
    store_admission: str = "all"
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""
    secret_file: str = ""  # where the secret comes from, never the secret itself
    secret_env: str = ""
    share_group: str = ""
    writer_id: str = "auto"  # "auto": found at start-up (tutti.engine.claims); '' = the namespace's only writer
    follow_interval_s: float = 0.25
    medium: str = "file"
    codec: str = "identity"  # how a segment's bytes are stored (tutti.codec); not "identity": a namespace of its own
    tiers: tuple[TierConfig, ...] = ()  # the tiers below the first (roots + capacity_bytes), fastest first
    write_policy: str = "through"
    promote: str = "hits"  # with tiers: "hits" copies a chunk a hit loaded from below up into the first; "stage"
    # copies it up before the hit loads (the request waits without GPU blocks); "off" never
    stage_pressure: float = 0.7  # "stage": only while requests in flight hold more than this share of GPU blocks
    extra: Mapping[str, Any] = field(default_factory=dict)
    # the roots as given, before `{rank}` was expanded: for_rank() expands them again
    root_templates: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def for_rank(self, rank: int) -> "EngineConfig":
        """This config for another rank's store: only `{rank}` in the roots differs, so nothing is
        parsed or validated again (one parse per process half)."""
        from dataclasses import replace

        templates = self.root_templates + tuple(r for t in self.tiers for r in t.root_templates)
        if not any("{rank}" in r for r in templates):
            return self
        return replace(self, roots=tuple(resolve_root(r, rank) for r in self.root_templates),
                       tiers=tuple(replace(t, roots=tuple(resolve_root(r, rank) for r in t.root_templates))
                                   for t in self.tiers))

    def tier(self, i: int) -> "EngineConfig":
        """The config of tier `i` (0: this one): its roots, capacity, eviction policy, medium, IO
        backend and options, everything else as this one's."""
        from dataclasses import replace

        if i == 0:
            return self
        t = self.tiers[i - 1]
        return replace(self, roots=t.roots, root_templates=t.root_templates, capacity_bytes=t.capacity_bytes,
                       eviction_policy=t.eviction_policy or self.eviction_policy, medium=t.medium or self.medium,
                       io_backend=t.io_backend or self.io_backend,
                       io_options=self.io_options if t.io_options is None else t.io_options, tiers=())

    @classmethod
    def of(cls, config: "Mapping[str, Any] | EngineConfig", *, rank: int = 0) -> "EngineConfig":
        """A parsed config, from kv_connector_extra_config (parsed here) or parsed already."""
        if isinstance(config, EngineConfig):
            return config.for_rank(rank)
        return cls.from_dict(config, rank=rank)

    @property
    def staging_slot_bytes(self) -> int:
        if self.staging_auto:
            raise RuntimeError("staging is 'auto': size it first (EngineConfig.sized_staging)")
        return (self.staging_bytes // self.staging_slots) // 4096 * 4096

    @property
    def staging_auto(self) -> bool:
        return self.staging_bytes == "auto"

    def sized_staging(self, *, segment_bytes: int, chunk_bytes: int, step_tokens: int | None,
                      memory_bytes: int | None = None, decided=None) -> "EngineConfig":
        """This config with "auto" staging sized for the geometry and vLLM's step (the rule:
        tutti.engine.config.resolve.staging), recorded in `decided` (a resolve.Decisions) where
        given; logged when host memory cuts the stores' room."""
        if not self.staging_auto:
            return self
        from dataclasses import replace

        choice = resolve.staging((self.staging_bytes, self.staging_slots, self.max_inflight_stores),
                                 segment_bytes=segment_bytes, chunk_bytes=chunk_bytes, chunk_tokens=self.chunk_tokens,
                                 step_tokens=step_tokens,
                                 memory_bytes=host_memory_bytes() if memory_bytes is None else memory_bytes)
        total, slots, inflight = choice.value if decided is None else decided.take(resolve.STAGING, choice)
        if choice.why.startswith(resolve.STAGING_CAPPED):
            log.warning("tutti: staging sized to %s, %s; set staging_bytes, staging_slots and max_inflight_stores "
                        "to size it yourself", human(total), choice.why)
        out = replace(self, staging_bytes=total, staging_slots=slots, max_inflight_stores=inflight)
        out.validate()
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, rank: int = 0) -> "EngineConfig":
        """Validate `raw` against the table of keys (tutti.engine.config.spec): unknown keys are
        refused (with the nearest known one), each value by its key's parser; `{rank}` in a root
        expands to `rank`."""
        from tutti.engine.config import spec

        raw = dict(raw or {})
        spec.refuse_unknown(raw)
        lower = spec.parse_tiers(raw, rank)
        roots, templates = spec.parse_roots(raw, rank)
        if "capacity_bytes" not in raw:
            raise ConfigError("capacity_bytes: missing; give the store's size, e.g. '64GiB'")
        kw: dict[str, Any] = {"roots": roots, "root_templates": templates, "tiers": lower, **spec.staging_values(raw)}
        for key in spec.KEYS.values():
            if key.name in raw:
                kw[key.name] = key.parse(key.name, raw.pop(key.name))
        spec.check_combinations(kw)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("capacity_bytes",) + (() if self.staging_auto else ("staging_bytes",)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v > MAX_BYTES:
                raise ConfigError(f"{name}={v!r}: expected a finite byte count below 2**63 "
                                 "such as '64GiB'")
        if self.capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes={self.capacity_bytes}: expected a positive size")
        if self.staging_auto:
            return  # sized at start-up (sized_staging), which validates again
        mem = host_memory_bytes()
        if mem is not None and self.staging_bytes > mem // 2:
            half = mem // 2
            hint = " (e.g. the default '512MiB')" if half >= 512 << 20 else ""
            raise ConfigError(
                f"staging_bytes={self.staging_bytes}: more than half of this host's "
                f"physical memory (the host has {human(mem)}, {mem} B); the staging ring is pinned host memory: "
                f"pass at most {half} ({human(half)}){hint}")
        if self.staging_slot_bytes < 4096:
            raise ConfigError(
                f"staging_bytes={self.staging_bytes}: with staging_slots="
                f"{self.staging_slots} each slot is under 4 KiB; raise staging_bytes"
            )
        if self.max_inflight_stores > self.staging_slots - 1:
            raise ConfigError(
                f"max_inflight_stores={self.max_inflight_stores}: must leave at least one "
                f"of staging_slots={self.staging_slots} for loads; expected at most {self.staging_slots - 1}"
            )
        if self.lookahead != "auto" and self.lookahead > self.staging_slots - self.max_inflight_stores:
            raise ConfigError(
                f"lookahead={self.lookahead}: loads may use only staging_slots - "
                f"max_inflight_stores = {self.staging_slots - self.max_inflight_stores} slots; lower lookahead "
                "or max_inflight_stores"
            )
