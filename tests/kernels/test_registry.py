"""Registering and resolving kernel variants."""

import sys
import textwrap

import pytest
import torch

import tutti.kernels as K
from tutti.kernels import reference, registry


@pytest.fixture(autouse=True)
def clean_registry():
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_builtins():
    assert {"auto", "torch", "triton"} <= set(K.available_variants())
    assert K.get_variant("torch").gather is reference.gather
    assert K.get_variant("auto").name == "auto"


def test_decorator_on_class_then_conformance():
    calls = []

    @K.register_variant("counting")
    class Counting:
        """Torch reference that counts calls."""

        def gather(self, *a, **kw):
            calls.append("g")
            reference.gather(*a, **kw)

        def scatter(self, *a, **kw):
            calls.append("s")
            reference.scatter(*a, **kw)

    assert isinstance(Counting, type)  # the decorator returns the class unchanged
    v = K.get_variant("counting")
    assert v.name == "counting" and v.description.startswith("Torch reference")
    assert "counting" in K.available_variants()
    report = K.check_variant("counting", quick=True)
    assert report.variant == "counting" and "g" in calls and "s" in calls


def test_decorator_on_factory_and_explicit():
    @K.register_variant("fact")
    def make():
        return K.KernelVariant("whatever", reference.gather, reference.scatter, "from a factory")

    assert K.get_variant("fact").name == "fact" and K.get_variant("fact").description == "from a factory"
    v = K.register_variant("explicit", gather=reference.gather, scatter=reference.scatter)
    assert K.get_variant("explicit") is v
    with pytest.raises(ValueError, match="both gather and scatter"):
        K.register_variant("half", gather=reference.gather)
    with pytest.raises(ValueError, match="built-ins"):
        K.register_variant("torch", gather=reference.gather, scatter=reference.scatter)


def test_module_string(tmp_path, monkeypatch):
    (tmp_path / "my_kernels.py").write_text(textwrap.dedent("""
        from tutti.kernels import KernelVariant, reference
        def make_variant():
            return KernelVariant("mine", reference.gather, reference.scatter)
        class Obj:
            gather = staticmethod(reference.gather)
            scatter = staticmethod(reference.scatter)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    v = K.get_variant("my_kernels:make_variant")
    assert v.name == "my_kernels:make_variant" and v.gather is reference.gather
    assert K.get_variant("my_kernels:Obj").scatter is reference.scatter
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        K.get_variant("my_kernels:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod_xyz'"):
        K.get_variant("no_such_mod_xyz:f")
    sys.modules.pop("my_kernels", None)


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown; expected one of"):
        K.get_variant("does-not-exist")


def test_conformance_catches_a_broken_variant():
    def bad_gather(caches, layout, ids, out, **kw):
        reference.gather(caches, layout, ids, out, **kw)
        out.view(-1)[5] ^= 1  # one flipped bit

    K.register_variant("broken", gather=bad_gather, scatter=reference.scatter)
    with pytest.raises(AssertionError, match=r"variant 'broken' gather: segment differs at index \(0, 0, 5\)"):
        K.check_variant("broken", quick=True)

    def bad_scatter(caches, layout, ids, src, **kw):
        reference.scatter(caches, layout, ids + 0 * ids, src, **kw)
        reference.scatter(caches, layout, ids[:, :1].flip(0), src[:, :, : layout.segment_bytes(layout.block_size)], **kw)

    K.register_variant("broken2", gather=reference.gather, scatter=bad_scatter)
    with pytest.raises(AssertionError, match="variant 'broken2' scatter"):
        K.check_variant("broken2", quick=True)
