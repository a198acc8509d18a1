"""tutti's KV events on a real vLLM engine (in-process), received by real ZMQ subscribers on
loopback: tutti's own publisher (kv_events_endpoint) and vLLM's publisher (--kv-events-config),
decoded the way a cluster router (llm-d's KV cache indexer) decodes them."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import harness

zmq = pytest.importorskip("zmq")
pytest.importorskip("vllm")

CHUNK = 64  # 2 vLLM blocks of 32
SLOT_BYTES = 2 * CHUNK * 2 * 2 * 64 * 4  # layers x tokens x KV heads x (K|V) x head_dim x fp32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(seed: int, n: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, 500) for _ in range(n)]


class Subscriber:
    """A SUB socket decoding vLLM's wire format: [topic, 8-byte big-endian seq, msgpack batch].

    It polls on its own thread from the start, like a real consumer: a SUB socket sends its
    subscription only while it is being used, so an idle one would miss the first batches.
    """

    def __init__(self, ctx, *, bind: str | None = None, connect: str | None = None) -> None:
        import msgspec

        from vllm.distributed.kv_events import KVEventBatch

        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            self.sock.bind(bind)
        if connect:
            self.sock.connect(connect)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.raw = msgspec.msgpack.Decoder()
        self.frames: list[tuple[bytes, int]] = []
        self.batches = []
        self.raw_batches = []
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.sock.poll(20):
                    parts = self.sock.recv_multipart()
                    assert len(parts) == 3, parts
                    topic, seq, payload = parts
                    assert len(seq) == 8
                    with self._lock:
                        self.frames.append((topic, int.from_bytes(seq, "big")))
                        self.batches.append(self.decoder.decode(payload))
                        self.raw_batches.append(self.raw.decode(payload))
        except BaseException as exc:  # noqa: BLE001 - reported by drain()
            self.errors.append(exc)
        finally:
            self.sock.close(linger=0)

    def drain(self, until, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline and not self.errors:
            time.sleep(0.02)
        assert not self.errors, self.errors

    def events(self, cls, medium=None):
        with self._lock:
            return [e for b in self.batches for e in b.events
                    if type(e).__name__ == cls and (medium is None or e.medium == medium)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def fresh_kv_agent():
    """vLLM keeps the worker connector in a process global that only a clean engine shutdown
    clears: an engine that failed at start-up (test_connector's bad-config cases) leaves its
    connector, with its config, for the next engine in the process. Start and end clean."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    yield
    ensure_kv_transfer_shutdown()


def test_stored_and_removed_events_reach_zmq_subscribers(tiny_model, tmp_path, fresh_kv_agent):
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import MEDIUM_STORAGE

    ours, vllms = _free_port(), _free_port()
    ctx = zmq.Context()
    sub = Subscriber(ctx, bind=f"tcp://127.0.0.1:{ours}")  # like llm-d's indexer: it binds, pods connect
    vsub = Subscriber(ctx, connect=f"tcp://127.0.0.1:{vllms}")
    kvt = {"kv_connector": "TuttiConnectorV1", "kv_connector_module_path": "tutti.vllm.connector",
           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"root": str(tmp_path / "kv"), "capacity_bytes": 4 * SLOT_BYTES,
                                         "chunk_tokens": CHUNK, "kv_events_endpoint": f"tcp://127.0.0.1:{ours}",
                                         "kv_events_topic": "kv@{host}@{model}"}}
    llm = harness.make_llm(tiny_model, kv_transfer_config=kvt,
                           kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                           endpoint=f"tcp://*:{vllms}", topic="gpu"))
    try:
        a = _prompt(1, 300)  # 4 whole chunks: fills the store
        harness.generate_ids(llm, [a], 2)
        harness.settle(llm)
        sub.drain(lambda: len(sub.events("BlockStored")) >= 4)
        vsub.drain(lambda: len(vsub.events("BlockStored", MEDIUM_STORAGE)) >= 4)

        # tutti's stream: only tutti's events, vLLM's wire format, llm-d's topic
        stored = sub.events("BlockStored")
        assert len(stored) == 4 and all(e.medium == MEDIUM_STORAGE == "STORAGE" for e in stored)
        topic = f"kv@{socket.gethostname()}@{tiny_model}".encode()
        assert {t for t, _ in sub.frames} == {topic}
        seqs = [s for _, s in sub.frames]
        assert seqs == list(range(len(seqs)))  # a fresh publisher numbers batches from 0
        assert all(len(b) == 3 and isinstance(b[0], float) for b in sub.raw_batches)  # [ts, events, dp_rank]
        raw_event = sub.raw_batches[0][1][0]  # vLLM 0.32 tags events as maps; older ones as arrays
        assert (raw_event.get("type") if isinstance(raw_event, dict) else raw_event[0]) == "BlockStored"
        for c, e in enumerate(stored):  # chunk order: each chunk's parent is the previous chunk's last block
            assert e.block_size == 32 and len(e.block_hashes) == CHUNK // 32
            assert e.token_ids == a[c * CHUNK:(c + 1) * CHUNK]
            assert e.parent_block_hash == (stored[c - 1].block_hashes[-1] if c else None)

        # the same hashes as vLLM's own GPU prefix cache: a router matches them to the same prompt
        gpu_hashes = [h for e in vsub.events("BlockStored") if e.medium in (None, "GPU") for h in e.block_hashes]
        ours_hashes = [h for e in stored for h in e.block_hashes]
        assert ours_hashes == gpu_hashes[:len(ours_hashes)]
        # ... and vLLM's own publisher carried tutti's events too (take_events -> KVEventBatch)
        assert [h for e in vsub.events("BlockStored", MEDIUM_STORAGE) for h in e.block_hashes] == ours_hashes

        # a second prompt needs all 4 slots: A's chunks are evicted and announced as removed
        b = _prompt(2, 300)
        harness.generate_ids(llm, [b], 2)
        harness.settle(llm)
        sub.drain(lambda: len(sub.events("BlockStored")) >= 8 and sub.events("BlockRemoved"))
        removed = [h for e in sub.events("BlockRemoved") for h in e.block_hashes]
        assert all(e.medium == MEDIUM_STORAGE for e in sub.events("BlockRemoved"))
        assert sorted(removed) == sorted(ours_hashes)
        new = sub.events("BlockStored")[4:]
        assert [e.token_ids for e in new] == [b[c * CHUNK:(c + 1) * CHUNK] for c in range(4)]
        assert harness.connector(llm).planner.stats.evictions == 4
    finally:
        harness.shutdown_llm(llm)
        sub.close()
        vsub.close()
        ctx.term()


