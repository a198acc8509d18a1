"""tutti's store changes as vLLM KV cache events (BlockStored / BlockRemoved, medium STORAGE).

Why vLLM's own block hashes: a cluster router (llm-d's KV cache indexer, or anything reading
vLLM's KV event stream) keys blocks by the hashes vLLM publishes for its GPU prefix cache.
Announcing a stored chunk as the vLLM block hashes it covers, with its token ids, parent hash
and vLLM's block size, lets the router match tutti's storage tier against the same prompts.
tutti's own chunk keys never leave the process.

Events reach the world two ways:
- vLLM's publisher: the scheduler publishes whatever `take_events()` returns when the server
  runs with `--kv-events-config` (one stream with the GPU prefix cache's events);
- tutti's own publisher (`kv_events_endpoint` in kv_connector_extra_config): a vLLM
  `ZmqEventPublisher` carrying only tutti's events. Wire format (vLLM's, and what llm-d's
  kv-cache manager subscribes to): ZMQ PUB multipart [topic, 8-byte big-endian sequence
  number, msgpack(KVEventBatch)], where KVEventBatch is the array [ts, [events...],
  data_parallel_rank] and each event is a tagged array ["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...].
  An endpoint with `*` binds, others connect (llm-d's indexer binds `tcp://*:5557`);
  llm-d expects the topic `kv@<pod>@<model>` (`kv_events_topic`, `{host}`/`{model}` expand).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from vllm.logger import init_logger

from tutti.engine.keys import UnkeyableError, chunk_keys
from tutti.vllm import compat, identity

logger = init_logger("vllm.tutti.events")

MEDIUM = compat.KV_EVENT_MEDIUM  # "STORAGE": llm-d lower-cases it into the pod entry's device tier


@dataclass
class _ChunkMeta:
    block_hashes: list[Any]  # vLLM's (external) block hashes of the chunk's blocks
    parent: Any  # hash of the block before the chunk; None for the first chunk
    token_ids: list[int] | None  # dropped once the stored event is out (memory)
    lora_id: int | None = None
    lora_name: str | None = None


def _enc(h: Any) -> Any:
    """A vLLM block hash for JSON (tutti.store.extras): bytes as hex, ints as they are."""
    return h.hex() if isinstance(h, (bytes, bytearray)) else int(h)


def _dec(v: Any) -> Any:
    """The inverse of _enc for hostile input: a hash, or ValueError."""
    if isinstance(v, bool):
        raise ValueError("a boolean is no block hash")
    if isinstance(v, int) and 0 <= v < 1 << 256:
        return v
    if isinstance(v, str) and 0 < len(v) <= 128:
        return bytes.fromhex(v)
    raise ValueError(f"not a block hash: {v!r:.40}")


def hash_seed_digest() -> str | None:
    """Which hash seed this process's vLLM chains block hashes from (its NONE_HASH, from
    PYTHONHASHSEED or random): another server's hashes mean something to a router only if its
    seed is the same."""
    import hashlib

    from vllm.v1.core import kv_cache_utils

    seed = getattr(kv_cache_utils, "NONE_HASH", None)
    if seed is None:  # vLLM sets it after the scheduler (and this connector) is built
        return None
    return hashlib.blake2b(repr(seed).encode(), digest_size=8).hexdigest()


def _external(h: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)


def _key_hash(key: bytes) -> int:
    """Stand-in hash for a chunk whose vLLM hashes are unknown (resident from an earlier run)."""
    return int.from_bytes(key[:8], "big")


class KVEventTracker:
    """Remembers, for chunks planned for storing, the vLLM hashes and tokens they cover, and
    turns the planner's ("stored"|"removed", keys) events into vLLM events.

    Scheduler-side only. Memory: hashes of resident chunks (blocks_per_chunk values each);
    token ids only between planning and commit.
    """

    def __init__(self, *, chunk_tokens: int, hash_block_size: int, seed: bytes, medium: str = MEDIUM) -> None:
        if chunk_tokens % hash_block_size:
            raise ValueError(f"chunk_tokens={chunk_tokens}: not a multiple of vLLM's hash block size "
                             f"{hash_block_size}")
        self.chunk_tokens = chunk_tokens
        self.hash_block_size = hash_block_size
        self.hashes_per_chunk = chunk_tokens // hash_block_size
        self.seed = seed
        self.medium = medium
        self._requests: dict[str, Any] = {}
        self._key_index: dict[str, dict[bytes, int]] = {}
        self._meta: dict[bytes, _ChunkMeta] = {}
        # (key, extras) of own chunks announced since take_recorded(), for other servers to
        # announce (tutti.store.extras); keys of own chunks removed since
        self._recorded: list[tuple[bytes, dict[str, Any]]] = []
        self._removed: list[bytes] = []
        self._seed: str | None = None
        self.lookup = None  # key -> this writer's recorded extras (tutti.store.extras.ExtrasWriter.lookup)
        self._foreign_seeds_warned: set[str] = set()

    # -- requests (from get_num_new_matched_tokens / request_finished) --------------------------
    def add_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def drop_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._key_index.pop(req_id, None)

    def _chunk_index(self, req_id: str, request: Any, key: bytes) -> int | None:
        idx = self._key_index.get(req_id)
        if idx is None or key not in idx:
            tokens = list(getattr(request, "all_token_ids", None) or request.prompt_token_ids or [])
            # the planner's keys: token ids and the request's identity (salt, LoRA, images...)
            try:
                keys = chunk_keys(tokens, self.chunk_tokens, self.seed,
                                  identity=identity.request_identity(request, self.hash_block_size))
            except UnkeyableError:
                keys = []
            idx = {k: i for i, k in enumerate(keys)}
            self._key_index[req_id] = idx
        return idx.get(key)

    # -- stores planned this step (from build_connector_meta) -----------------------------------
    def planned(self, stores: Iterable[Any]) -> None:
        """Snapshot what each planned store covers while its request is at hand."""
        for st in stores:
            if st.key in self._meta:
                continue
            req = self._requests.get(st.req_id)
            if req is None:
                continue
            c = self._chunk_index(st.req_id, req, st.key)
            hashes = list(getattr(req, "block_hashes", None) or [])
            lo, hi = (c or 0) * self.hashes_per_chunk, ((c or 0) + 1) * self.hashes_per_chunk
            if c is None or len(hashes) < hi:
                continue  # no vLLM hashes for it (prefix caching hashes off): a stand-in is sent
            tokens = list(getattr(req, "all_token_ids", None) or req.prompt_token_ids)
            lora = getattr(req, "lora_request", None)
            self._meta[st.key] = _ChunkMeta(
                block_hashes=[_external(h) for h in hashes[lo:hi]],
                parent=_external(hashes[lo - 1]) if lo > 0 else None,
                token_ids=tokens[c * self.chunk_tokens:(c + 1) * self.chunk_tokens],
                lora_id=getattr(lora, "adapter_id", None) if lora else None,
                lora_name=getattr(lora, "name", None) if lora else None,
            )

    # -- planner events -> vLLM events ---------------------------------------------------------
    def translate(self, events: Iterable[tuple[str, Sequence[bytes]]]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for kind, keys in events:
            for key in keys:
                if kind == "stored":
                    out.append(self._stored(key))
                elif kind == "removed":
                    self._removed.append(key)
                    meta = self._meta.pop(key, None)
                    hashes = meta.block_hashes if meta else self._recorded_hashes(key)
                    out.append(BlockRemoved(block_hashes=list(hashes), medium=self.medium))
                else:
                    raise ValueError(f"planner event kind {kind!r}: expected 'stored' or 'removed'")
        return out

    def _stored(self, key: bytes) -> BlockStored:
        meta = self._meta.get(key)
        if meta is None:
            return BlockStored(block_hashes=[_key_hash(key)], parent_block_hash=None, token_ids=[],
                               block_size=0, lora_id=None, medium=self.medium, lora_name=None)
        tokens, meta.token_ids = meta.token_ids or [], None
        if self._seed is None:
            self._seed = hash_seed_digest()
        self._recorded.append((key, {"h": [_enc(h) for h in meta.block_hashes],
                                     "p": None if meta.parent is None else _enc(meta.parent), "t": tokens,
                                     "bs": self.hash_block_size, "l": meta.lora_id, "ln": meta.lora_name,
                                     "s": self._seed}))
        return BlockStored(block_hashes=list(meta.block_hashes), parent_block_hash=meta.parent,
                           token_ids=tokens, block_size=self.hash_block_size, lora_id=meta.lora_id,
                           medium=self.medium, lora_name=meta.lora_name)


    def _recorded_hashes(self, key: bytes) -> list[Any]:
        """A chunk resident from an earlier run: the hashes this writer recorded for it
        (`lookup`, its extras), else a stand-in (first 8 bytes of tutti's key)."""
        x = self.lookup(key) if self.lookup is not None else None
        try:
            return [_dec(h) for h in x["h"]] if x else [_key_hash(key)]
        except (KeyError, TypeError, ValueError):
            return [_key_hash(key)]

    def take_recorded(self) -> tuple[list[tuple[bytes, dict[str, Any]]], list[bytes]]:
        """(key, extras) of own chunks announced, and own keys removed, since the last call."""
        out = (self._recorded, self._removed)
        self._recorded, self._removed = [], []
        return out

    # -- other writers' chunks (tutti.engine.sharing.ForeignIndex.take_events) ------------------
    def translate_foreign(self, events: Iterable[tuple[str, bytes, dict]],
                          own: Any = lambda key: False) -> list[KVCacheEvent]:
        """Announce chunks another writer holds (any replica can load them) from the extras it
        recorded; skipped: chunks this server holds itself (`own(key)`: it announces those),
        extras that do not parse (hostile input), and hashes chained from another hash seed
        (they would match nothing a router computes for this server)."""
        out: list[KVCacheEvent] = []
        if self._seed is None:
            self._seed = hash_seed_digest()
        for kind, key, x in events:
            if own(key):
                continue
            try:
                hashes = [_dec(h) for h in x["h"]]
                if not 0 < len(hashes) <= 4096:
                    raise ValueError("block hash count")
                if x.get("s") != self._seed:
                    writer_seed = str(x.get("s"))[:32]
                    if self._seed is not None and writer_seed not in self._foreign_seeds_warned:
                        self._foreign_seeds_warned.add(writer_seed)
                        logger.warning("tutti: another writer chains vLLM block hashes from another seed (set the "
                                       "same PYTHONHASHSEED on every replica): its chunks load here but are not "
                                       "announced")
                    continue
                if kind == "removed":
                    out.append(BlockRemoved(block_hashes=hashes, medium=self.medium))
                    continue
                parent = None if x.get("p") is None else _dec(x["p"])
                tokens = x.get("t") or []
                bs = x.get("bs")
                lora_id, lora_name = x.get("l"), x.get("ln")
                if (not isinstance(tokens, list) or len(tokens) > self.chunk_tokens
                        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens)
                        or not isinstance(bs, int) or isinstance(bs, bool) or not 0 < bs <= 1 << 20
                        or not (lora_id is None or (isinstance(lora_id, int) and not isinstance(lora_id, bool)))
                        or not (lora_name is None or (isinstance(lora_name, str) and len(lora_name) <= 1024))):
                    raise ValueError("fields")
            except (KeyError, TypeError, ValueError):
                continue
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=list(tokens),
                                   block_size=bs, lora_id=lora_id, medium=self.medium, lora_name=lora_name))
        return out


