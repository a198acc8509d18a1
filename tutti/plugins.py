"""One resolver for the "package.module:attr" form every registry takes (kernel variants, hit
policies, IO backends): import the module, walk the dotted attribute, and say what failed, naming the key."""

from __future__ import annotations

import importlib
from typing import Any, Mapping


def import_spec(spec: str, key: str) -> object:
    """The object `spec` ("package.module:attr.sub") names; ValueError naming `key` otherwise."""
    mod_name, _, attr = spec.partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"{key}={spec!r}: cannot import module {mod_name!r} ({exc})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}={spec!r}: module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def resolve_name(spec: Any, key: str, registry: Mapping[str, Any]) -> tuple[Any, bool]:
    """(what `spec` names, whether it was registered): a name of `registry` gives its entry,
    "package.module:attr" the object it names; anything else is refused naming `key` and the
    names there are. Each registry then makes its object (an instance, a factory's product)."""
    names = sorted(registry)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key}={spec!r}: expected one of {names} or 'package.module:attr'")
    if spec in registry:
        return registry[spec], True
    if ":" in spec:
        return import_spec(spec, key), False
    raise ValueError(f"{key}={spec!r}: unknown; expected one of {names} or 'package.module:attr'")
