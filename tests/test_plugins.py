"""The one registry behind every pluggable kind (tutti.plugins), and tutti's public face."""

import os
import subprocess
import sys
import textwrap

import pytest

import tutti
from tutti import plugins
from tutti.plugins import Registry


class Thing:
    def run(self):
        return "ran"


class Other(Thing):
    pass


class NoRun:
    pass


@pytest.fixture
def reg():
    r = Registry("test_kind_xyz", "register_thing", {"thing": Thing, "lazy": "collections:OrderedDict"},
                 ("run",), doc="tests.test_plugins")
    yield r
    plugins._KINDS.pop("test_kind_xyz", None)


def test_names_builtins_and_registered(reg):
    assert isinstance(reg.get("thing"), Thing)
    reg.register("other", Other)
    assert reg.names() == ["lazy", "other", "thing"] and reg.has("other") and not reg.has("nope")
    assert type(reg.get("other")) is Other
    with pytest.raises(ValueError, match=r"test_kind_xyz='nope': unknown; expected one of \['lazy', 'other', 'thing'\]"):
        reg.get("nope")
    with pytest.raises(ValueError, match=r"test_kind_xyz=None: expected one of"):
        reg.get(None)
    with pytest.raises(ValueError, match="register_thing: name='a:b': expected a non-empty name without ':'"):
        reg.register("a:b", Thing)


def test_lazy_builtin_is_imported_on_first_use():
    r = Registry("test_kind_lazy", "register_lazy", {"mod": "tests_plugins_lazy_mod:Made"}, ("run",))
    try:
        assert "tests_plugins_lazy_mod" not in sys.modules  # not imported by the registry's creation
        with pytest.raises(ValueError, match="test_kind_lazy='tests_plugins_lazy_mod:Made': cannot import module"):
            r.get("mod")
        opt = Registry("test_kind_lazy", "register_lazy", {"mod": "tests_plugins_lazy_mod:Made", "thing": Thing},
                       ("run",), optional=True)
        assert opt.names() == ["thing"] and not opt.has("mod")  # an optional built-in that does not import: absent
    finally:
        plugins._KINDS.pop("test_kind_lazy", None)


def test_module_attr_form(reg, tmp_path, monkeypatch):
    (tmp_path / "plugins_example_mod.py").write_text(textwrap.dedent("""
        class Mine:
            def run(self):
                return "mine"
        instance = Mine()
        class Broken:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert reg.get("plugins_example_mod:Mine").run() == "mine"
        inst = reg.get("plugins_example_mod:instance")
        assert inst is sys.modules["plugins_example_mod"].instance  # an instance is taken as it is
        with pytest.raises(ValueError, match="test_kind_xyz='plugins_example_mod:nope': module .* has no attribute"):
            reg.get("plugins_example_mod:nope")
        with pytest.raises(ValueError, match="test_kind_xyz='no_such_mod_xyz:X': cannot import module"):
            reg.get("no_such_mod_xyz:X")
        # the method check names the key, the spec, the missing method and where the contract is
        with pytest.raises(ValueError, match=r"test_kind_xyz='plugins_example_mod:Broken': its policy has no run "
                                             r"method\(s\) \(tests.test_plugins says"):
            reg.get("plugins_example_mod:Broken")
    finally:
        sys.modules.pop("plugins_example_mod", None)


def test_method_check_names_the_key(reg):
    reg.register("norun", NoRun)
    with pytest.raises(ValueError, match="test_kind_xyz='norun': its policy has no run method"):
        reg.get("norun")
    obj = Thing()
    assert reg.get(obj) is obj  # an object implementing the methods passes through


def test_auto_rule_and_make_hook():
    calls = []

    def auto(*args, **kwargs):
        calls.append((args, kwargs))
        return "auto-made"

    r = Registry("test_kind_auto", "register_auto", {"thing": Thing}, ("run",), fresh=True, auto=auto,
                 make=lambda obj, spec, registered, *a, **kw: (spec, registered, obj, a, kw), typed=False,
                 noun="widget", note="see the docs")
    try:
        assert r.get("auto", 1, x=2) == "auto-made" and calls == [((1,), {"x": 2})]
        assert r.choices() == ["auto", "thing"] and r.names() == ["thing"]
        assert r.get("thing", 3) == ("thing", True, Thing, (3,), {})
        with pytest.raises(ValueError, match=r"test_kind_auto=5: unknown widget; expected one of \['auto', 'thing'\] "
                                             r"or 'package.module:attr' \(see the docs\)"):
            r.get(5)
        with pytest.raises(KeyError):
            r.entry("nope")
    finally:
        plugins._KINDS.pop("test_kind_auto", None)


def test_kinds_lists_every_pluggable():
    ks = plugins.kinds()
    assert {"kernel_variant", "io_backend", "medium", "hit_policy", "eviction_policy", "store_admission",
            "codec"} <= set(ks)
    assert all(isinstance(r, Registry) and r.kind == k for k, r in ks.items())
    assert ks["kernel_variant"].choices()[:3] == ["auto", "torch", "triton"]
    assert {"auto", "threads", "uring"} <= set(ks["io_backend"].choices())
    assert "file" in ks["medium"].names() and "lru" in ks["eviction_policy"].names()
    # the kinds' own functions read the same registries
    from tutti.io.queue import available_backends
    from tutti.kernels import available_variants

    assert available_backends() == ks["io_backend"].names() and available_variants() == ks["kernel_variant"].choices()


def test_public_names_resolve():
    for name in tutti.__all__:
        assert getattr(tutti, name) is not None, name
    assert {"register_variant", "register_backend", "register_medium", "register_policy", "register_eviction",
            "register_admission", "register_codec"} <= set(tutti.__all__)
    with pytest.raises(AttributeError):
        tutti.no_such_name_xyz  # noqa: B018


def test_import_tutti_is_cheap():
    code = ("import sys, tutti, tutti.plugins; heavy = [m for m in ('torch', 'triton', 'vllm') if m in sys.modules]; "
            "print(heavy); assert not heavy, heavy")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr
