"""EngineConfig.from_dict and parse_bytes on hostile values: every size finite and bounded, every
error a ValueError naming the key, the value and the fix; roots expanded ('~') and made
absolute (a relative root is logged once)."""

from __future__ import annotations

import logging
import os

import pytest

from tutti.engine.config import settings as config_mod
from tutti.engine.config.settings import EngineConfig, parse_bytes

MAX_BYTES = (1 << 63) - 1  # the largest size accepted

KEY = ""  # the engine names keys plainly; the connector adds vLLM's kv_connector_extra_config
NON_FINITE = ["Infinity", "inf", "-inf", "1e400", "NaN", "nan", float("nan"), float("inf"), float("-inf")]


def base(**kw):
    return {"root": "/mnt/nvme/tutti", "capacity_bytes": "1GiB", **kw}


# ---- sizes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["capacity_bytes", "staging_bytes"])
@pytest.mark.parametrize("value", NON_FINITE, ids=repr)
def test_non_finite_sizes_are_refused_naming_the_key(key, value):
    # pytest.raises(ValueError) also proves it is not an OverflowError (not a ValueError subclass)
    with pytest.raises(ValueError) as ei:
        EngineConfig.from_dict(base(**{key: value}))
    msg = str(ei.value)
    assert msg.startswith(f"{key}=") and repr(value) in msg, msg
    assert "64GiB" in msg  # the fix: what a size looks like


@pytest.mark.parametrize("value", NON_FINITE, ids=repr)
def test_parse_bytes_never_raises_anything_but_a_named_value_error(value):
    with pytest.raises(ValueError, match=r"^--capacity="):
        parse_bytes("--capacity", value)


@pytest.mark.parametrize("value", [2**63, 2**64, float(2**63), "9223372036854775808", "8388608TiB", "1e19",
                                   "1" * 50, "1" * 5000, "9.3e18"], ids=lambda v: repr(v)[:24])
def test_sizes_of_2_63_or_more_are_refused(value):
    with pytest.raises(ValueError, match=r"capacity_bytes=.*too large.*below 2\*\*63"):
        EngineConfig.from_dict(base(capacity_bytes=value))


def test_largest_size_is_accepted_exactly():
    assert parse_bytes("k", "9223372036854775807") == MAX_BYTES
    assert parse_bytes("k", MAX_BYTES) == MAX_BYTES
    assert EngineConfig.from_dict(base(capacity_bytes=MAX_BYTES)).capacity_bytes == MAX_BYTES


@pytest.mark.parametrize("text,want", [("64GiB", 64 << 30), ("512 MiB", 512 << 20), ("1e9", 10**9), ("1E9", 10**9),
                                       ("1.5GiB", 3 << 29), (" 4096 ", 4096), (1e9, 10**9), (4096, 4096)])
def test_ordinary_sizes_still_parse(text, want):
    assert parse_bytes("k", text) == want


@pytest.mark.parametrize("value", [True, 1.5, "lots", "-1", "8EiB", None, [1]], ids=repr)
def test_other_bad_sizes_name_the_key(value):
    with pytest.raises(ValueError, match=r"^capacity_bytes="):
        EngineConfig.from_dict(base(capacity_bytes=value))


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match=r"capacity_bytes=inf"):
        EngineConfig(roots=("/x",), capacity_bytes=float("inf")).validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"capacity_bytes=9223372036854775808"):
        EngineConfig(roots=("/x",), capacity_bytes=2**63).validate()


