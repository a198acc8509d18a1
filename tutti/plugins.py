"""One resolver for the "package.module:attr" form every registry takes (kernel variants, hit
policies, IO backends): import the module, walk the dotted attribute, and say what failed, naming the key."""

from __future__ import annotations

import importlib


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
