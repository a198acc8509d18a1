"""The codec seam (tutti.codec): names resolve like every other kind's, "identity" changes no
namespace and no byte, another codec makes a namespace of its own, a decoder refuses hostile
bytes with ValueError, and a real worker stores and loads through a codec that changes the bytes
and their length (tests/codec_example.py, framed zlib) bit exact, on the layer-wise file path,
the chunk-major file path and tutti's loading thread, while a damaged stored slot fails its chunk
only."""

from __future__ import annotations

import os
import time
import zlib

import pytest
import torch

from tutti.codec import (IdentityCodec, available_codecs, check_codec, encoded_stride, get_codec, is_identity,
                         register_codec)
from tutti.engine.build import build_worker
from tutti.engine.config import resolve
from tutti.engine.config.settings import ConfigError, EngineConfig
from tutti.engine.geometry import Geometry
from tutti.engine.plan import LoadChunk, StepPlan, StoreChunk
from tutti.kernels import PagedLayout
from tutti.store.fingerprint import Fingerprint, codec_extra

from tests.codec_example import HEADER, ZlibCodec
from tests.engine.worker.worker_helpers import _run_whole, run_step

ZLIB = "tests.codec_example:ZlibCodec"
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
L, B, H, N, D = 3, 24, 2, 16, 8  # layers, blocks, kv heads, tokens/block, head size
T = 32  # chunk tokens: 2 blocks


def geometry() -> Geometry:
    return Geometry(model="tiny", cache_dtype="float32", chunk_tokens=T, block_size=N, num_layers=L, num_heads=H,
                    content_bytes=2 * D * 4)


# ---------------------------------------------------------------- names
def test_names_resolve_as_every_kind_does():
    assert isinstance(get_codec("identity"), IdentityCodec) and is_identity(get_codec("identity"))
    assert EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB"}).codec == "identity"
    assert get_codec(ZLIB).name == "zlib1" and not is_identity(get_codec(ZLIB))
    mine = ZlibCodec()
    assert get_codec(mine) is mine  # an object passes through
    register_codec("zlib-test", ZlibCodec)
    assert "zlib-test" in available_codecs() and isinstance(get_codec("zlib-test"), ZlibCodec)
    assert EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "codec": ZLIB}).codec == ZLIB


class _Nameless(ZlibCodec):
    name = "no spaces please"


class _Impostor(ZlibCodec):
    name = "identity"


@pytest.mark.parametrize("value, says", [
    ("zstd", "codec='zstd': unknown codec; expected one of"),
    ("", "codec='': expected one of"),
    (7, "codec=7: expected one of"),
    ("tests.codec_example:Nope", "has no attribute 'Nope'"),
    ("no_such_module_x:Codec", "cannot import module 'no_such_module_x'"),
    ("tests.codec_example:HEADER", "not a class or factory"),
    ("tests.test_codec:_Nameless", "expected 1-64 of A-Z a-z 0-9"),
    ("tests.test_codec:_Impostor", "give a codec that changes bytes a name of its own"),
])
def test_a_bad_codec_is_refused_by_the_config_naming_the_key(value, says):
    with pytest.raises(ConfigError, match="codec=") as exc:
        EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "codec": value})
    assert says in str(exc.value)
    with pytest.raises(ValueError):
        check_codec(value)


def test_the_paths_that_cannot_decode_are_refused_at_config_time():
    base = {"root": "/tmp/x", "capacity_bytes": "1GiB", "codec": ZLIB}
    with pytest.raises(ConfigError, match=r"mapped_loads=True: refused with codec='tests.codec_example:ZlibCodec'.*"
                                          r"set mapped_loads to \"auto\" or false"):
        EngineConfig.from_dict({**base, "mapped_loads": True})
    with pytest.raises(ConfigError, match=r"async_launch='step': refused with codec=.*\"thread\""):
        EngineConfig.from_dict({**base, "async_launch": "step"})
    EngineConfig.from_dict({**base, "mapped_loads": False, "async_launch": "thread"})
    EngineConfig.from_dict({"root": "/tmp/x", "capacity_bytes": "1GiB", "mapped_loads": True, "codec": "identity"})


