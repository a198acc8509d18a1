"""Named gather/scatter implementations, so a researcher can drop in a kernel by name.

Register with one decorator (on a class with gather/scatter, or on a function returning a
KernelVariant), or point at ``"package.module:attr"``; then check it with
``tutti.kernels.check_variant`` and select it by name in the engine's config.

The contract a variant implements (both functions, same arguments)::

    gather(caches, layout, block_ids, out, *, kernel_blocks_per_block=1, id_range=None, **tuning)
    scatter(caches, layout, block_ids, src, *, kernel_blocks_per_block=1, id_range=None, **tuning)

- ``caches``: a list of tensors as vLLM registered them (one per layer; a tensor may hold several
  layers, ``layout.num_layers``); ``layout``: their ``PagedLayout`` (roles, strides in bytes).
- ``block_ids``: int tensor ``(N, M)`` on the caches' device: chunk n is manager blocks
  ``block_ids[n]``, each covering ``kernel_blocks_per_block`` kernel blocks.
- ``out`` / ``src``: uint8 ``(L, N, S)`` segments, L = every layer of ``caches`` in order (the
  engine passes ONE layer per call when it loads layer by layer, and ALL layers at once when it
  gathers a step's stores or loads a whole step; strides may be chunk-major), S a segment's
  bytes: the chunk's tokens in ``[token, head, content]`` order, zero padding after (gather
  writes it) to a 4 KiB multiple (``tutti.format``).
- ``id_range``: ``(min, max)`` of ``block_ids`` known on the host; take it (the engine passes
  it) so the launcher never reads a device tensor back.
Start from ``tutti.kernels.check_args`` (validates everything above from host values, naming
the argument and the fix, and returns a ``CopyPlan``), ``layer_byte_views`` and
``kernel_block_ids`` (the torch reference is built from them).

Where it runs: Triton kernels need ``TRITON_INTERPRET=1`` on a machine without a GPU (set it
before importing triton). A name registered in a notebook exists in that process only: a
server (``kernel_variant`` in its config) needs ``"package.module:attr"``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from tutti.plugins import Registry


@dataclass(frozen=True)
class KernelVariant:
    name: str
    gather: Callable
    scatter: Callable
    description: str = ""


def _first_device(caches) -> torch.device:
    if isinstance(caches, torch.Tensor):
        return caches.device
    for c in caches:
        if isinstance(c, torch.Tensor):
            return c.device
    return torch.device("cpu")


def _auto_variant() -> KernelVariant:
    """Triton on CUDA tensors; torch indexing on CPU, where the Triton interpreter is slow."""

    def pick(caches) -> KernelVariant:
        return get_variant("triton" if _first_device(caches).type == "cuda" else "torch")

    def gather(caches, layout, block_ids, out, **kw):
        return pick(caches).gather(caches, layout, block_ids, out, **kw)

    def scatter(caches, layout, block_ids, src, **kw):
        return pick(caches).scatter(caches, layout, block_ids, src, **kw)

    return KernelVariant("auto", gather, scatter, "triton on CUDA tensors, torch on CPU")


def _torch_variant() -> KernelVariant:
    from . import reference

    return KernelVariant("torch", reference.gather, reference.scatter, "plain torch indexing (reference)")


def _triton_variant() -> KernelVariant:
    from . import triton_kernels  # imports triton: only when chosen

    return KernelVariant("triton", triton_kernels.gather, triton_kernels.scatter, "one Triton launch per wave, all layers")


def _as_variant(obj: Any, name: str) -> KernelVariant:
    """Turn a KernelVariant, a class/object with gather+scatter, or a factory into a KernelVariant."""
    if isinstance(obj, KernelVariant):
        return obj if obj.name == name else replace(obj, name=name)
    if inspect.isclass(obj):
        obj = obj()
    elif callable(obj) and not (hasattr(obj, "gather") and hasattr(obj, "scatter")):
        made = obj()
        if not isinstance(made, KernelVariant):
            raise ValueError(f"variant {name!r}: the factory {obj!r} returned {type(made).__name__}; expected a KernelVariant")
        return made if made.name == name else replace(made, name=name)
    g, s = getattr(obj, "gather", None), getattr(obj, "scatter", None)
    if not callable(g) or not callable(s):
        raise ValueError(f"variant {name!r}: {obj!r} has no callable gather and scatter; expected a KernelVariant, a class with gather/scatter, or a function returning a KernelVariant")
    desc = getattr(obj, "description", "") or (inspect.getdoc(type(obj)) or "").split("\n")[0]
    return KernelVariant(name, g, s, desc)


#: The kernel variants' share of the one registry (tutti.plugins): built-ins "torch" and
#: "triton" (imported when first chosen), "auto" by its rule, then the registered names.
_VARIANTS = Registry("variant", "register_variant", {"torch": _torch_variant, "triton": _triton_variant},
                     ("gather", "scatter"), kind="kernel_variant", auto=_auto_variant,
                     make=lambda obj, name, registered: _as_variant(obj, name), builtins_first=True, typed=False,
                     doc="tutti.kernels.registry")
_REGISTRY = _VARIANTS.registered  # the registered variants, by name


def register_variant(name: str, *, gather: Optional[Callable] = None, scatter: Optional[Callable] = None, description: str = ""):
    """Register ``gather``/``scatter`` under ``name``; without them, return a decorator.

    ``@register_variant("mine")`` works on a class (instantiated without arguments, its
    ``gather``/``scatter`` used) or on a function returning a KernelVariant; the decorated
    object is returned unchanged.
    """
    if not isinstance(name, str) or not name or ":" in name or name in ("torch", "triton", "auto"):
        raise ValueError(f"name={name!r}: expected a non-empty name without ':' other than the built-ins torch/triton/auto")
    if gather is not None or scatter is not None:
        if not callable(gather) or not callable(scatter):
            raise ValueError(f"register_variant({name!r}): pass both gather and scatter callables, or use it as a decorator")
        v = KernelVariant(name, gather, scatter, description)
        _VARIANTS.register(name, v)
        return v

    def decorate(obj):
        _VARIANTS.register(name, _as_variant(obj, name))
        return obj

    return decorate


def get_variant(name) -> KernelVariant:
    """A KernelVariant by name: "torch", "triton", "auto", a registered name, or "pkg.module:attr"."""
    if isinstance(name, KernelVariant):
        return name
    if not isinstance(name, str):
        raise ValueError(f"variant={name!r}: expected a name (str) or a KernelVariant")
    return _VARIANTS.get(name)


def available_variants() -> list[str]:
    return _VARIANTS.choices()
