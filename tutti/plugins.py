"""One registry behind every pluggable kind: kernel variants, IO backends, the storage medium and
the hit, eviction and admission policies. Each kind is one `Registry`: its built-in names (an
object, or a "package.module:attr" string imported on first use so a heavy module loads only when
chosen), the names registered in this process, "package.module:attr" (resolved by `import_spec`,
which says what failed, naming the key), the check that what comes back implements the kind's
methods, and the kind's own "auto" rule where it has one. `kinds()` lists them all.

A leaf module: it imports nothing of tutti at import time (`kinds()` imports each kind's home)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

#: The module that declares each kind's registry, by the configuration key that names it.
HOMES: dict[str, str] = {
    "kernel_variant": "tutti.kernels.registry",
    "io_backend": "tutti.io.queue",
    "medium": "tutti.store.medium",
    "hit_policy": "tutti.engine.sched.hit_policy",
    "eviction_policy": "tutti.engine.sched.eviction",
    "store_admission": "tutti.engine.sched.admission",
    "codec": "tutti.codec",
}

_KINDS: dict[str, "Registry"] = {}


def kinds() -> dict[str, "Registry"]:
    """{kind: its registry} for every pluggable kind (imports each kind's home module; a registry
    made elsewhere is listed too once its module is imported)."""
    for module in HOMES.values():
        importlib.import_module(module)
    return {**{k: _KINDS[k] for k in HOMES if k in _KINDS}, **dict(sorted(_KINDS.items()))}


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
    names there are. (A plain mapping's form of `Registry.resolve`.)"""
    names = sorted(registry)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key}={spec!r}: expected one of {names} or 'package.module:attr'")
    if spec in registry:
        return registry[spec], True
    if ":" in spec:
        return import_spec(spec, key), False
    raise ValueError(f"{key}={spec!r}: unknown; expected one of {names} or 'package.module:attr'")


Make = Callable[..., Any]  # (resolved object, spec, registered, *args, **kwargs) -> what get returns