def test_resolve_turns_mapped_loads_off_for_a_codec():
    got = resolve.mapped_loads("auto", on_ram=True, shared=False, secret=False, codec=True)
    assert got.value is False and "a codec" in got.why
    assert resolve.mapped_loads(False, on_ram=True, shared=False, secret=False, codec=True).value is False
    assert resolve.mapped_loads("auto", on_ram=True, shared=False, secret=False).value is True  # identity: as before


# ---------------------------------------------------------------- identity
def test_identity_keeps_every_namespace_and_key():
    geom = geometry()
    assert geom.with_codec(get_codec("identity")) is geom
    fp = geom.fingerprint()
    assert fp.digest() == "ea1275ef1befefb0"  # this geometry's namespace before codecs existed
    assert geom.seed().hex().startswith("7bb55e01f1c82d9d")
    assert fp.codec == "identity" and "codec" not in dict(fp.extra)
    assert codec_extra("identity") == () and encoded_stride(IdentityCodec(), 4096) == 4096
    with pytest.raises(ValueError, match="leave it out"):  # one spelling of identity: the absence
        Fingerprint.from_dict({**fp.to_dict(), "extra": [["codec", "identity"]]})


def test_a_codec_makes_a_namespace_of_its_own():
    geom = geometry()
    coded = geom.with_codec(ZlibCodec())
    assert coded.with_codec(ZlibCodec()) == coded  # derived once
    assert coded.codec == "zlib1" and coded.segment_bytes == geom.segment_bytes == 4096
    assert coded.stored_segment_bytes == 8192 and coded.slot_bytes == L * 8192 and coded.chunk_bytes == L * 4096
    fp = coded.fingerprint()
    assert fp.codec == "zlib1" and dict(fp.extra)["codec"] == "zlib1" and fp.segment_bytes == 8192
    assert fp.digest() != geom.fingerprint().digest()
    assert Fingerprint.from_dict(fp.to_dict()) == fp
    assert coded.seed() == geom.seed()  # the same KV, the same keys: only where its bytes live differs
    assert coded.for_rank(0) == coded

    class Other(ZlibCodec):
        name = "zlib2"

    assert geom.with_codec(Other()).fingerprint().digest() != fp.digest()  # never read with another codec


# ---------------------------------------------------------------- the codec itself
def _encoded(raw: bytes) -> bytearray:
    c = ZlibCodec()
    dst = bytearray(c.max_encoded_bytes(len(raw)))
    n = c.encode(memoryview(bytearray(raw)), memoryview(dst))
    assert 0 < n <= len(dst)
    return dst


def _decode(src: bytes, nbytes: int = 4096) -> bytearray:
    dst = bytearray(nbytes)
    ZlibCodec().decode(memoryview(bytearray(src)), memoryview(dst))
    return dst


def test_the_example_round_trips_and_changes_bytes_and_length():
    raw = os.urandom(3000) + bytes(1096)
    enc = _encoded(raw)
    n = int.from_bytes(enc[:HEADER], "little")
    assert HEADER + n < len(raw) and bytes(enc[HEADER:HEADER + 16]) != raw[:16]
    assert _decode(bytes(enc)) == raw
    assert _decode(bytes(enc[:HEADER + n])) == raw  # the zero tail is not needed


