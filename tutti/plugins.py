"""One resolver for the "package.module:attr" form every registry takes (kernel variants, IO
backends, the hit, eviction and admission policies): import the module, walk the dotted attribute,
and say what failed, naming the key; and the one registry the policy keys and the medium share."""

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


class PolicyRegistry:
    """The registry behind one pluggable key (hit_policy, eviction_policy, store_admission, medium):
    built-in and registered names, "package.module:attr", and the check that what comes back implements
    the policy's methods. `fresh`: every lookup makes a new object from a class or factory (a
    policy with state of its own per index); otherwise an instance is also taken as it is."""

    def __init__(self, key: str, register_name: str, builtins: Mapping[str, Any], methods: tuple[str, ...], *,
                 fresh: bool = False, doc: str = "") -> None:
        self.key, self.register_name, self.methods, self.fresh = key, register_name, methods, fresh
        self.doc = doc  # the module that says what a policy implements
        self._entries: dict[str, Any] = dict(builtins)

    def register(self, name: str, factory: Any) -> None:
        """Make `name` choosable as the key's value (a class or a no-argument factory)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.register_name}: name={name!r}: expected a non-empty name without ':'")
        self._entries[name] = factory

    def names(self) -> list[str]:
        return sorted(self._entries)

    def get(self, spec: Any, *args: Any) -> Any:
        """The policy `spec` names: a registered name or "package.module:attr" (a class, a factory
        or, unless `fresh`, an instance); unless `fresh`, a policy object passes through. `args`
        go to the class or factory (a medium takes the IO backend's open)."""
        if not self.fresh and self._implements(spec):
            return spec
        obj, registered = resolve_name(spec, self.key, self._entries)
        if not registered and not self.fresh and self._implements(obj):
            pol = obj
        elif callable(obj):
            pol = obj(*args)
        else:
            raise ValueError(f"{self.key}={spec!r}: not a class or factory of a policy")
        missing = [m for m in self.methods if not callable(getattr(pol, m, None))]
        if missing:
            raise ValueError(f"{self.key}={spec!r}: its policy has no {', '.join(missing)} method(s) "
                             f"({self.doc} says what a policy implements)")
        return pol

    def _implements(self, obj: Any) -> bool:
        return not isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in self.methods)