# ---- staging_bytes against the host's memory ---------------------------------------------------------
def host_memory():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_staging_over_half_the_hosts_memory_is_refused():
    mem = host_memory()
    with pytest.raises(ValueError) as ei:
        EngineConfig.from_dict(base(staging_bytes=mem // 2 + 4096))
    msg = str(ei.value)
    assert f"staging_bytes={mem // 2 + 4096}" in msg
    assert "physical memory" in msg and f"{mem} B" in msg  # how much the host has
    assert f"pass at most {mem // 2}" in msg  # and what to pass
    assert EngineConfig.from_dict(base(staging_bytes=mem // 2)).staging_bytes == mem // 2


def test_staging_bound_follows_sysconf(monkeypatch):
    real = os.sysconf
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": (2 << 30) // 4096}  # a 2 GiB host
    monkeypatch.setattr(os, "sysconf", lambda name: pages.get(name) or real(name))
    with pytest.raises(ValueError, match=r"staging_bytes=2147483648: .*the host has 2\.0 GiB.*pass at most 1073741824"):
        EngineConfig.from_dict(base(staging_bytes="2GiB"))
    assert EngineConfig.from_dict(base(staging_bytes="1GiB")).staging_bytes == 1 << 30
    pages["SC_PHYS_PAGES"] = (512 << 20) // 4096  # a 512 MiB host: 512 MiB of staging by hand is too much
    with pytest.raises(ValueError, match=r"staging_bytes=536870912: .*pass at most 268435456 \(256\.0 MiB\)$"):
        EngineConfig.from_dict(base(staging_slots=64))


# ---- "auto" staging: sized for the geometry and vLLM's step -------------------------------------------
GIB = 1 << 30


def test_auto_staging_holds_two_steps_of_stores():
    """The default: the stores of two steps of prefill (one gathered while the last is written),
    so a store is skipped only when the storage is slower than prefill. 8B geometry: 1 MiB
    segments, 32 MiB chunks; vLLM's 8192-token steps make 32 chunks each."""
    cfg = EngineConfig.from_dict(base())
    assert cfg.staging_auto and cfg.max_inflight_stores == "auto"
    sized = cfg.sized_staging(segment_bytes=1 << 20, chunk_bytes=32 << 20, step_tokens=8192, memory_bytes=128 * GIB)
    assert sized.staging_slot_bytes == 8 << 20
    assert sized.max_inflight_stores * sized.staging_slot_bytes == 64 * (32 << 20)  # 64 chunks: two steps
    assert sized.staging_slots - sized.max_inflight_stores == 16  # loads: four chunks
    assert sized.staging_bytes == (256 + 16) * (8 << 20)
    # a step budget twice as large doubles the stores' room; another geometry keeps whole segments
    assert sized.max_inflight_stores * 2 == cfg.sized_staging(segment_bytes=1 << 20, chunk_bytes=32 << 20,
                                                              step_tokens=16384, memory_bytes=128 * GIB).max_inflight_stores
    odd = cfg.sized_staging(segment_bytes=3 << 12, chunk_bytes=4 * (3 << 12), step_tokens=512, memory_bytes=128 * GIB)
    assert odd.staging_slot_bytes % (3 << 12) == 0 and odd.max_inflight_stores >= 1


def test_auto_staging_is_capped_by_host_memory(caplog):
    cfg = EngineConfig.from_dict(base())
    with caplog.at_level("WARNING", logger="tutti.engine"):
        sized = cfg.sized_staging(segment_bytes=1 << 20, chunk_bytes=32 << 20, step_tokens=8192, memory_bytes=4 * GIB)
    assert sized.staging_bytes <= GIB  # a quarter of the host
    assert "stores of more than" in caplog.text and "staging_bytes" in caplog.text


def test_any_staging_key_sizes_it_by_hand():
    cfg = EngineConfig.from_dict(base(staging_slots=128))
    assert (cfg.staging_bytes, cfg.staging_slots, cfg.max_inflight_stores) == (512 << 20, 128, 48)
    assert not cfg.staging_auto
    assert cfg.sized_staging(segment_bytes=1 << 20, chunk_bytes=32 << 20, step_tokens=8192) is cfg
    assert EngineConfig.from_dict(base(staging_bytes="auto")).staging_auto


# ---- roots -----------------------------------------------------------------------------------
def test_tilde_root_is_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert EngineConfig.from_dict(base(root="~")).roots == (str(tmp_path),)
    assert EngineConfig.from_dict(base(root="~/kv")).roots == (str(tmp_path / "kv"),)
    cfg = EngineConfig.from_dict({"roots": ["~/kv-{rank}", "/mnt/b/{rank}"], "capacity_bytes": "1GiB"}, rank=3)
    assert cfg.roots == (str(tmp_path / "kv-3"), "/mnt/b/3")
    assert not (tmp_path / "~").exists()


def test_relative_root_is_made_absolute_and_logged_once(monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config_mod, "_logged_roots", set(), raising=False)
    with caplog.at_level(logging.INFO, logger="tutti.engine"):
        for rank in (0, 0, 0):
            cfg = EngineConfig.from_dict(base(root="kv/r{rank}"), rank=rank)
            assert cfg.roots == (str(tmp_path / "kv" / "r0"),)
        assert EngineConfig.from_dict(base(root="kv/r{rank}"), rank=1).roots == (str(tmp_path / "kv" / "r1"),)
        assert EngineConfig.from_dict(base(root="./a/../b")).roots == (str(tmp_path / "b"),)
    recs = [r for r in caplog.records if r.name == "tutti.engine"]
    assert len(recs) == 3, [r.getMessage() for r in recs]  # once per resolved root, not per call
    msg = recs[0].getMessage()
    assert recs[0].levelno == logging.INFO
    assert "relative" in msg and str(tmp_path) in msg and str(tmp_path / "kv" / "r0") in msg
    assert "'kv/r{rank}'" in msg


def test_absolute_root_is_kept_and_not_logged(caplog):
    with caplog.at_level(logging.INFO, logger="tutti.engine"):
        assert EngineConfig.from_dict(base(root="/mnt/nvme/tutti/{rank}"), rank=2).roots == ("/mnt/nvme/tutti/2",)
    assert not [r for r in caplog.records if r.name == "tutti.engine"]


# ---- sharing a store between users ---------------------------------------------------------------
def test_share_group_needs_a_secret():
    with pytest.raises(ValueError, match=r"share_group=.*needs a secret \(secret_file or secret_env\)"):
        EngineConfig.from_dict(base(share_group=os.getegid()))


def test_share_group_must_exist_and_hold_this_process():
    with pytest.raises(ValueError, match=r"share_group='no-such-group-tutti': no such group on this host"):
        EngineConfig.from_dict(base(share_group="no-such-group-tutti", secret_env="X"))
    other = max(os.getgroups() + [os.getegid()]) + 12345
    with pytest.raises(ValueError, match=rf"share_group={other}: this process .* is not a member of group {other}"):
        EngineConfig.from_dict(base(share_group=other, secret_env="X"))
    for bad in (True, "", 1.5, ["g"]):
        with pytest.raises(ValueError, match="share_group=.*expected the name"):
            EngineConfig.from_dict(base(share_group=bad, secret_env="X"))


def test_share_group_gives_a_shared_access():
    import grp

    from tutti.engine.build import store_access
    from tutti.io.safefs import PRIVATE, Access

    cfg = EngineConfig.from_dict(base(share_group=grp.getgrgid(os.getegid()).gr_name, secret_env="X"))
    assert store_access(cfg) == Access(os.getegid()) and store_access(cfg).dir_mode == 0o2770
    assert store_access(EngineConfig.from_dict(base())) is PRIVATE


def test_checksums_off_is_refused_where_writers_share_a_root():
    """Another writer's eviction between a reader's journal check and its reads would serve
    another prompt's KV that only the checksum tells apart (hardening round two, item 7)."""
    with pytest.raises(ValueError, match=r"verify_checksums=False: refused with writer_id='a'"):
        EngineConfig.from_dict(base(verify_checksums=False, writer_id="a"))
    assert not EngineConfig.from_dict(base(verify_checksums=False)).verify_checksums


def test_context_parallelism_is_refused_by_name():
    """Each context-parallel rank holds another shard of the tokens (item 10): refused at start."""
    from types import SimpleNamespace

    from tutti.vllm import translate

    translate.check_context_parallel(SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1))
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        with pytest.raises(ValueError, match=f"{name}=2: context parallelism is not supported"):
            translate.check_context_parallel(SimpleNamespace(**{name: 2}))


def test_round_two_small_config_items(monkeypatch):
    """Round two, item 9: a list as io_backend and a NUL in share_group are refused naming the
    key; two long host names that share their first 48 characters get different writer ids."""
    import socket

    from tutti.engine.config.settings import ConfigError, EngineConfig, resolve_writer_id

    base = {"root": "/tmp/x", "capacity_bytes": "1GiB"}
    with pytest.raises(ConfigError, match=r"io_backend=\['uring'\]: expected a name"):
        EngineConfig.from_dict({**base, "io_backend": ["uring"]})
    with pytest.raises(ConfigError, match="share_group='a\\\\x00b': a group name has no NUL"):
        EngineConfig.from_dict({**base, "share_group": "a\x00b", "secret_env": "X"})
    ids = set()
    for tail in ("node-a", "node-b"):
        monkeypatch.setattr(socket, "gethostname", lambda tail=tail: "x" * 50 + tail)
        ids.add(resolve_writer_id("{host}"))
    assert len(ids) == 2 and all(len(i) <= 64 for i in ids)


def test_a_nul_in_a_root_and_a_root_listed_twice_are_refused(tmp_path):
    """Left from round one: a NUL byte in a root, and the same directory as two stripes (their
    slab files would collide), are refused naming the key."""
    from tutti.engine.config.settings import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="a path has no NUL byte"):
        EngineConfig.from_dict({"root": "/tmp/a\x00b", "capacity_bytes": "1GiB"})
    with pytest.raises(ConfigError, match="a directory is listed twice"):
        EngineConfig.from_dict({"roots": [str(tmp_path), str(tmp_path) + "/"], "capacity_bytes": "1GiB"})
    assert len(EngineConfig.from_dict({"roots": [str(tmp_path / "a"), str(tmp_path / "b")],
                                       "capacity_bytes": "1GiB"}).roots) == 2


def test_one_parse_serves_every_rank(tmp_path):
    """`{rank}` roots: a config parsed once gives each rank's roots as a fresh parse would
    (EngineConfig.for_rank / .of, what build_planner and build_worker use)."""
    raw = {"roots": [str(tmp_path / "a-{rank}"), str(tmp_path / "b")], "capacity_bytes": "1GiB", "writer_id": "w1"}
    cfg = EngineConfig.from_dict(raw, rank=0)
    for rank in (0, 1, 5):
        assert cfg.for_rank(rank) == EngineConfig.from_dict(raw, rank=rank)
        assert EngineConfig.of(cfg, rank=rank) == EngineConfig.of(raw, rank=rank)
    assert cfg.for_rank(1).roots == (str(tmp_path / "a-1"), str(tmp_path / "b"))
    plain = EngineConfig.from_dict({"root": str(tmp_path), "capacity_bytes": "1GiB"})
    assert plain.for_rank(7) is plain


def test_write_window_is_a_size_or_off():
    assert EngineConfig.from_dict(base()).write_window_bytes == "auto"
    assert EngineConfig.from_dict(base(write_window_bytes="16MiB")).write_window_bytes == 16 << 20
    assert EngineConfig.from_dict(base(write_window_bytes="off")).write_window_bytes is None
    for bad in ("1KiB", "lots", -5, True):
        with pytest.raises(ValueError, match=r"write_window_bytes=.*expected a size of at least 4KiB.*\"auto\".*\"off\""):
            EngineConfig.from_dict(base(write_window_bytes=bad))


def test_reads_first_is_auto_or_a_bool():
    assert EngineConfig.from_dict(base()).reads_first == "auto"
    for v in (True, False, "auto"):
        assert EngineConfig.from_dict(base(reads_first=v)).reads_first == v
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=r"reads_first=.*expected \"auto\" \(wherever write_window_bytes"):
            EngineConfig.from_dict(base(reads_first=bad))


def test_gil_switch_interval_is_off_or_seconds():
    assert EngineConfig.from_dict(base()).gil_switch_interval_s == "off"
    for v in ("off", 0.0005, 0.1):
        assert EngineConfig.from_dict(base(gil_switch_interval_s=v)).gil_switch_interval_s == v
    for bad in (0, -1, 0.5, "fast", "auto", True):
        with pytest.raises(ValueError, match=r"gil_switch_interval_s=.*expected \"off\".*seconds in \(0, 0.1\]"):
            EngineConfig.from_dict(base(gil_switch_interval_s=bad))


def test_mapped_store_copy_is_one_of_its_names():
    assert EngineConfig.from_dict(base()).mapped_store_copy == "auto"
    for v in ("auto", "dma", "dma_chunk", "host"):
        assert EngineConfig.from_dict(base(mapped_store_copy=v)).mapped_store_copy == v
    for bad in ("DMA", "", True, None, ["host"]):
        with pytest.raises(ValueError, match=r"mapped_store_copy=.*expected one of \['auto', 'dma', 'dma_chunk', 'host'\]"):
            EngineConfig.from_dict(base(mapped_store_copy=bad))


def test_async_launch_is_one_of_its_names():
    assert EngineConfig.from_dict(base()).async_launch == "auto"
    for v in ("auto", "step", "thread"):
        assert EngineConfig.from_dict(base(async_launch=v)).async_launch == v
    for bad in ("Thread", "", False, None, ["step"]):
        with pytest.raises(ValueError, match=r"async_launch=.*expected one of \['auto', 'step', 'thread'\]"):
            EngineConfig.from_dict(base(async_launch=bad))


def test_whole_loads_is_chunk_or_layer():
    assert EngineConfig.from_dict(base()).whole_loads == "chunk"
    assert EngineConfig.from_dict(base(whole_loads="layer")).whole_loads == "layer"
    for bad in ("auto", "Layer", None):
        with pytest.raises(ValueError, match=r"whole_loads=.*expected one of \['chunk', 'layer'\]"):
            EngineConfig.from_dict(base(whole_loads=bad))


def test_idle_load_wait_is_seconds_auto_or_off():
    assert EngineConfig.from_dict(base()).idle_load_wait_s == "auto"  # the default: resolved by the worker
    assert EngineConfig.from_dict(base(idle_load_wait_s="auto")).idle_load_wait_s == "auto"
    assert EngineConfig.from_dict(base(idle_load_wait_s=0.002)).idle_load_wait_s == 0.002
    assert EngineConfig.from_dict(base(idle_load_wait_s="off")).idle_load_wait_s == 0
    assert EngineConfig.from_dict(base(idle_load_wait_s=0.01)).idle_load_wait_s == 0.01
    for bad in (-1, 0.5, "soon", True, None):
        with pytest.raises(ValueError, match=r"idle_load_wait_s=.*expected seconds in \[0, 0.05\]"):
            EngineConfig.from_dict(base(idle_load_wait_s=bad))