def test_hostile_stored_bytes_raise_value_error_and_nothing_else():
    raw = os.urandom(2048) + bytes(2048)
    enc = bytes(_encoded(raw))
    n = int.from_bytes(enc[:HEADER], "little")
    cases = {
        "truncated header": enc[:3],
        "truncated stream": enc[:HEADER + n // 2],
        "length past what was stored": (len(enc) * 2).to_bytes(HEADER, "little") + enc[HEADER:],
        "a stream cut short inside its length": (n // 2).to_bytes(HEADER, "little") + enc[HEADER:],
        "garbage": b"\x10\x00\x00\x00" + os.urandom(64),
        "flipped payload": enc[:HEADER + 5] + bytes([enc[HEADER + 5] ^ 0xFF]) + enc[HEADER + 6:],
        "bytes after the stream": (n + 3).to_bytes(HEADER, "little") + enc[HEADER:HEADER + n] + b"abc",
    }
    for why, src in cases.items():
        with pytest.raises(ValueError):
            _decode(src)
        assert why
    small = zlib.compress(bytes(1000), 1)  # a stream of the wrong size
    with pytest.raises(ValueError, match="inflates to 1000 B"):
        _decode(len(small).to_bytes(HEADER, "little") + small)
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~64 KiB: stops at the segment's size
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="past the segment"):
        _decode(len(bomb).to_bytes(HEADER, "little") + bomb)
    assert time.perf_counter() - t0 < 1.0
    rng = torch.Generator().manual_seed(3)
    for _ in range(200):  # random stored bytes: ValueError, never another exception
        src = torch.randint(0, 256, (int(torch.randint(0, 200, (1,), generator=rng)),), generator=rng,
                            dtype=torch.uint8).numpy().tobytes()
        with pytest.raises(ValueError):
            _decode(src)
    with pytest.raises(ValueError):  # identity's own decode refuses too few bytes
        IdentityCodec().decode(memoryview(bytearray(10)), memoryview(bytearray(20)))


# ---------------------------------------------------------------- a real worker (CPU, real files and kernels)
@pytest.fixture(params=DEVICES)
def device(request):
    """The worker's tests run on the CPU and, where CUDA exists, on the GPU (pinned staging, the
    device copies after decoding, side streams and events)."""
    return request.param


def make_caches(seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, N, 2 * D, generator=g).to(device) for _ in range(L)]


def _views(caches):
    return [c.as_strided((B, H, 2, N, D), (c.stride(0), c.stride(1), N * D, D, 1)) for c in caches]


def worker(root, caches, **kw):
    cfg = {"root": str(root), "capacity_bytes": 64 * geometry().with_codec(ZlibCodec()).slot_bytes,
           "chunk_tokens": T, "staging_bytes": 16 * 16384, "staging_slots": 16, "max_inflight_stores": 8,
           "lookahead": 1, "codec": ZLIB, **kw}
    v = _views(caches)
    layout = PagedLayout.from_tensor(v[0], ("block", "head", "kv", "token", "dim"))
    return build_worker(cfg, geometry(), caches=v, layout=layout)


def key(i: int) -> bytes:
    return bytes([i]) * 32


def store(root, caches, chunks, **kw):
    """Store (slot, blocks) chunks with keys 0, 1, ...; returns the worker's report."""
    w = worker(root, caches, **kw)
    try:
        run_step(w, StepPlan(1, stores=[StoreChunk("r", key(i), slot, tuple(b), ticket=i + 1)
                                        for i, (slot, b) in enumerate(chunks)]))
        w.flush()
        return w.take_report()
    finally:
        w.close()


def load(w, loads, how):
    """Failed blocks of a step loading `loads`: layer-wise, whole (chunk-major file path) or on
    tutti's loading thread (asynchronous)."""
    if how == "layerwise":
        run_step(w, StepPlan(2, loads=loads))
        return w.take_failed_blocks()
    return _run_whole(w, 2, loads, "full_graph" if how == "whole" else "async")


def slab(root):
    return next(p for p in root.rglob("slab-*.bin"))


HOW = ["layerwise", "whole", "async"]


