"""Every configuration key in one table: its group, the values it takes, what it does, an example
and its parser. `EngineConfig.from_dict` is a loop over this table, and docs/configuration.md is
rendered from it (`python3 -m tutti.engine.config.reference > docs/configuration.md`; a test fails
when the two differ). Defaults are the `EngineConfig` dataclass's, never repeated here.

A new key: a field on EngineConfig (with its default), a row here (a parser from the factories
below or values.py), and the doc rendered again.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from tutti.engine.config.values import (
    ASYNC_LAUNCHES, MAPPED_STORE_COPIES, WHOLE_LOADS, ConfigError, TierConfig, check_zmq_endpoint, parse_bytes,
    resolve_group, resolve_writer_id, size_or_keyword,
)

Parse = Callable[[str, Any], Any]

GROUPS = {
    "essential": "Essential: what everyone sets",
    "tuning": "Tuning: IO, staging, loads and stores",
    "policy": "Policies: what is loaded, stored and evicted",
    "sharing": "Sharing, security and events",
    "diagnostics": "Diagnostics and A/B switches",
}


@dataclass(frozen=True)
class Key:
    """One configuration key."""

    name: str
    group: str  # one of GROUPS
    takes: str  # the values it takes, in words
    doc: str  # what it does, one line
    example: Any  # a value, as JSON would write it
    parse: Parse  # (key, raw value) -> the value EngineConfig holds; ConfigError naming the key otherwise
    required: bool = False


# ---- parser factories --------------------------------------------------------------------------
def integer(lo: int, hi: int, *, auto: bool = False) -> Parse:
    def parse(name: str, v: Any) -> Any:
        if auto and v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{name}={v!r}: expected an integer in [{lo}, {hi}]")
        return v
    return parse


def seconds(lo: float, hi: float, example: str, *, off: float | None = None, auto: bool = False) -> Parse:
    def parse(name: str, v: Any) -> Any:
        if auto and v == "auto":
            return v
        if off is not None and v == "off":
            return off
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ConfigError(f"{name}={v!r}: expected seconds in [{lo}, {hi}], e.g. {example}")
        return float(v)
    return parse


def share(example: str) -> Parse:
    def parse(name: str, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ConfigError(f"{name}={v!r}: expected a share in [0, 1], e.g. {example}")
        return float(v)
    return parse


def tristate(auto_means: str) -> Parse:
    def parse(name: str, v: Any) -> Any:
        if not (v == "auto" and isinstance(v, str) or isinstance(v, bool)):
            raise ConfigError(f"{name}={v!r}: expected \"auto\" ({auto_means}), true or false")
        return v
    return parse


def flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{name}={v!r}: expected true or false")
    return v


def choice(choices: tuple[str, ...], what: str) -> Parse:
    def parse(name: str, v: Any) -> Any:
        if v not in choices:
            raise ConfigError(f"{name}={v!r}: expected one of {list(choices)} ({what})")
        return v
    return parse


def size(name: str, v: Any) -> int:
    return parse_bytes(name, v)


def size_or(minimum: int, expected: str, *, off: Any = "off") -> Parse:
    def parse(name: str, v: Any) -> Any:
        got = size_or_keyword(name, v, minimum, expected)
        return off if got == "off" else got
    return parse


def text(expected: str, *, empty: bool = True) -> Parse:
    def parse(name: str, v: Any) -> str:
        if not isinstance(v, str) or (not empty and not v):
            raise ConfigError(f"{name}={v!r}: expected {expected}")
        return v
    return parse


def _resolves(check: Callable[[Any], Any], v: Any) -> Any:
    """`v`, once `check` accepts it; its ValueError (which names the key) as a ConfigError."""
    try:
        check(v)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return v


def policy(getter: str) -> Parse:
    """A policy name that resolves (tutti.engine.sched.*), checked before any IO."""
    def parse(name: str, v: Any) -> Any:
        import importlib

        module, _, fn = getter.rpartition(".")
        return _resolves(getattr(importlib.import_module(module), fn), v)
    return parse


def io_backend(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"{name}={v!r}: expected a name (\"auto\", \"uring\", \"threads\", \"nvme\", a "
                          "registered name) or \"package.module:attr\"")
    if v != "auto":
        from tutti.io.queue import resolve_backend

        _resolves(resolve_backend, v)
    return v


def medium(name: str, v: Any) -> str:
    """A medium that resolves (tutti.store.medium), checked before any IO."""
    from tutti.store.medium import check_medium

    return _resolves(check_medium, v)


def codec(name: str, v: Any) -> str:
    """A codec that resolves (tutti.codec), checked before any IO."""
    from tutti.codec import check_codec

    return _resolves(check_codec, v)


def io_options(name: str, v: Any) -> dict:
    if not isinstance(v, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in v):
        raise ConfigError(f"{name}={v!r}: expected a mapping of the backend's keyword options, e.g. {{\"workers\": 8}}")
    return dict(v)


def gil_interval(name: str, v: Any) -> Any:
    if not (v == "off" or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 0.1)):
        raise ConfigError(f"{name}={v!r}: expected \"off\" (the interpreter's own) or seconds in (0, 0.1] such as "
                          "0.0005")
    return v


def group(name: str, v: Any) -> str:
    resolve_group(v)
    return str(v)


# ---- the table ---------------------------------------------------------------------------------
_SECRET = "a non-empty string (a path to a file holding the secret, or an environment variable's name)"
KEYS: dict[str, Key] = {k.name: k for k in (
    Key("root", "essential", "a directory path (`{rank}` expands to the worker's rank)",
        "Where the store lives: a directory on NVMe, a RAM file system or a shared file system; `roots` "
        "instead stripes one store over several directories, one per drive.", "/mnt/nvme/tutti",
        lambda n, v: v, required=True),
    Key("capacity_bytes", "essential", "a size: bytes, or a string such as '64GiB'",
        "The store's size on this root, per rank; the eviction policy keeps it there.", "64GiB", size,
        required=True),
    Key("tiers", "essential", "a list of {root or roots, capacity_bytes[, eviction_policy, medium, io_backend, "
        "io_options]}, fastest first", "A hierarchy instead of one root: a chunk lands in the first tier and is "
        "served from the fastest tier holding it; each tier keeps its own capacity, eviction, journal and "
        "checksums, and its own IO queue where its io_backend (\"auto\": decided per tier) or io_options differ.",
        [{"root": "/dev/shm/tutti", "capacity_bytes": "64GiB"}, {"root": "/mnt/nvme/tutti", "capacity_bytes": "2TiB"}],
        lambda n, v: v),
    Key("write_policy", "essential", "\"through\" or \"back\"",
        "With tiers: \"through\" copies every chunk a tier commits down to the next, off the forward thread; "
        "\"back\" only those nearing eviction from a full tier that admission finds worth a drive write. A "
        "hit from a lower tier is copied back up when admission agrees.", "through",
        choice(("through", "back"), "how chunks reach the lower tiers")),
    Key("promote", "tuning", "\"hits\", \"stage\" or \"off\"",
        "With tiers: \"hits\" copies a chunk a hit loaded from a lower tier up into the first when admission "
        "agrees (another server's chunk too) and no write-down is waiting; \"stage\" copies a hit's chunks "
        "up before it loads, the request waiting without GPU blocks meanwhile (as vLLM's own tiering does: a hit "
        "loading from the drive holds its blocks idle for the read; 17% of the GPU KV cache in "
        "`scripts/gpu_tiers.sh 9`, results/tiers.md), then loads them from the first tier (it halved the idle blocks "
        "and served the same as \"hits\" in `scripts/gpu_tiers.sh 11` and `12`); \"off\" leaves the first tier to new chunks: "
        "the chunk a hit loaded is in vLLM's GPU cache by then, so its copy in RAM serves only once vLLM evicts it "
        "(bench/drive_sim.py's model serves a few percent more without; `scripts/gpu_tiers.sh 5` served the "
        "same either way: results/tiers.md).", "hits",
        choice(("hits", "stage", "off"), "whether and when hits from a lower tier are copied up")),
    Key("stage_pressure", "tuning", "a share in [0, 1]",
        "With promote \"stage\": a hit is staged only while the requests in flight hold more than this share of "
        "vLLM's GPU KV blocks with the hit's own (idle blocks cost only where others wait for them; below it the "
        "hit loads from where its chunks are, at once); 0 stages every hit from a lower tier. Where vLLM gives "
        "no block count, every hit is staged. bench/drive_sim.py --gpu-kv-chunks: results/drive_sim.md.", 0.7,
        share("0.7")),
    Key("chunk_tokens", "essential", "an integer in [1, 1048576], a multiple of vLLM's block size",
        "Tokens per stored chunk: the unit of a hit, a store and an eviction.", 256, integer(1, 1 << 20)),
    Key("medium", "tuning", "\"file\", a registered name or \"package.module:attr\"",
        "Where slab bytes live: slab files on the root (\"file\"), or another medium (tutti.store.medium); the "
        "namespace, lock and journal stay on the root.", "file", medium),
    Key("codec", "tuning", "\"identity\", a registered name or \"package.module:attr\"",
        "How a segment's bytes are stored: as they are (\"identity\") or encoded by a codec (tutti.codec), whose "
        "name makes the namespace its own; loads then read through the file path (no mapped loads).", "identity",
        codec),
    Key("io_backend", "tuning", "\"auto\", \"uring\", \"threads\", \"nvme\", a registered name or "
        "\"package.module:attr\"", "How reads and writes reach the storage; \"auto\": the thread pool on RAM "
        "roots, io_uring elsewhere.", "uring", io_backend),
    Key("io_options", "tuning", "a mapping of the backend's keyword options",
        "Passed to the IO backend as it is opened.", {"workers": 8}, io_options),
    Key("io_timeout_s", "tuning", "seconds in [0.001, 3600]",
        "A read not done by then fails its chunk (vLLM recomputes it) instead of hanging the step.", 10,
        seconds(0.001, 3600, "10")),
    Key("kernel_variant", "tuning", "\"auto\", \"triton\", \"torch\" or \"package.module:function\"",
        "The gather/scatter kernels between the paged cache and packed segments.", "triton",
        text("a registered variant name ('auto', 'triton', 'torch') or 'package.module:function'", empty=False)),
    Key("lookahead", "tuning", "\"auto\" or an integer in [1, 1024]",
        "Layers read ahead of the layer being computed; \"auto\": as far as the load staging slots allow.", 2,
        integer(1, 1024, auto=True)),
    Key("staging_bytes", "tuning", "\"auto\" or a size",
        "The pinned host staging ring; \"auto\" (with the next two left out) sizes it from the model and "
        "vLLM's step so stores are skipped only when the storage is slower than prefill.", "1GiB", size),
    Key("staging_slots", "tuning", "\"auto\" or an integer in [2, 4096]",
        "Equal slots the staging ring is cut into (give all three staging keys to size it by hand).", 64,
        integer(2, 4096)),
    Key("max_inflight_stores", "tuning", "\"auto\" or an integer in [1, 4096]",
        "Staging slots stores may hold; the rest serve loads.", 48, integer(1, 4096)),
    Key("slots_per_slab", "tuning", "an integer in [1, 1048576]",
        "Chunk slots per slab file (large files: creating and deleting them costs more than a chunk's IO).", 64,
        integer(1, 1 << 20)),
    Key("max_open_slabs", "tuning", "an integer in [1, 1048576]",
        "Slab descriptors kept open (more only while IO in flight holds them).", 256, integer(1, 1 << 20)),
    Key("mapped_loads", "tuning", "\"auto\", true or false",
        "Load by copying from slab files mapped into memory; \"auto\": where every root is a private RAM "
        "file system.", "auto", tristate("RAM roots only")),
    Key("async_loads", "tuning", "\"auto\", true or false",
        "Hits load while vLLM holds the request outside the batch, so a failed chunk is recomputed before a "
        "token is sampled from it; \"auto\": where vLLM schedules asynchronously (its default).", "auto",
        tristate("where vLLM schedules asynchronously")),
    Key("async_launch", "tuning", "\"auto\", \"step\" or \"thread\"",
        "Who launches an asynchronous load from a mapped RAM root; \"auto\": vLLM's step thread where it can.",
        "auto", choice(ASYNC_LAUNCHES, "who launches an asynchronous load from a mapped RAM root; \"auto\" = "
                       "\"step\" where it can")),
    Key("sync_load_budget_bytes", "tuning", "\"auto\", \"off\" or a size",
        "Bytes one step may load layer-wise; a larger hit loads asynchronously; \"auto\": what the measured read "
        "rate moves in one step.", "auto",
        size_or(0, "expected \"auto\" (what the read rate moves in one step), \"off\" (no budget) or a size such "
                "as '256MiB'")),
    Key("write_window_bytes", "tuning", "\"auto\", \"off\" or a size of at least 4KiB",
        "Store writes in flight at once, so hits' reads do not queue behind them; \"auto\": 64MiB on a drive, "
        "off on RAM roots.", "64MiB",
        size_or(4096, "expected a size of at least 4KiB such as '64MiB' (store writes in flight at once), "
                "\"auto\" (64MiB on a drive, off on RAM roots) or \"off\"", off=None)),
    Key("reads_first", "tuning", "\"auto\", true or false",
        "While a hit's reads are in flight, stores keep one small write in flight; \"auto\": wherever a write "
        "window is on.", "auto", tristate("wherever write_window_bytes is a window: a drive")),
    Key("idle_load_wait_s", "tuning", "\"auto\", \"off\" or seconds in [0, 0.05]",
        "A step with nothing to compute waits this long for asynchronous loads, the GIL released; \"auto\": "
        "2 ms where tutti's loading thread loads, 0 where vLLM's thread launches.", "auto",
        seconds(0, 0.05, '0.002 (or "auto", or "off")', off=0.0, auto=True)),
    Key("mapped_store_copy", "tuning", "\"auto\", \"dma\", \"dma_chunk\" or \"host\"",
        "How a store reaches a mapped RAM root's slot; \"auto\": \"dma_chunk\".", "auto",
        choice(MAPPED_STORE_COPIES, "how a store reaches a mapped RAM root's slot; \"auto\" = \"dma_chunk\"")),
    Key("store_copies_in_flight", "tuning", "an integer in [1, 4096]",
        "With \"dma_chunk\": chunks whose copies may be queued at once.", 1, integer(1, 4096)),
    Key("store_decode", "tuning", "true or false",
        "Also store chunks completed by generated tokens.", False, flag),
    Key("hit_policy", "policy", "\"auto\", \"always\", \"never\", a registered name or \"package.module:attr\"",
        "How much of a hit to load; \"auto\": what the measured read and prefill rates say is faster than "
        "recomputing.", "auto", policy("tutti.engine.sched.hit_policy.get_policy")),
    Key("eviction_policy", "policy", "\"lru\", \"fifo\", \"lfuda\", a registered name or \"package.module:attr\"",
        "Which resident chunk a full store gives up first.", "lru",
        policy("tutti.engine.sched.eviction.get_eviction")),
    Key("store_admission", "policy", "\"all\", \"seen_twice\", \"drive_share\", a registered name or "
        "\"package.module:attr\"", "Which computed chunks the store takes at all.", "all",
        policy("tutti.engine.sched.admission.get_admission")),
    Key("verify_checksums", "sharing", "true or false",
        "Check every loaded chunk against its journaled checksums; off trusts this writer's own chunks only "
        "(another writer's are always checked).", True, flag),
    Key("secret_file", "sharing", _SECRET,
        "Keyed integrity: a file holding the secret every sharing server knows (never stored in the config).",
        "/etc/tutti/secret", text(_SECRET, empty=False)),
    Key("secret_env", "sharing", _SECRET,
        "Keyed integrity: the environment variable holding the secret.", "TUTTI_SECRET",
        text(_SECRET, empty=False)),
    Key("share_group", "sharing", "a group name or number this process belongs to",
        "Share the store with servers of other users in this group (needs a secret).", "kvshare", group),
    Key("writer_id", "sharing", "\"auto\", '' or 1-64 of A-Z a-z 0-9 . _ - (`{host}` expands)",
        "This server's identity among the servers sharing the root; \"auto\": found at start-up.", "{host}-gpu0",
        lambda n, v: resolve_writer_id(v)),
    Key("follow_interval_s", "sharing", "seconds in [0.01, 60]",
        "How often the other writers' journals are followed.", 0.25, seconds(0.01, 60, "0.25")),
    Key("kv_events_endpoint", "sharing", "'' or a ZMQ endpoint ('tcp://*:5557', 'ipc://PATH')",
        "Publish tutti's KV events (BlockStored/BlockRemoved, medium STORAGE) here in vLLM's wire format.",
        "tcp://*:5557", lambda n, v: check_zmq_endpoint(v)),
    Key("kv_events_topic", "sharing", "a string ({host}, {model}, {writer} expand)",
        "The ZMQ topic of those events; llm-d expects \"kv@<pod>@<model>\".", "kv@{host}@{model}",
        text("a string such as \"kv@{host}@{model}\"")),
    Key("whole_loads", "diagnostics", "\"chunk\" or \"layer\"",
        "How a whole load reads through the file path: one read per chunk, or per layer (kept to compare).",
        "chunk", choice(WHOLE_LOADS, "how a whole load reads through the file path; \"chunk\" = one read per "
                        "chunk")),
    Key("gil_switch_interval_s", "diagnostics", "\"off\" or seconds in (0, 0.1]",
        "Lower the interpreter's GIL switch interval in the worker's process (never raised).", "off",
        gil_interval),
)}
#: `roots` is `root` for several directories (one per drive); the config takes either.
ROOT_KEYS = ("root", "roots")
STAGING_KEYS = ("staging_bytes", "staging_slots", "max_inflight_stores")


def refuse_unknown(raw: Mapping[str, Any]) -> None:
    """A ConfigError naming every unknown key, with the nearest known one where it is a typo."""
    known = set(KEYS) | {"roots"}
    unknown = sorted(set(raw) - known)
    if not unknown:
        return
    hints = []
    for k in unknown:
        near = difflib.get_close_matches(str(k), sorted(known), n=1, cutoff=0.75)
        if near:
            hints.append(f"{k!r}: did you mean {near[0]!r}?")
    raise ConfigError(f"unknown key(s) {unknown}; " + (" ".join(hints) + " " if hints else "")
                      + f"allowed keys are {sorted(known)}")


#: what one entry of `tiers` takes
TIER_KEYS = ("root", "roots", "capacity_bytes", "eviction_policy", "medium", "io_backend", "io_options")


def parse_tiers(raw: dict, rank: int) -> tuple:
    """`tiers`, popped from `raw`: its first entry becomes `raw`'s root and capacity (and its
    eviction_policy, medium, io_backend and io_options, unless given at the top level), the rest
    the lower tiers (TierConfig each, fastest first). Nothing here when `tiers` is not given."""

    if "tiers" not in raw:
        return ()
    tiers = raw.pop("tiers")
    if not isinstance(tiers, (list, tuple)) or not tiers or not all(isinstance(t, Mapping) for t in tiers):
        raise ConfigError(f"tiers={tiers!r}: expected a list of tiers, fastest first, each a mapping such as "
                          "{\"root\": \"/dev/shm/tutti\", \"capacity_bytes\": \"64GiB\"}")
    if len(tiers) > 8:
        raise ConfigError(f"tiers: {len(tiers)} tiers; expected at most 8")
    given = [k for k in ("root", "roots", "capacity_bytes") if k in raw]
    if given:
        raise ConfigError(f"tiers: give the tiers or {given} (the one-tier shorthand), not both; move "
                          f"{given} into the first tier")
    out = []
    for i, t in enumerate(tiers):
        where = f"tiers[{i}]"
        t = dict(t)
        unknown = sorted(set(t) - set(TIER_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; a tier takes {list(TIER_KEYS)}")
        if "capacity_bytes" not in t:
            raise ConfigError(f"{where}.capacity_bytes: missing; give the tier's size, e.g. '64GiB'")
        try:
            roots, templates = parse_roots(t, rank)
            cap = size(f"{where}.capacity_bytes", t.pop("capacity_bytes"))
            pol = KEYS["eviction_policy"].parse(f"{where}.eviction_policy", t.pop("eviction_policy")) \
                if "eviction_policy" in t else None
            med = KEYS["medium"].parse(f"{where}.medium", t.pop("medium")) if "medium" in t else None
            own = {k: KEYS[k].parse(f"{where}.{k}", t.pop(k)) for k in ("io_backend", "io_options") if k in t}
        except ConfigError as exc:
            msg = str(exc)
            raise ConfigError(msg if msg.startswith(where) else f"{where}.{msg}") from None
        if not isinstance(cap, int) or cap <= 0:
            raise ConfigError(f"{where}.capacity_bytes={cap!r}: expected a positive size such as '64GiB'")
        if i == 0:
            raw["roots"], raw["capacity_bytes"] = list(templates), cap
            if pol is not None:
                raw.setdefault("eviction_policy", pol)
            if med is not None:
                raw.setdefault("medium", med)
            for k, v in own.items():
                raw.setdefault(k, v)
            continue
        out.append(TierConfig(roots, templates, cap, pol, med, **own))
    every = [os.path.realpath(r) for r in raw["roots"]] + [os.path.realpath(r) for t in out for r in t.roots]
    if len(set(every)) != len(every):
        raise ConfigError(f"tiers: a directory serves two tiers ({sorted(r for r in set(every) if every.count(r) > 1)}); "
                          "give each tier directories of its own")
    return tuple(out)


def parse_roots(raw: dict, rank: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(roots resolved for `rank`, roots as given) from `root` or `roots`, popped from `raw`."""
    from tutti.engine.config.values import resolve_root

    if "root" in raw and "roots" in raw:
        raise ConfigError("give either 'root' or 'roots', not both")
    roots_v = raw.pop("roots", raw.pop("root", None))
    if roots_v is None:
        raise ConfigError("root: missing; give a directory (or 'roots': a list, one per drive), e.g. "
                          "{\"root\": \"/mnt/nvme/tutti\"}")
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
        raise ConfigError(f"roots={list(roots_v)!r}: a directory is listed twice "
                          f"({sorted({r for r in real if real.count(r) > 1})}); stripes need one directory each "
                          "(one per drive), or give a single 'root'")
    return roots, tuple(roots_v)