def test_event_endpoint_and_topic_are_validated():
    from tutti.engine.config.settings import EngineConfig

    base = {"root": "/tmp/x", "capacity_bytes": "1GiB"}
    for ok in ("tcp://*:5557", "tcp://indexer:5557", "tcp://127.0.0.1:0", "ipc:///tmp/tutti.sock", ""):
        assert EngineConfig.from_dict({**base, "kv_events_endpoint": ok}).kv_events_endpoint == ok
    for bad, match in (("127.0.0.1:5557", "expected 'tcp://HOST:PORT'"), ("tcp://h:70000", "port 70000"),
                       (5557, "ZMQ endpoint string"), ("tcp://h", "expected 'tcp://HOST:PORT'")):
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            EngineConfig.from_dict({**base, "kv_events_endpoint": bad})
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_dict({**base, "kv_events_endpoint": bad})
    with pytest.raises(ValueError, match="kv_events_topic"):
        EngineConfig.from_dict({**base, "kv_events_topic": 3})


def test_tracker_falls_back_to_stand_in_hashes_for_unknown_chunks():
    """Chunks resident from an earlier run have no vLLM hashes here: a removal still names them."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from tutti.vllm.events import KVEventTracker

    t = KVEventTracker(chunk_tokens=64, hash_block_size=32, seed=b"s" * 32)
    key = bytes(range(32))
    ev = t.translate([("stored", [key]), ("removed", [key])])
    assert isinstance(ev[0], BlockStored) and isinstance(ev[1], BlockRemoved)
    assert ev[0].block_hashes == ev[1].block_hashes == [int.from_bytes(key[:8], "big")]
    assert ev[0].medium == ev[1].medium == "STORAGE"
    with pytest.raises(ValueError, match="'moved'"):
        t.translate([("moved", [key])])
    with pytest.raises(ValueError, match="hash block size"):
        KVEventTracker(chunk_tokens=48, hash_block_size=32, seed=b"")


def test_events_name_the_blocks_of_the_identity_that_stored_the_chunk():
    """A salted (or LoRA, or multimodal) request's chunk is announced with that request's vLLM
    block hashes, which carry the salt: a router never credits it to another tenant's prompt."""
    from types import SimpleNamespace

    from vllm.distributed.kv_events import BlockStored

    from tutti.engine.sched.planner import Planner
    from tutti.vllm.identity import request_identity
    from tutti.vllm.events import KVEventTracker

    toks = _prompt(3, 129)
    req = SimpleNamespace(request_id="r", prompt_token_ids=toks, all_token_ids=toks, cache_salt="tenant-a",
                          lora_request=None, mm_features=None, prompt_embeds=None,
                          block_hashes=[bytes([i]) * 32 for i in range(4)])
    p = Planner(num_slots=8, chunk_tokens=64, block_size=32, seed=b"s" * 32)
    assert p.match("r", toks, 0, request_identity(req, 32)) == 0
    p.update_request("r", all_block_ids=list(range(5)))
    stores = p.build_step({"r": len(toks)}, {"r": 0}).stores
    assert len(stores) == 2
    t = KVEventTracker(chunk_tokens=64, hash_block_size=32, seed=b"s" * 32)
    t.add_request(req)
    t.planned(stores)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    ev = t.translate([("stored", [st.key for st in stores])])
    assert all(isinstance(e, BlockStored) for e in ev)
    announced = [h for e in ev for h in e.block_hashes]
    assert announced == [maybe_convert_block_hash(h) for h in req.block_hashes]  # the salted request's own