@pytest.mark.parametrize("how", HOW)
def test_a_worker_stores_and_loads_bit_exact_through_a_codec(tmp_path, how, monkeypatch, device):
    from tutti.engine.worker.loads.core import LoadCore

    calls = {"chunk": 0, "layer": 0}
    whole, one = LoadCore.decoded_chunk, LoadCore.decoded

    def decoded_chunk(self, *a):
        calls["chunk"] += 1
        return whole(self, *a)

    def decoded(self, *a):
        calls["layer"] += 1
        return one(self, *a)

    monkeypatch.setattr(LoadCore, "decoded_chunk", decoded_chunk)
    monkeypatch.setattr(LoadCore, "decoded", decoded)
    src = make_caches(0, device)
    rep = store(tmp_path, src, [(3, [0, 1]), (7, [4, 5]), (8, [10, 11])])
    assert sorted(rep.stored) == [1, 2, 3] and not rep.store_failed
    assert rep.bytes_stored == 3 * L * 8192  # as written: the stride
    dst = make_caches(1, device)
    before = [c.clone() for c in dst]
    w = worker(tmp_path, dst, async_loads=how == "async")
    try:
        assert w.ctx.codec.name == "zlib1" and w.ctx.stored_seg == 8192 and w.loads.ring.encoded is not None
        assert w.decisions.made["mapped_loads"].value is False
        w.warm_up()  # the start-up read probe reads the stored segments as a load does
        assert w.probe[0] == 3 * L * 8192
        loads = [LoadChunk("q", key(0), 3, (20, 21)), LoadChunk("q", key(2), 8, (2, 3)),
                 LoadChunk("q", key(1), 7, (14, 15), skip_blocks=1)]
        assert load(w, loads, how) == set()
    finally:
        w.close()
    # every layer of every chunk decoded once: per layer (layer-wise) or chunk-major (whole, async)
    assert calls == ({"chunk": 0, "layer": 3 * L} if how == "layerwise" else {"chunk": 3, "layer": 3 * L})
    for s, d, b in zip(src, dst, before):
        assert torch.equal(d[[20, 21]], s[[0, 1]]) and torch.equal(d[[2, 3]], s[[10, 11]])
        assert torch.equal(d[15], s[5]) and torch.equal(d[14], b[14])  # vLLM's own block: left alone
        untouched = [i for i in range(B) if i not in (20, 21, 2, 3, 15)]
        assert torch.equal(d[untouched], b[untouched])
    # what is on disk: zlib streams at the codec's stride, in a namespace of the codec's own
    coded = geometry().with_codec(ZlibCodec())
    assert slab(tmp_path).parent.name == f"tutti-{coded.fingerprint().digest()}"
    data = slab(tmp_path).read_bytes()
    for layer in range(L):
        at = 3 * coded.slot_bytes + layer * 8192
        n = int.from_bytes(data[at:at + HEADER], "little")
        assert 0 < n < 4096 + 64 and data[at + HEADER + n:at + 8192] == bytes(8192 - HEADER - n)
        raw = zlib.decompress(data[at + HEADER:at + HEADER + n])
        gathered = _views(src)[layer][[0, 1]].permute(0, 3, 1, 2, 4).reshape(-1).cpu()  # [token, head, K|V]
        assert raw[:gathered.numel() * 4] == gathered.numpy().tobytes()


def test_the_scheduler_half_finds_the_chunks_in_the_codecs_namespace(tmp_path):
    """The planner opens the codec's namespace (its index rebuilt from that journal) and sizes
    slots by the codec's stride; with "identity" it would see no chunk there."""
    from tutti.engine.build import build_planner, check_geometry

    store(tmp_path, make_caches(0), [(3, [0, 1]), (7, [4, 5])])
    cfg = {"root": str(tmp_path), "capacity_bytes": 64 * L * 8192, "chunk_tokens": T, "codec": ZLIB}
    assert check_geometry(EngineConfig.from_dict(cfg), geometry()) == 64
    planner = build_planner(cfg, geometry())
    assert planner.slot_bytes == L * 8192 and planner.index.num_slots == 64
    assert key(0) in planner.index and key(1) in planner.index
    assert len(build_planner({**cfg, "codec": "identity"}, geometry()).index) == 0


def test_a_registered_codec_and_a_secret_round_trip(tmp_path, monkeypatch, device):
    """Keyed tags cover the raw segments, checked on the host after decoding."""
    monkeypatch.setenv("TUTTI_TEST_SECRET", "a secret of more than sixteen bytes")
    register_codec("zlib-test", ZlibCodec)
    src = make_caches(0, device)
    assert store(tmp_path, src, [(0, [0, 1])], codec="zlib-test", secret_env="TUTTI_TEST_SECRET").stored == [1]
    dst = make_caches(1, device)
    w = worker(tmp_path, dst, codec="zlib-test", secret_env="TUTTI_TEST_SECRET")
    try:
        assert load(w, [LoadChunk("q", key(0), 0, (6, 7))], "layerwise") == set()
    finally:
        w.close()
    for s, d in zip(src, dst):
        assert torch.equal(d[[6, 7]], s[[0, 1]])


