"""The engine's configuration: parsed from a plain dict (vLLM's kv_connector_extra_config),
validated once at start-up, every error naming the key, the value and the allowed range."""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

log = logging.getLogger("tutti.engine")

#: Every size is a signed 64-bit byte count (file offsets, the journal's fields): below 2**63.
MAX_BYTES = (1 << 63) - 1
_SIZE_HINT = "expected a byte count such as 1073741824 or '64GiB'"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


class ConfigError(ValueError):
    """A bad configuration value: the message starts with the key (``capacity_bytes=...: ...``) or
    speaks of the whole mapping. The engine knows no server's name for its configuration; the
    caller that does says where it came from (`qualified`)."""

    def qualified(self, where: str) -> str:
        """The message under `where` (e.g. vLLM's ``kv_connector_extra_config``)."""
        msg = str(self)
        return f"{where}.{msg}" if re.match(r"[a-z_]+[=:.\[]", msg) else f"{where}: {msg}"


def parse_bytes(key: str, value: Any) -> int:
    """An int, or a string like '64GiB', '512 MiB', '1e9': a finite count below 2**63.

    NaN, infinities ('inf', 'Infinity', '1e400', float('inf')) and counts of 2**63 or more are
    refused with a ValueError naming `key` and the value (never an OverflowError)."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: {_SIZE_HINT}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{key}={value!r}: not a finite number; {_SIZE_HINT}")
        if value != int(value):
            raise ConfigError(f"{key}={value!r}: not a whole number of bytes; {_SIZE_HINT}")
        return _bounded(key, value, int(value))
    if isinstance(value, int):
        return _bounded(key, value, value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            num, unit = m.group(1), _UNITS[m.group(2).lower()]
            if num.isdigit():
                if len(num) > 40:  # far past 2**63 (and int() of a huge digit string is slow)
                    raise _too_large(key, value)
                return _bounded(key, value, int(num) * unit)
            f = float(num) * unit  # '1e400' is inf here: refused below, never passed to int()
            if not math.isfinite(f):
                raise _too_large(key, value)
            return _bounded(key, value, int(f))
        try:
            special = not math.isfinite(float(value))  # 'inf', 'Infinity', 'NaN', '-inf'
        except (ValueError, OverflowError):
            special = False
        if special:
            raise ConfigError(f"{key}={value!r}: not a finite number; {_SIZE_HINT}")
    raise ConfigError(f"{key}={value!r}: {_SIZE_HINT}")


def _too_large(key: str, value: Any) -> ValueError:
    return ConfigError(f"{key}={value!r}: too large; a size must be a finite byte count below 2**63 "
                      f"({MAX_BYTES} B, 8 EiB), e.g. '64GiB'")


def _bounded(key: str, value: Any, n: int) -> int:
    if n > MAX_BYTES:
        raise _too_large(key, value)
    return n


def host_memory_bytes() -> int | None:
    """Physical memory of this host (page size x physical pages), or None where unknown."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    return n if n > 0 else None


def _human(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


_logged_roots: set[tuple[str, str]] = set()


def resolve_root(raw: str, rank: int) -> str:
    """`{rank}` expanded, then '~' expanded; a relative path made absolute against the current
    directory (logged once at INFO on 'tutti.engine': a server started elsewhere would use another)."""
    root = os.path.expanduser(raw.replace("{rank}", str(rank)))
    if os.path.isabs(root):
        return root
    cwd = os.getcwd()
    resolved = os.path.abspath(root)
    if (raw, resolved) not in _logged_roots:
        _logged_roots.add((raw, resolved))
        log.info("root=%r is a relative path: resolved against the current directory "
                 "%r to %r; pass an absolute path to make the store independent of where the server starts",
                 raw, cwd, resolved)
    return resolved


def resolve_writer_id(value: Any) -> str:
    """writer_id: '{host}' expanded, then 1-64 of A-Z a-z 0-9 . _ -."""
    import socket

    key = "writer_id"
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a string such as \"{{host}}\" or \"replica-0\"")
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())
    if len(host) > 48:  # cut, but two long names that share 48 characters must not share an id
        import hashlib

        host = host[:39] + "-" + hashlib.sha256(host.encode()).hexdigest()[:8]
    if value == "auto":
        return value
    out = value.replace("{host}", host)
    if out and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", out):
        raise ConfigError(f"{key}={value!r}: expected 1-64 of A-Z a-z 0-9 . _ - after expanding {{host}} "
                         f"(got {out!r}); one per server sharing the store, the same across its restarts")
    return out


