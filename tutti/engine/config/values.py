"""The value parsers of the engine's configuration: sizes, roots, writer ids, groups, endpoints.
Each refuses a bad value with a ConfigError that names the key, the value and what is expected;
the table of keys (spec.py) says which parser each key uses."""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("tutti.engine")

#: Every size is a signed 64-bit byte count (file offsets, the journal's fields): below 2**63.
MAX_BYTES = (1 << 63) - 1
_SIZE_HINT = "expected a byte count such as 1073741824 or '64GiB'"

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}


@dataclass(frozen=True)
class TierConfig:
    """One tier below the first (the `tiers` key): its roots, capacity, and eviction policy,
    medium, IO backend and IO options where it has its own (None: the first tier's)."""

    roots: tuple[str, ...]
    root_templates: tuple[str, ...]
    capacity_bytes: int
    eviction_policy: str | None = None
    medium: str | None = None
    io_backend: str | None = None
    io_options: dict | None = None


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


def human(n: int) -> str:
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



def size_or_keyword(name: str, value: Any, minimum: int, expected: str) -> Any:
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