class _Overflowing(ZlibCodec):
    name = "overflowing"

    def encode(self, src, dst):
        super().encode(src, dst)
        return len(dst) + 1  # claims more room than it may use


def test_a_codec_that_breaks_its_promise_fails_the_store_not_the_writer(tmp_path, device):
    rep = store(tmp_path, make_caches(0, device), [(0, [0, 1])], codec="tests.test_codec:_Overflowing")
    assert rep.stored == [] and rep.store_failed == [1]  # counted; the writer thread went on (and closed)


def _header(data: bytearray, at: int) -> None:
    data[at:at + HEADER] = (1 << 30).to_bytes(HEADER, "little")  # a length past the stored stride


def _payload(data: bytearray, at: int) -> None:
    data[at + HEADER + 7] ^= 0x5A  # inside the zlib stream: it no longer inflates (or fails its check)


def _swapped(data: bytearray, at: int) -> None:
    coded = geometry().with_codec(ZlibCodec())
    first = at - at % coded.slot_bytes  # layer 0 of the same slot: a valid stream of the wrong segment
    data[at:at + 8192] = data[first:first + 8192]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("damage", [_header, _payload, _swapped], ids=["header", "payload", "valid_but_wrong"])
def test_a_damaged_stored_slot_fails_its_chunk_only(tmp_path, how, damage, device):
    src = make_caches(0, device)
    store(tmp_path, src, [(3, [0, 1]), (7, [4, 5])])
    coded = geometry().with_codec(ZlibCodec())
    path = slab(tmp_path)
    data = bytearray(path.read_bytes())
    damage(data, 7 * coded.slot_bytes + 2 * 8192)  # layer 2 of slot 7
    path.write_bytes(bytes(data))
    dst = make_caches(1, device)
    w = worker(tmp_path, dst, async_loads=how == "async")
    try:
        failed = load(w, [LoadChunk("q", key(0), 3, (20, 21)), LoadChunk("q", key(1), 7, (8, 9))], how)
        assert failed == {8, 9}  # that chunk's blocks: vLLM recomputes them
        rep = w.take_report()
        assert rep.load_failed == [key(1)]
        w.flush()
        assert 7 not in w.store.entries()  # journaled free: no restart serves it again
    finally:
        w.close()
    for s, d in zip(src, dst):
        assert torch.equal(d[[20, 21]], s[[0, 1]])


def test_identity_moves_the_raw_segments_through_one_registered_buffer(tmp_path, device):
    from tutti.io.queue import WrappedQueue

    class Recording(WrappedQueue):
        def __init__(self, inner):
            super().__init__(inner)
            self.sized, self.registered = [], []

        def register_buffers(self, buffers):
            self.registered.append(len(buffers))
            super().register_buffers(buffers)

        def submit(self, requests):
            self.sized += [(r.op, r.length, r.buf.data_ptr()) for r in requests]
            return self.inner.submit(requests)

    src = make_caches(0, device)
    w = worker(tmp_path, src, codec="identity")
    try:
        assert w.ctx.codec is None and w.ctx.stored_seg == w.ctx.seg == 4096 and w.loads.ring.encoded is None
        assert w.stores.arena.encoded is None
        w.queue = Recording(w.queue)
        run_step(w, StepPlan(1, stores=[StoreChunk("r", key(0), 0, (0, 1), ticket=1)]))
        w.flush()
        run_step(w, StepPlan(2, loads=[LoadChunk("q", key(0), 0, (4, 5))]))
        assert w.take_failed_blocks() == set()
        staging = w.stores.arena.buffer.data_ptr()
        assert w.queue.sized == [("write", L * 4096, staging)] + [("read", 4096, staging)] * L
    finally:
        w.close()
    assert slab(tmp_path).parent.name == f"tutti-{geometry().fingerprint().digest()}"