def resolve_group(value: Any) -> int:
    """share_group: a group name or number this process belongs to -> its gid."""
    import grp

    key = "share_group"
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value in ("", -1):
        raise ConfigError(f"{key}={value!r}: expected the name (or number) of a group every sharing user belongs to, "
                         "e.g. \"kvshare\"")
    if isinstance(value, str) and ("\0" in value or not value.isprintable()):
        raise ConfigError(f"{key}={value!r}: a group name has no NUL or control characters; give the group's name "
                         "or number, e.g. \"kvshare\"")
    try:
        gid = grp.getgrnam(value).gr_gid if isinstance(value, str) and not value.isdigit() else int(value)
    except KeyError:
        raise ConfigError(f"{key}={value!r}: no such group on this host; create it (groupadd {value}) and add the "
                         "sharing users to it, or give its number") from None
    if gid != os.getegid() and gid not in os.getgroups():
        raise ConfigError(f"{key}={value!r}: this process (uid {os.geteuid()}) is not a member of group {gid}; add the "
                         "server's user to it (and start a new login session), or drop share_group to keep the store "
                         "private")
    return gid


def check_zmq_endpoint(value: Any) -> str:
    """'tcp://host:port' (host '*' binds), 'ipc://path' or 'inproc://name'; '' turns events off."""
    key = "kv_events_endpoint"
    if not isinstance(value, str):
        raise ConfigError(f"{key}={value!r}: expected a ZMQ endpoint string such as 'tcp://*:5557'")
    if value == "":
        return value
    m = re.fullmatch(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]+)", value)
    if m:
        if not 0 <= int(m.group(2)) <= 65535:
            raise ConfigError(f"{key}={value!r}: port {m.group(2)} is not in [0, 65535]")
        return value
    if re.fullmatch(r"(ipc|inproc)://.+", value):
        return value
    raise ConfigError(f"{key}={value!r}: expected 'tcp://HOST:PORT' (HOST '*' to bind, e.g. 'tcp://*:5557'; "
                     "a host name or IP to connect, e.g. 'tcp://indexer:5557'), 'ipc://PATH' or 'inproc://NAME'")



def _size_or_keyword(name: str, value: Any, minimum: int, expected: str) -> Any:
    """"auto", "off", or a size of at least `minimum` bytes; else a ConfigError naming the key."""
    if value in ("auto", "off"):
        return value
    try:
        value = parse_bytes(name, value)
        if value < minimum:
            raise ConfigError("too small")
    except ConfigError:
        raise ConfigError(f"{name}={value!r}: {expected}") from None
    return value

DEFAULT_WRITE_WINDOW = 64 << 20  # write_window_bytes "auto" on a drive: 2 chunks of an 8B model
MAPPED_STORE_COPIES = ("auto", "dma", "dma_chunk", "host")
ASYNC_LAUNCHES = ("auto", "step", "thread")
WHOLE_LOADS = ("chunk", "layer")
READS_FIRST_BYTES = 4 << 20  # reads_first: the writer's window (and write size) while hits' reads wait

