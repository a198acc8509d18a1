"""The `tiers` key (tutti.engine.config.spec.parse_tiers): the first tier becomes the top-level
root and capacity (its eviction policy, medium and IO keys too, unless given there), the rest
lower tiers with what they give of their own; every bad entry is refused naming `tiers[i].key`,
the value and the fix, before any file is touched."""

from __future__ import annotations

import pytest

from tutti.engine.config.settings import ConfigError, EngineConfig


def two(tmp_path, first=None, second=None, **top):
    return {"tiers": [{"root": str(tmp_path / "ram"), "capacity_bytes": "1MiB", **(first or {})},
                      {"root": str(tmp_path / "disk"), "capacity_bytes": "8MiB", **(second or {})}], **top}


def test_the_first_tier_is_the_top_level_and_the_lower_ones_keep_what_they_give(tmp_path):
    cfg = EngineConfig.from_dict(two(tmp_path, first={"io_backend": "uring", "eviction_policy": "lfuda"},
                                     second={"io_backend": "threads", "io_options": {"workers": 2}, "medium": "file"}))
    assert cfg.roots == (str(tmp_path / "ram"),) and cfg.capacity_bytes == 1 << 20
    assert cfg.io_backend == "uring" and cfg.eviction_policy == "lfuda"
    (t,) = cfg.tiers
    assert t.roots == (str(tmp_path / "disk"),) and t.capacity_bytes == 8 << 20
    low = cfg.tier(1)
    assert (low.io_backend, dict(low.io_options), low.eviction_policy, low.capacity_bytes) == \
        ("threads", {"workers": 2}, "lfuda", 8 << 20)  # its own IO, the first tier's eviction policy
    same = EngineConfig.from_dict(two(tmp_path, io_backend="threads", io_options={"workers": 3}))
    assert (same.tier(1).io_backend, dict(same.tier(1).io_options)) == ("threads", {"workers": 3})  # inherited


@pytest.mark.parametrize("second, starts, fix", [
    ({"io_backend": "nope"}, "tiers[1].io_backend='nope'", "'threads', 'uring'"),
    ({"io_options": ["workers"]}, "tiers[1].io_options=", "workers"),
    ({"capacity_bytes": "lots"}, "tiers[1].capacity_bytes='lots'", "64GiB"),
    ({"capacity_bytes": 0}, "tiers[1].capacity_bytes=0", "positive size"),
    ({"speed": "fast"}, "tiers[1]: unknown key(s) ['speed']", "io_backend"),
])
def test_a_bad_tier_entry_is_refused_naming_it(tmp_path, second, starts, fix):
    with pytest.raises(ConfigError) as ei:
        EngineConfig.from_dict(two(tmp_path, second=second))
    msg = str(ei.value)
    assert msg.startswith(starts) and fix in msg, msg
    assert not (tmp_path / "ram").exists() and not (tmp_path / "disk").exists()


def test_tiers_and_the_shorthand_together_and_one_directory_twice_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^tiers: give the tiers or \['root'\]"):
        EngineConfig.from_dict(two(tmp_path, root=str(tmp_path / "x")))
    with pytest.raises(ConfigError, match="a directory serves two tiers"):
        EngineConfig.from_dict({"tiers": [{"root": str(tmp_path / "a"), "capacity_bytes": "1MiB"},
                                          {"root": str(tmp_path / "a"), "capacity_bytes": "2MiB"}]})
    with pytest.raises(ConfigError, match=r"^tiers\[1\]\.capacity_bytes: missing"):
        EngineConfig.from_dict({"tiers": [{"root": str(tmp_path / "a"), "capacity_bytes": "1MiB"},
                                          {"root": str(tmp_path / "b")}]})