def test_another_writers_chunks_are_announced_from_its_recorded_extras():
    """What one server announces for its chunk, it records (tutti.store.extras); another server
    announces the same BlockStored from that record and a BlockRemoved when the owner evicts;
    a chunk it holds itself, extras that do not parse, and hashes of another hash seed are
    never announced."""
    from types import SimpleNamespace

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from tutti.engine.sched.planner import Planner
    from tutti.vllm.events import KVEventTracker

    toks = _prompt(5, 129)
    req = SimpleNamespace(request_id="r", prompt_token_ids=toks, all_token_ids=toks, cache_salt=None,
                          lora_request=None, mm_features=None, prompt_embeds=None,
                          block_hashes=[bytes([i]) * 32 for i in range(4)])
    p = Planner(num_slots=8, chunk_tokens=64, block_size=32, seed=b"s" * 32)
    p.match("r", toks, 0)
    p.update_request("r", all_block_ids=list(range(5)))
    stores = p.build_step({"r": len(toks)}, {"r": 0}).stores
    writer = KVEventTracker(chunk_tokens=64, hash_block_size=32, seed=b"s" * 32)
    writer.add_request(req)
    writer.planned(stores)
    own = writer.translate([("stored", [st.key for st in stores])])
    recorded, removed = writer.take_recorded()
    assert [k for k, _ in recorded] == [st.key for st in stores] and removed == []
    import json

    recorded = [(k, json.loads(json.dumps(x))) for k, x in recorded]  # through the file's JSON
    reader = KVEventTracker(chunk_tokens=64, hash_block_size=32, seed=b"s" * 32)
    got = reader.translate_foreign([("stored", k, x) for k, x in recorded])
    assert got == own and all(isinstance(e, BlockStored) and e.medium == "STORAGE" for e in got)
    k0, x0 = recorded[0]
    assert reader.translate_foreign([("stored", k0, x0)], own=lambda k: k == k0) == []  # it announces its own
    gone = reader.translate_foreign([("removed", k0, x0)])
    assert isinstance(gone[0], BlockRemoved) and gone[0].block_hashes == own[0].block_hashes
    bad = [dict(x0, h="nope"), dict(x0, h=[True]), dict(x0, t=["a"]), dict(x0, bs=0), dict(x0, ln=5), {"h": []},
           dict(x0, t=list(range(65))), dict(x0, p={"x": 1}), {}]
    assert reader.translate_foreign([("stored", k0, x) for x in bad]) == []
    assert reader.translate_foreign([("stored", k0, dict(x0, s="another-seed"))]) == []
    writer.translate([("removed", [k0])])
    assert writer.take_recorded() == ([], [k0])
