"""Does TuttiConnectorV1 implement the connector API of the vLLM being imported?

Imports vLLM's `KVConnectorBase_V1`, `SupportsHMA` and the OffloadingConnector's
`SecondaryTierManager`, and tutti's classes built on them (TuttiConnectorV1,
TuttiHybridConnectorV1, TuttiTier), and checks that every abstract method is implemented and that
every method tutti defines which the base also defines takes the same parameters (names, kinds,
order; tutti may add trailing ones with defaults or **kwargs).

    python3 scripts/check_vllm_api.py                     # the vLLM installed here
    PYTHONPATH=/tmp/v33/site python3 scripts/check_vllm_api.py   # another vLLM's Python code first

scripts/check_vllm_033.sh fetches vLLM 0.33's wheel, extracts its Python code (no dependencies
installed: the ones here are used) and runs this against it. Exit status 1 on a mismatch.
"""

from __future__ import annotations

import inspect
import json
import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _params(fn) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]


def _compatible(base_fn, ours_fn) -> str | None:
    """None when `ours_fn` can stand in for `base_fn`, else what differs."""
    base, ours = inspect.signature(base_fn), inspect.signature(ours_fn)
    bp = [p for p in base.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    op = list(ours.parameters.values())
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in op)
    takes_args = any(p.kind == p.VAR_POSITIONAL for p in op)
    named = {p.name: p for p in op}
    for i, b in enumerate(bp):
        o = named.get(b.name)
        if o is None:
            if b.kind == b.KEYWORD_ONLY and takes_kwargs:
                continue
            if b.kind in (b.POSITIONAL_ONLY, b.POSITIONAL_OR_KEYWORD) and takes_args:
                continue
            return f"parameter {b.name!r} ({b.kind.name}) is missing"
        if b.kind in (b.POSITIONAL_ONLY, b.POSITIONAL_OR_KEYWORD):
            if op.index(o) != i:
                return f"parameter {b.name!r} is at position {op.index(o)}, vLLM passes it at {i}"
            if o.kind not in (o.POSITIONAL_ONLY, o.POSITIONAL_OR_KEYWORD):
                return f"parameter {b.name!r} is {o.kind.name}, vLLM passes it positionally"
    base_names = {b.name for b in bp}
    for o in op:
        if o.name not in base_names and o.kind not in (o.VAR_POSITIONAL, o.VAR_KEYWORD) and o.default is o.empty:
            return f"parameter {o.name!r} is required but vLLM never passes it"
    if any(b.kind == b.VAR_KEYWORD for b in base.parameters.values()) and not takes_kwargs:
        return "vLLM's method takes **kwargs (passes more keywords); ours must too"
    return None


def check_class(ours: type, base: type) -> tuple[list[str], list[str], dict[str, str]]:
    """(base's abstract methods, overrides checked, problems) of `ours` against `base`."""
    problems: dict[str, str] = {}
    abstract = sorted(getattr(base, "__abstractmethods__", ()))
    for name in abstract:
        if name in getattr(ours, "__abstractmethods__", ()) or not callable(getattr(ours, name, None)):
            problems[name] = f"abstract in vLLM's {base.__name__}, not implemented by {ours.__name__}"
    checked = []
    for klass in ours.__mro__:
        if klass is base or not klass.__module__.startswith("tutti"):
            continue
        for name, fn in vars(klass).items():
            theirs = getattr(base, name, None)
            if name == "__init__" and theirs is object.__init__:
                continue  # the base takes no constructor arguments of its own
            if theirs is None or not callable(fn) and not isinstance(fn, (staticmethod, classmethod)) \
                    or (name.startswith("__") and name != "__init__") or name in checked:
                continue
            checked.append(name)
            why = _compatible(theirs, getattr(ours, name) if isinstance(fn, (staticmethod, classmethod)) else fn)
            if why:
                problems[name] = why
    if getattr(ours, "__abstractmethods__", None):
        problems.setdefault("__abstractmethods__", f"{ours.__name__} leaves {sorted(ours.__abstractmethods__)} abstract")
    return abstract, sorted(checked), problems


def check() -> dict:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as kvbase

    from tutti.vllm.connector import TuttiConnectorV1, TuttiHybridConnectorV1

    pairs = [(TuttiConnectorV1, kvbase.KVConnectorBase_V1)]
    if hasattr(kvbase, "SupportsHMA"):
        pairs.append((TuttiHybridConnectorV1, kvbase.SupportsHMA))
    try:
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

        from tutti.vllm.tier import TuttiTier

        pairs.append((TuttiTier, SecondaryTierManager))
    except ImportError:  # a vLLM without tiered offloading
        pass
    out = {"vllm": getattr(vllm, "__version__", "?"), "vllm_path": os.path.dirname(vllm.__file__), "classes": {},
           "problems": {}}
    for ours, base in pairs:
        abstract, checked, problems = check_class(ours, base)
        out["classes"][f"{ours.__name__} vs {base.__name__}"] = {"abstract_methods": abstract, "checked_overrides": checked}
        out["problems"].update({f"{ours.__name__}.{k}": v for k, v in problems.items()})
    first = out["classes"][f"TuttiConnectorV1 vs KVConnectorBase_V1"]
    out["abstract_methods"], out["checked_overrides"] = first["abstract_methods"], first["checked_overrides"]
    return out


if __name__ == "__main__":
    out = check()
    print(json.dumps(out, indent=1))
    sys.exit(1 if out["problems"] else 0)
