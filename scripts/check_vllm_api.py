"""Does TuttiConnectorV1 implement the connector API of the vLLM being imported?

Imports vLLM's `KVConnectorBase_V1` and tutti's connector and checks that every abstract method
is implemented, and that every method tutti defines which the base also defines takes the same
parameters (names, kinds, order; tutti may add trailing ones with defaults or **kwargs).

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


def check() -> dict:
    import vllm
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from tutti.vllm.connector import TuttiConnectorV1

    problems: dict[str, str] = {}
    abstract = sorted(getattr(KVConnectorBase_V1, "__abstractmethods__", ()))
    for name in abstract:
        if name in getattr(TuttiConnectorV1, "__abstractmethods__", ()):
            problems[name] = "abstract in vLLM, not implemented by TuttiConnectorV1"
    checked = []
    for name, ours in vars(TuttiConnectorV1).items():
        base = getattr(KVConnectorBase_V1, name, None)
        if base is None or not callable(ours) or name.startswith("__") or isinstance(ours, (staticmethod, classmethod)):
            if isinstance(ours, (staticmethod, classmethod)) and base is not None:
                why = _compatible(base, getattr(TuttiConnectorV1, name))
                checked.append(name)
                if why:
                    problems[name] = why
            continue
        checked.append(name)
        why = _compatible(base, ours)
        if why:
            problems[name] = why
    try:
        TuttiConnectorV1.__new__(TuttiConnectorV1)  # abc refuses a class with abstract methods left
    except TypeError as exc:
        problems.setdefault("__new__", str(exc))
    return {"vllm": getattr(vllm, "__version__", "?"), "vllm_path": os.path.dirname(vllm.__file__),
            "abstract_methods": abstract, "checked_overrides": sorted(checked), "problems": problems}


if __name__ == "__main__":
    out = check()
    print(json.dumps(out, indent=1))
    sys.exit(1 if out["problems"] else 0)