class Registry:
    """The registry behind one pluggable kind, named in messages by `key` (the config key's name)
    and listed by `kinds()` under `kind` (default: `key`).

    - `builtins`: {name: object or "package.module:attr"}; a string is imported on first use.
      `optional`: a built-in whose module cannot be imported is absent rather than an error.
    - `register(name, obj)` (published as `register_name`) makes a name choosable; it takes
      precedence over a built-in of the same name.
    - `methods`: what an object of the kind implements; `check` refuses one that lacks any,
      naming the key and `doc` (where the contract is written down).
    - `auto`: the kind's "auto" rule, a callable `get("auto", *args, **kwargs)` returns the
      result of (the name "auto" is then listed first in `choices()`).
    - `make`: how the kind turns what a name resolves to into what `get` returns, as
      `make(obj, spec, registered, *args, **kwargs)`; by default, the policies' rule: a class or
      factory is called with the arguments, an instance taken as it is (unless `fresh`: every
      lookup makes a new object), then `check`ed. Unless `fresh`, an object that implements the
      methods passes `get` through.
    - `names()` lists the built-ins first (in their order) when `builtins_first`, else all sorted.
    - Messages: `typed` refuses a spec that is not a non-empty string as malformed (otherwise as an
      unknown name); `noun` and `note` complete the unknown name's message."""

    def __init__(self, key: str, register_name: str, builtins: Mapping[str, Any] | None = None,
                 methods: tuple[str, ...] = (), *, fresh: bool = False, doc: str = "", kind: str | None = None,
                 auto: Callable[..., Any] | None = None, make: Make | None = None, optional: bool = False,
                 builtins_first: bool = False, typed: bool = True, noun: str = "", note: str = "") -> None:
        self.key, self.register_name, self.methods, self.fresh = key, register_name, tuple(methods), fresh
        self.doc = doc  # the module that says what an object of the kind implements
        self.kind = kind or key
        self.auto, self.make, self.optional = auto, make, optional
        self.builtins_first, self.typed, self.noun, self.note = builtins_first, typed, noun, note
        self._builtins: dict[str, Any] = dict(builtins or {})
        self._loaded: dict[str, Any] = {}  # built-ins given as strings, once imported
        self.registered: dict[str, Any] = {}  # names registered in this process
        _KINDS[self.kind] = self

    def __repr__(self) -> str:
        return f"Registry({self.kind!r})"  # not choices(): that may import optional built-ins

    # -- names ---------------------------------------------------------------------------------
    def register(self, name: str, factory: Any) -> None:
        """Make `name` choosable as the key's value (a class or a factory, or what the kind takes)."""
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"{self.register_name}: name={name!r}: expected a non-empty name without ':'")
        self.registered[name] = factory

    def has(self, name: str) -> bool:
        """Whether `name` is registered or a built-in (an optional one: whose module imports)."""
        return self._entry(name)[1]

    def entry(self, name: str) -> Any:
        """What `name` is registered or built in as (a built-in string imported); KeyError if none."""
        obj, found = self._entry(name)
        if not found:
            raise KeyError(name)
        return obj

    def names(self) -> list[str]:
        """Built-in and registered names (not the "auto" rule): sorted, or the built-ins first."""
        builtins = [n for n in self._builtins if not self.optional or self.has(n)]
        if self.builtins_first:
            return builtins + sorted(n for n in self.registered if n not in self._builtins)
        return sorted({*builtins, *self.registered})

    def choices(self) -> list[str]:
        """What the key takes by name: "auto" where the kind has the rule, then `names()`."""
        return ["auto", *self.names()] if self.auto is not None else self.names()

    # -- lookup --------------------------------------------------------------------------------
    def resolve(self, spec: Any) -> tuple[Any, bool]:
        """(what `spec` names, whether by name): a registered or built-in name gives its entry,
        "package.module:attr" the object it names; anything else is refused naming the key and the
        names there are. (Not the "auto" rule: `get` applies it.)"""
        if isinstance(spec, str) and spec:
            obj, found = self._entry(spec)
            if found:
                return obj, True
            if ":" in spec:
                return import_spec(spec, self.key), False
        elif self.typed:
            raise ValueError(f"{self.key}={spec!r}: expected one of {self.choices()} or 'package.module:attr'"
                             + self._note())
        noun = f" {self.noun}" if self.noun else ""
        raise ValueError(f"{self.key}={spec!r}: unknown{noun}; expected one of {self.choices()} or "
                         f"'package.module:attr'" + self._note())

    def get(self, spec: Any, /, *args: Any, **kwargs: Any) -> Any:
        """What `spec` names, made: "auto" by the kind's rule; a registered or built-in name or
        "package.module:attr" by `make` (a class or factory gets `args` and `kwargs`: a medium
        takes the IO backend's open, a queue its options); unless `fresh`, an object that
        implements the methods passes through."""
        if self.auto is not None and isinstance(spec, str) and spec == "auto":
            return self.auto(*args, **kwargs)
        if not self.fresh and self._implements(spec):
            return spec
        obj, registered = self.resolve(spec)
        if self.make is not None:
            return self.make(obj, spec, registered, *args, **kwargs)
        if not registered and not self.fresh and self._implements(obj):
            made = obj
        elif callable(obj):
            made = obj(*args, **kwargs)
        else:
            raise ValueError(f"{self.key}={spec!r}: not a class or factory of a policy")
        self.check(made, spec)
        return made

    def check(self, obj: Any, spec: Any) -> None:
        """ValueError naming the key and `spec` when `obj` lacks one of the kind's methods."""
        missing = [m for m in self.methods if not callable(getattr(obj, m, None))]
        if missing:
            raise ValueError(f"{self.key}={spec!r}: its policy has no {', '.join(missing)} method(s) "
                             f"({self.doc} says what a policy implements)")

    # -- internals -----------------------------------------------------------------------------
    def _entry(self, name: str) -> tuple[Any, bool]:
        if name in self.registered:
            return self.registered[name], True
        if name not in self._builtins:
            return None, False
        obj = self._builtins[name]
        if not isinstance(obj, str):
            return obj, True
        if name not in self._loaded:
            try:
                self._loaded[name] = import_spec(obj, self.key)
            except ValueError:
                if self.optional:
                    return None, False
                raise
        return self._loaded[name], True

    def _implements(self, obj: Any) -> bool:
        return bool(self.methods) and not isinstance(obj, type) and all(callable(getattr(obj, m, None))
                                                                        for m in self.methods)

    def _note(self) -> str:
        return f" ({self.note})" if self.note else ""


#: The name the policies' registries were first made under: the same class.
PolicyRegistry = Registry