def expand_topic(topic: str, model: str, writer: str = "") -> str:
    """`{host}`, `{model}` and `{writer}` (the writer id this server took; `0` for the
    namespace's own slot) in a topic: one config for every replica, a topic each."""
    return (topic.replace("{host}", socket.gethostname()).replace("{model}", model)
            .replace("{writer}", writer or "0"))


class EventPublisher:
    """tutti's own KV event stream: a vLLM ZmqEventPublisher (same wire format, replay buffer,
    sequence numbers, data-parallel port offset) fed from take_events().

    Like any ZMQ PUB, batches sent before a subscriber's subscription has reached the socket
    are dropped; subscribers detect gaps by sequence number and can ask the replay endpoint
    (`replay_endpoint`) for them.
    """

    def __init__(self, endpoint: str, *, topic: str = "", data_parallel_rank: int = 0,
                 replay_endpoint: str | None = None) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher

        self.endpoint = endpoint
        self.topic = topic
        self._pub = ZmqEventPublisher(data_parallel_rank=data_parallel_rank, endpoint=endpoint,
                                      replay_endpoint=replay_endpoint, topic=topic)

    def publish(self, events: list[KVCacheEvent]) -> None:
        import time

        from vllm.distributed.kv_events import KVEventBatch

        if events:
            self._pub.publish(KVEventBatch(ts=time.time(), events=list(events)))

    def shutdown(self) -> None:
        self._pub.shutdown()