def staging_values(raw: dict) -> dict[str, Any]:
    """The staging trio's starting values: all "auto" when none (or only staging_bytes "auto") is
    given; 512 MiB, 64 slots and 48 for stores when any is, so the others fit what was given."""
    given = set(STAGING_KEYS) & set(raw)
    if raw.get("staging_bytes") == "auto" and given == {"staging_bytes"}:
        raw.pop("staging_bytes")
        given = set()
    if not given:
        return dict.fromkeys(STAGING_KEYS, "auto")
    return {"staging_bytes": 512 << 20, "staging_slots": 64, "max_inflight_stores": 48}


def check_combinations(kw: Mapping[str, Any]) -> None:
    """What no single key's parser can see."""
    if kw.get("codec") not in (None, "identity"):
        from tutti.codec import get_codec, is_identity

        if not is_identity(get_codec(kw["codec"])):
            # the paths that copy stored bytes to the device with no host step to decode them
            if kw.get("mapped_loads") is True:
                raise ConfigError(
                    f"mapped_loads=True: refused with codec={kw['codec']!r}: a load from a mapped slab copies the "
                    "stored bytes straight to the device, with no step that decodes them; set mapped_loads to "
                    "\"auto\" or false (loads then read through the file path and decode), or codec to \"identity\"")
            if kw.get("async_launch") == "step":
                raise ConfigError(
                    f"async_launch='step': refused with codec={kw['codec']!r}: the step's thread launches only loads "
                    "from mapped slabs, which copy the stored bytes to the device undecoded; set async_launch to "
                    "\"auto\" or \"thread\" (tutti's loading thread reads and decodes), or codec to \"identity\"")
    if kw.get("share_group") and not (kw.get("secret_file") or kw.get("secret_env")):
        raise ConfigError(
            f"share_group={kw['share_group']!r}: sharing a store with other users needs a secret (secret_file or "
            "secret_env) known to every sharing server, so that no group member can forge KV for another; add one, "
            "or drop share_group")
    if kw.get("verify_checksums") is False and kw.get("writer_id") not in (None, "", "auto"):
        raise ConfigError(
            f"verify_checksums=False: refused with writer_id={kw['writer_id']!r}: another writer may evict and "
            "rewrite a slot between a reader's journal check and its reads, and only the checksum tells the other "
            "prompt's KV apart; keep verify_checksums on where several servers share a root")
