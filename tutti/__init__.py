"""tutti: a layer-wise KV cache on NVMe and file storage for vLLM, in pure Python.

The public face: every `register_*` function (each makes a name choosable as its key's value;
`tutti.plugins.kinds()` lists the registries behind them) and the main types. They are imported
on first use (PEP 562), so `import tutti` stays cheap: no torch, no triton, no vLLM."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: name -> the module that defines it, imported when the name is first used.
_LAZY: dict[str, str] = {
    # register_* (one per pluggable kind)
    "register_variant": "tutti.kernels.registry",
    "register_backend": "tutti.io.queue",
    "register_medium": "tutti.store.medium",
    "register_policy": "tutti.engine.sched.hit_policy",
    "register_eviction": "tutti.engine.sched.eviction",
    "register_admission": "tutti.engine.sched.admission",
    "register_codec": "tutti.codec",
    # the registry itself
    "Registry": "tutti.plugins",
    "kinds": "tutti.plugins",
    # main types
    "EngineConfig": "tutti.engine.config.settings",
    "KernelVariant": "tutti.kernels.registry",
    "IOQueue": "tutti.io.queue",
    "IORequest": "tutti.io.queue",
    "QueueCaps": "tutti.io.queue",
    "Medium": "tutti.store.medium",
    "HitPolicy": "tutti.engine.sched.hit_policy",
    "HitQuery": "tutti.engine.sched.hit_policy",
    "Rates": "tutti.engine.sched.hit_policy",
    "EvictionPolicy": "tutti.engine.sched.eviction",
    "AdmissionPolicy": "tutti.engine.sched.admission",
    "StoreCandidate": "tutti.engine.sched.admission",
    "SegmentCodec": "tutti.codec",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tutti' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
