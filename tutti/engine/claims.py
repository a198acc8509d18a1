"""Writer identity found, not configured: replicas from one config on one root.

Why: a deployment starts N identical servers (one manifest, one `kv_transfer_config`) on a
shared root, and a server per GPU cannot be given its own `writer_id` easily. With `writer_id`
left "auto" (the default) a server's worker takes the namespace's writer slot (''), or, when
another live server holds that slot's lock, the first free `auto-<n>` slot, each with a lock
of its own. A restarted server takes back whichever slot's owner is gone, so every chunk on
the root stays a hit: all servers read all writers' chunks.

The scheduler builds its index from its own worker's journal, so it must learn which slot the
worker took. vLLM builds the scheduler in the engine core after the worker has registered its
KV caches; with one worker (TP = PP = 1) both live in that process, and the worker leaves its
choice here under vLLM's engine id. With several workers each rank would choose on its own and
could choose differently, so there "auto" means the namespace's writer slot only (a second
server then needs a `writer_id` of its own, which the error says).
"""

from __future__ import annotations

import threading

AUTO = "auto"
MAX_AUTO_WRITERS = 63  # auto-1 .. auto-63, beside the namespace's own writer ''

_lock = threading.Lock()
_claims: dict[str, str] = {}  # vLLM engine id -> the writer id its worker took


#: Names an "auto" worker looks at, at most: slots whose directory another member of the sharing
#: group owns are passed over without counting (a member who plants `w-auto-N` directories can
#: make a start-up look further, never stop it), up to this many names. Which names, in what order
#: and why: tutti.engine.config.resolve.writer_candidates.
MAX_AUTO_NAMES = 4096


def record(engine_id: str, writer_id: str) -> None:
    with _lock:
        _claims[engine_id] = writer_id


def claimed(engine_id: str) -> str | None:
    """The writer id this process's worker of `engine_id` took, or None."""
    with _lock:
        return _claims.get(engine_id)


def release(engine_id: str) -> None:
    with _lock:
        _claims.pop(engine_id, None)