@dataclass(frozen=True)
class EngineConfig:
    roots: tuple[str, ...]
    capacity_bytes: int
    chunk_tokens: int = 256
    io_backend: str = "auto"
    kernel_variant: str = "auto"
    # layers read ahead of the layer being computed; "auto": as far as the load staging slots allow
    lookahead: Any = 2
    # A load read not done after this many seconds (a stalled network file system) fails its
    # chunk, which vLLM recomputes, instead of hanging the step.
    io_timeout_s: float = 10.0
    # Host staging ring (pinned where CUDA exists), cut into equal slots: the rolling loads' and
    # the stores' (whole chunks, from their step until written; what does not fit is skipped).
    # "auto" (all three left out): sized at start-up from the model's geometry and vLLM's step
    # token budget (`sized_staging`), so stores are skipped only when the storage is slower than
    # prefill; give any of them to size it yourself (the others then default to 512 MiB, 64, 48).
    staging_bytes: Any = "auto"
    staging_slots: Any = "auto"
    max_inflight_stores: Any = "auto"  # slots stores may hold; the rest serve the rolling loads
    verify_checksums: bool = True
    slots_per_slab: int = 64
    io_options: Mapping[str, Any] = field(default_factory=dict)  # the IO backend's own keyword options
    max_open_slabs: int = 256  # slab descriptors kept open (more only while IO in flight holds them)
    # Loads copy straight from slab files mapped into memory (one DMA on CUDA, no read system
    # call): "auto" = where every root is on a RAM file system (tmpfs, ramfs) and not shared.
    mapped_loads: Any = "auto"
    # Hits load asynchronously: vLLM holds the request outside the batch until its KV is read,
    # verified and scattered, so the batch never waits and a failed chunk is recomputed before
    # any token is sampled from it. "auto" = where vLLM schedules asynchronously (its default):
    # there a step is scheduled before the last one's output is read, so a layer-wise load that
    # fails its checksum would already have a token sampled from its KV in flight.
    async_loads: Any = "auto"
    # Who launches an asynchronous load from a mapped RAM root: "step" = the step's own thread,
    # when vLLM binds the step (a few launches on a side stream, nothing waited for; the verdicts
    # are read once the load's event says it landed), "thread" = tutti's asynchronous-load thread.
    # "auto" = "step" where it can (CUDA, a mapped root, one KV cache group, no secret; the rest
    # stays on the thread, which waits for reads; on the CPU a launch is the load itself). Why: a serving trace (docs/results/serve.md, run 14)
    # showed the thread's Python between launches, beside vLLM's eager attention, stretching the
    # steps that prefill from 16-17 ms to 24-33 ms of host time, and each job from about 2 ms of
    # CUDA calls to 16-25 ms: the two threads took turns at the GIL.
    async_launch: str = "auto"
    # How a whole load (every asynchronous load, a FULL CUDA-graph step's) reads through the file
    # path: "chunk" = one read per chunk's slot and one copy, verify and scatter per group of chunks
    # (tutti.engine.worker.loads.file_chunks); "layer" = a read, copy, verify and scatter per layer and group of
    # chunks (the layer-wise path's items, tutti before session 13: 32x the IO requests and about
    # 30x the launches for a 4k-token hit of an 8B model, bench/whole_load_calls.py). Kept to compare.
    whole_loads: str = "chunk"
    # Where hits load in the step (async_loads false): the bytes one step may load layer-wise; a
    # hit past it loads asynchronously instead, so no step waits on a load it cannot hide (vLLM
    # 0.33's connector calls its knob sync_load_budget_bytes). "auto" = what the measured read
    # rate moves while the GPU computes one full step; "off" = no budget; or a size.
    sync_load_budget_bytes: Any = "auto"
    # Bytes of store writes in flight at once (None = "off": a run's writes all at once). Reads of
    # hits share the drive's queue with them: a read waits behind whatever is queued ahead of it,
    # so more writes in flight than keep the drive busy only slow the hits' reads. "auto" = 64 MiB
    # on a drive, off where every root is on a RAM file system (copies, no queue to share).
    write_window_bytes: Any = "auto"  # resolved by build_worker (DEFAULT_WRITE_WINDOW on a drive)
    # Writes yield to hits' reads where a write window is on (a drive): while a load's reads are
    # in flight the writer keeps one write of READS_FIRST_BYTES in flight (tutti.io.queue.ReadsFirst).
    # "auto" or true = wherever write_window_bytes is a window (a RAM root has none); false.
    reads_first: Any = "auto"
    # The interpreter's GIL switch interval in the worker's process, lowered at start-up to these
    # seconds in (0, 0.1] (never raised): a thread that wakes to finish IO waits up to this long
    # for the GIL while another thread runs Python (CPython's default 5 ms; vLLM's engine loop
    # spins in Python while a request waits for its asynchronous load). "off" (the default: 0.5 ms
    # changed nothing under vllm serve on an H200, serve.md run 10) leaves the interpreter's.
    gil_switch_interval_s: Any = "off"
    # Seconds a step with no token scheduled (vLLM's requests all wait, e.g. for their loads) waits
    # for the asynchronous loads in flight, the GIL released, before it returns: vLLM's engine loop
    # would otherwise spin in Python, and every torch call and IO completion of the loading thread
    # waits for the GIL behind it. No forward pass waits (the step has none); a request arriving
    # meanwhile waits this long at most. 0 ("off") returns at once. 2 ms: on the CPU machine's real
    # engine with asynchronous loads (bench/gil_interval_ab.py --ab grid --tiny --extra
    # '{"async_loads": true}', docs/results/idle_wait_cpu_async.json) it made 2k hits 2-4x faster on
    # both paths: without it the load thread took 330-800 ms to queue 7 chunks, waiting for the GIL
    # behind the loop. "auto" (the default): 2 ms where asynchronous loads run on tutti's loading
    # thread, 0 where vLLM's own thread launches them (async_launch step: nothing waits for the GIL
    # from the loop; on the H200 the 8k and 32k RAM hits were as fast or faster without the wait in
    # 7 of 8 pairs over two sessions, docs/results/single_request.md sessions 13-14).
    idle_load_wait_s: Any = "auto"
    # How a store reaches a mapped RAM root's slot (stores into maps, tutti.engine.worker.stores):
    # "dma": the writer thread copies a run's chunks from the device staging into the slots'
    # registered mappings, all at once; "dma_chunk": the same, one chunk's copy in flight at a time
    # (a decode step's own small device-to-host copy then waits behind one chunk at most);
    # "host": the step queues the device-to-host copy into the pinned staging right after the
    # gather (as the file path does) and the writer thread copies host to mapping (a memcpy, the
    # GIL released). "auto" = "dma_chunk" (decode while storing on an H200: dma 1.07x of no
    # connector, host 1.06x, dma_chunk 1.01x; bench/vllm_ttft.py's _dma_chunk/_host cases).
    mapped_store_copy: str = "auto"
    # "dma_chunk": chunks whose copies may be queued at once. 1 keeps a decode step's own copy
    # behind one chunk at most (decode 1.006x while storing on the H200); more may drain a prefill
    # burst faster (the writer thread takes the GIL back between chunks; serve run 12 moved 25.8 GB
    # in 9.2 store-seconds and skipped 6 stores) at the cost of longer waits for that copy. Not yet
    # measured on the GPU.
    store_copies_in_flight: int = 1
    store_decode: bool = False  # also store chunks completed by generated tokens
    # How much of a hit to load (tutti.engine.sched.hit_policy): "auto" loads only what its measured
    # read and prefill rates say is faster than recomputing; "always", "never", a registered
    # name or "package.module:attr".
    hit_policy: str = "auto"
    # Which resident chunk a full store gives up first (tutti.engine.sched.eviction): "lru", "fifo",
    # a registered name or "package.module:attr".
    eviction_policy: str = "lru"
    # Which computed chunks the store takes at all (tutti.engine.sched.admission): "all", "seen_twice",
    # "drive_share" (whole prefixes, fewer while the drive is the bottleneck), a registered name
    # or "package.module:attr".
    store_admission: str = "all"
    # Publish tutti's KV events (BlockStored/BlockRemoved, medium STORAGE) on this ZMQ endpoint
    # in vLLM's wire format; "" = off (events still go through vLLM's --kv-events-config).
    kv_events_endpoint: str = ""
    kv_events_topic: str = ""  # ZMQ topic; llm-d expects "kv@<pod>@<model>"; {host}, {model}, {writer} expand
    # Keyed integrity (tutti.store.integrity): the secret from a file or an environment variable;
    # only where it comes from is kept here, never the secret itself.
    secret_file: str = ""
    secret_env: str = ""
    # Share the store with servers of other users in this group (a name or number); needs a secret.
    share_group: str = ""
    # This server's identity among the servers sharing the root: its files go to the namespace's
    # `w-<writer_id>/` directory; '' = the namespace's only writer (files at its top). Every
    # server reads every writer; `{host}` expands to the host name.
    writer_id: str = "auto"  # "auto": found at start-up (tutti.engine.claims), no per-server setting
    follow_interval_s: float = 0.25  # how often the other writers' journals are followed
    extra: Mapping[str, Any] = field(default_factory=dict)
    # the roots as given, before `{rank}` was expanded: for_rank() expands them again
    root_templates: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def for_rank(self, rank: int) -> "EngineConfig":
        """This config for another rank's store: only `{rank}` in the roots differs, so nothing is
        parsed or validated again (one parse per process half)."""
        from dataclasses import replace

        if not self.root_templates or not any("{rank}" in r for r in self.root_templates):
            return self
        return replace(self, roots=tuple(resolve_root(r, rank) for r in self.root_templates))

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
                      memory_bytes: int | None = None) -> "EngineConfig":
        """This config with "auto" staging sized: slots of about 8 MiB (whole segments), room for
        the stores of two steps of `step_tokens` prefill tokens (one being gathered while the last
        is written: at the storage's own pace nothing is skipped), and load slots for four chunks
        (at least 16, so the default lookahead fits any geometry). Capped at a quarter of host memory (pinned memory), logged when the cap
        cuts the stores' room."""
        if not self.staging_auto:
            return self
        from dataclasses import replace

        slot = segment_bytes * max(1, (8 << 20) // segment_bytes)
        step = step_tokens if step_tokens and step_tokens > 0 else 8192
        store_chunks = max(4, 2 * -(-step // self.chunk_tokens))
        load_slots = max(16, -(-4 * chunk_bytes // slot))  # a lookahead past them is refused (validate)
        mem = host_memory_bytes() if memory_bytes is None else memory_bytes
        cap = mem // 4 if mem else None
        want = store_chunks
        while True:
            inflight = max(1, -(-store_chunks * chunk_bytes // slot))
            total = (inflight + load_slots) * slot
            if cap is None or total <= cap or store_chunks <= 2:
                break
            store_chunks -= 1
        if store_chunks < want:
            log.warning("tutti: staging sized to %s (a quarter of host memory, pinned): stores of more than %d "
                        "chunks in flight are skipped (a step of %d tokens makes %d); set staging_bytes, "
                        "staging_slots and max_inflight_stores to size it yourself", _human(total), store_chunks,
                        step, -(-step // self.chunk_tokens))
        out = replace(self, staging_bytes=total, staging_slots=inflight + load_slots, max_inflight_stores=inflight)
        out.validate()
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, rank: int = 0) -> "EngineConfig":
        """Validate `raw` (unknown keys rejected); `{rank}` in a root expands to `rank`."""
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)} - {"roots", "extra"} | {"root", "roots"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(
                f"unknown key(s) {unknown}; allowed keys are {sorted(known)}"
            )
        if "root" in raw and "roots" in raw:
            raise ConfigError("give either 'root' or 'roots', not both")
        roots_v = raw.pop("roots", raw.pop("root", None))
        if roots_v is None:
            raise ConfigError("root: missing; give a directory (or 'roots': a list, "
                             "one per drive), e.g. {\"root\": \"/mnt/nvme/tutti\"}")
        if isinstance(roots_v, str):
            roots_v = [roots_v]
        if not isinstance(roots_v, (list, tuple)) or not roots_v or not all(isinstance(r, str) and r for r in roots_v):
            raise ConfigError(f"roots={roots_v!r}: expected a non-empty list of directory paths")
        bad = [r for r in roots_v if "\0" in r]
        if bad:
            raise ConfigError(f"roots={bad!r}: a path has no NUL byte; give the directory's path")
        roots = tuple(resolve_root(r, rank) for r in roots_v)
        real = [os.path.realpath(r) for r in roots]
        if len(set(real)) != len(real):
            raise ConfigError(f"roots={list(roots_v)!r}: a directory is listed twice ({sorted({r for r in real if real.count(r) > 1})}); "
                              "stripes need one directory each (one per drive), or give a single 'root'")
        if "capacity_bytes" not in raw:
            raise ConfigError("capacity_bytes: missing; give the store's size, e.g. '64GiB'")
        kw: dict[str, Any] = {"roots": roots, "root_templates": tuple(roots_v), "capacity_bytes": parse_bytes(
            "capacity_bytes", raw.pop("capacity_bytes"))}
        if {"staging_bytes", "staging_slots", "max_inflight_stores"} & set(raw):  # sized by hand
            kw.update(staging_bytes=512 << 20, staging_slots=64, max_inflight_stores=48)
        if raw.get("staging_bytes") == "auto" and not {"staging_slots", "max_inflight_stores"} & set(raw):
            raw.pop("staging_bytes")
            kw.update(staging_bytes="auto", staging_slots="auto", max_inflight_stores="auto")
        if "staging_bytes" in raw:
            kw["staging_bytes"] = parse_bytes("staging_bytes", raw.pop("staging_bytes"))
        if raw.get("lookahead") == "auto":
            kw["lookahead"] = raw.pop("lookahead")
        for name, lo, hi in (("chunk_tokens", 1, 1 << 20), ("lookahead", 1, 1024), ("staging_slots", 2, 4096),
                             ("max_inflight_stores", 1, 4096), ("slots_per_slab", 1, 1 << 20),
                             ("store_copies_in_flight", 1, 4096),
                             ("max_open_slabs", 1, 1 << 20)):
            if name in raw:
                v = raw.pop(name)
                if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                    raise ConfigError(f"{name}={v!r}: expected an integer in [{lo}, {hi}]")
                kw[name] = v
        for name, auto in (("mapped_loads", "RAM roots only"), ("async_loads", "where vLLM schedules asynchronously"),
                           ("reads_first", "wherever write_window_bytes is a window: a drive")):
            if name in raw:
                v = raw.pop(name)
                if not (v == "auto" and isinstance(v, str) or isinstance(v, bool)):
                    raise ConfigError(f"{name}={v!r}: expected \"auto\" ({auto}), true or false")
                kw[name] = v
        if "sync_load_budget_bytes" in raw:
            kw["sync_load_budget_bytes"] = _size_or_keyword(
                "sync_load_budget_bytes", raw.pop("sync_load_budget_bytes"), 0,
                "expected \"auto\" (what the read rate moves in one step), \"off\" (no budget) or a size such as '256MiB'")
        if "write_window_bytes" in raw:
            v = _size_or_keyword("write_window_bytes", raw.pop("write_window_bytes"), 4096,
                                 "expected a size of at least 4KiB such as '64MiB' (store writes in flight at once), "
                                 "\"auto\" (64MiB on a drive, off on RAM roots) or \"off\"")
            kw["write_window_bytes"] = None if v == "off" else v
        if "gil_switch_interval_s" in raw:
            v = raw.pop("gil_switch_interval_s")
            if not (v == "off" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 0.1)):
                raise ConfigError(f"gil_switch_interval_s={v!r}: expected \"off\" (the interpreter's own) or seconds "
                                  "in (0, 0.1] such as 0.0005")
            kw["gil_switch_interval_s"] = v
        if raw.get("idle_load_wait_s") == "off":
            raw["idle_load_wait_s"] = 0
        if raw.get("idle_load_wait_s") == "auto":
            raw.pop("idle_load_wait_s")
        for name, choices, what in (
                ("async_launch", ASYNC_LAUNCHES, "who launches an asynchronous load from a mapped RAM root; "
                                                 "\"auto\" = \"step\" where it can"),
                ("mapped_store_copy", MAPPED_STORE_COPIES, "how a store reaches a mapped RAM root's slot; "
                                                           "\"auto\" = \"dma_chunk\""),
                ("whole_loads", WHOLE_LOADS, "how a whole load reads through the file path; \"chunk\" = one "
                                             "read per chunk")):
            if name in raw:
                v = raw.pop(name)
                if v not in choices:
                    raise ConfigError(f"{name}={v!r}: expected one of {list(choices)} ({what})")
                kw[name] = v
        for name in ("verify_checksums", "store_decode"):
            if name in raw:
                v = raw.pop(name)
                if not isinstance(v, bool):
                    raise ConfigError(f"{name}={v!r}: expected true or false")
                kw[name] = v
        from tutti.engine.sched.admission import get_admission
        from tutti.engine.sched.eviction import get_eviction
        from tutti.engine.sched.hit_policy import get_policy

        for name, resolve in (("hit_policy", get_policy), ("eviction_policy", get_eviction),
                              ("store_admission", get_admission)):
            if name in raw:
                v = raw.pop(name)
                try:
                    resolve(v)  # a name that resolves, checked before any IO
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
                kw[name] = v
        if "io_backend" in raw:
            v = raw.pop("io_backend")
            if not isinstance(v, str):
                raise ConfigError(f"io_backend={v!r}: expected a name (\"auto\", \"uring\", \"threads\", \"nvme\", a "
                                  "registered name) or \"package.module:attr\"")
            if v != "auto":
                from tutti.io.queue import resolve_backend

                try:
                    resolve_backend(v)
                except ValueError as exc:
                    raise ConfigError(str(exc)) from None
            kw["io_backend"] = v
        if "io_options" in raw:
            v = raw.pop("io_options")
            if not isinstance(v, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in v):
                raise ConfigError(f"io_options={v!r}: expected a mapping of the backend's "
                                 "keyword options, e.g. {\"workers\": 8}")
            kw["io_options"] = dict(v)
        if "kernel_variant" in raw:
            v = raw.pop("kernel_variant")
            if not isinstance(v, str) or not v:
                raise ConfigError(f"kernel_variant={v!r}: expected a registered variant "
                                 "name ('auto', 'triton', 'torch') or 'package.module:function'")
            kw["kernel_variant"] = v
        if "kv_events_endpoint" in raw:
            kw["kv_events_endpoint"] = check_zmq_endpoint(raw.pop("kv_events_endpoint"))
        if "kv_events_topic" in raw:
            v = raw.pop("kv_events_topic")
            if not isinstance(v, str):
                raise ConfigError(f"kv_events_topic={v!r}: expected a string such as "
                                 "\"kv@{host}@{model}\"")
            kw["kv_events_topic"] = v
        for name, lo, hi, example in (("io_timeout_s", 0.001, 3600, "10"), ("follow_interval_s", 0.01, 60, "0.25"),
                                      ("idle_load_wait_s", 0, 0.05, '0.002 (or "auto", or "off")')):
            if name in raw:
                v = raw.pop(name)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                    raise ConfigError(f"{name}={v!r}: expected seconds in [{lo}, {hi}], e.g. {example}")
                kw[name] = float(v)
        for name in ("secret_file", "secret_env"):
            if name in raw:
                v = raw.pop(name)
                if not isinstance(v, str) or not v:
                    raise ConfigError(f"{name}={v!r}: expected a non-empty string (a path "
                                     "to a file holding the secret, or an environment variable's name)")
                kw[name] = v
        if "writer_id" in raw:
            kw["writer_id"] = resolve_writer_id(raw.pop("writer_id"))
        if "share_group" in raw:
            v = raw.pop("share_group")
            resolve_group(v)
            if not (kw.get("secret_file") or kw.get("secret_env")):
                raise ConfigError(
                    f"share_group={v!r}: sharing a store with other users needs a secret "
                    "(secret_file or secret_env) known to every sharing server, so that no group member can forge "
                    "KV for another; add one, or drop share_group")
            kw["share_group"] = str(v)
        if kw.get("verify_checksums") is False and kw.get("writer_id") not in (None, "", "auto"):
            raise ConfigError(
                f"verify_checksums=False: refused with writer_id={kw['writer_id']!r}: another writer may evict and "
                "rewrite a slot between a reader's journal check and its reads, and only the checksum tells the "
                "other prompt's KV apart; keep verify_checksums on where several servers share a root")
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
                f"physical memory (the host has {_human(mem)}, {mem} B); the staging ring is pinned host memory: "
                f"pass at most {half} ({_human(half)}){hint}")
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
