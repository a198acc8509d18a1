"""tutti's engine and io log under "tutti.*" and know nothing of vLLM. Under vLLM their lines
must reach the server's log with vLLM's format and level: a warning such as "stores skipped"
or a failed chunk is otherwise lost (vLLM configures only its own "vllm" logger, and a root
handler added by another library swallows Python's last-resort output)."""

from __future__ import annotations

import logging


def route_tutti_logs() -> None:
    """Give the "tutti" logger vLLM's handlers and level, once (idempotent; a user who set up
    "tutti" logging themselves keeps theirs)."""
    src, dst = logging.getLogger("vllm"), logging.getLogger("tutti")
    if dst.handlers or not src.handlers:
        return
    for h in src.handlers:
        dst.addHandler(h)
    dst.setLevel(src.getEffectiveLevel())
    dst.propagate = False
