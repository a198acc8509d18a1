"""TuttiTier, tutti's store as a secondary tier of vLLM's OffloadingConnector, driven through vLLM's
own tier interface (vllm 0.32: TransferJob, JobResult, LookupResult) over a real memory region
standing in for the CPU tier and real files. The OffloadingConnector itself needs CUDA, so the
end-to-end run (store, a fresh process, hits, identical tokens, a corrupted chunk recomputed) is
scripts/gpu_tier.py on the H200."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from vllm.v1.kv_offload.base import LookupResult, ReqContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from tutti.vllm.tier import TuttiTier

CHUNK = 3 * 4096 + 512  # an offloaded chunk of vLLM's CPU tier: not a 4 KiB multiple
SLOTS = 16


def spec():
    cfg = SimpleNamespace(model=SimpleNamespace(name="tiny-tier", dtype="bfloat16"),
                          parallel=SimpleNamespace(rank=0, tp_size=1, pp_size=1))
    return SimpleNamespace(config=cfg, tokens_per_block=(16,), blocks_per_chunk=1)


def primary(seed=0):
    return np.random.default_rng(seed).integers(0, 256, (SLOTS, CHUNK), dtype=np.uint8)


def tier(root, region, **kw):
    return TuttiTier(spec(), memoryview(region), "TuttiTier", root=str(root), capacity_bytes=kw.pop("capacity", "1MiB"),
                     **kw)


def run(t, job):
    (t.submit_load if job.is_promotion else t.submit_store)(job)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done = list(t.get_finished_jobs())
        if done:
            assert [r.job_id for r in done] == [job.job_id]
            return done[0].success
        time.sleep(0.005)
    raise AssertionError("job did not finish")


def job(job_id, keys, slots, promotion):
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(slots), is_promotion=promotion,
                       req_context=ReqContext(req_id=f"r{job_id}"))


KEYS = [bytes([i]) * 36 for i in range(4)]


def test_store_then_a_fresh_tier_loads_bit_exact(tmp_path):
    region = primary()
    t = tier(tmp_path, region)
    assert all(t.lookup(k, None) == LookupResult.MISS for k in KEYS)
    assert run(t, job(1, KEYS, [0, 1, 2, 3], False))
    assert all(t.lookup(k, None) == LookupResult.HIT for k in KEYS)
    want = region[:4].copy()
    t.shutdown()
    region2 = np.zeros_like(region)
    t2 = tier(tmp_path, region2)  # a fresh process: the index comes back from the journal
    assert all(t2.lookup(k, None) == LookupResult.HIT for k in KEYS)
    assert run(t2, job(2, KEYS, [8, 9, 10, 11], True))
    assert np.array_equal(region2[8:12], want)
    t2.shutdown()


def test_a_corrupted_chunk_fails_its_load_and_is_not_served_again(tmp_path):
    region = primary()
    t = tier(tmp_path, region)
    assert run(t, job(1, KEYS, [0, 1, 2, 3], False))
    slot = t._index.slot_of(t._key(KEYS[2]))
    fd, off = t._store.location(slot)
    with open(t._store.slab_path(slot), "r+b") as f:
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 0x10]))
    assert not run(t, job(2, [KEYS[2]], [12], True))  # vLLM treats a failed promotion as a miss
    assert t.lookup(KEYS[2], None) == LookupResult.MISS and t.loads_failed == 1
    assert run(t, job(3, [KEYS[0]], [13], True)) and np.array_equal(region[13], region[0])
    t.shutdown()
    t2 = tier(tmp_path, region)  # journaled free: a restart does not serve it either
    assert t2.lookup(KEYS[2], None) == LookupResult.MISS and t2.lookup(KEYS[0], None) == LookupResult.HIT
    t2.shutdown()


def test_capacity_evicts_least_recently_used_and_a_prefix_from_its_end(tmp_path):
    region = primary()
    slot_bytes = -(-CHUNK // 4096) * 4096
    t = tier(tmp_path, region, capacity=3 * slot_bytes)
    assert run(t, job(1, KEYS[:3], [0, 1, 2], False))  # a prefix, in order: given up from its end
    t.touch([KEYS[0]], None)
    assert run(t, job(2, [KEYS[3]], [3], False))  # evicts KEYS[2], the prefix's last chunk
    assert [t.lookup(k, None) == LookupResult.HIT for k in KEYS] == [True, True, False, True]
    t.touch([KEYS[0], KEYS[1]], None)  # a hit on the prefix: its head the most recent
    assert run(t, job(3, [KEYS[2]], [2], False))  # evicts KEYS[3], least recently used
    assert [t.lookup(k, None) == LookupResult.HIT for k in KEYS] == [True, True, True, False]
    t.shutdown()


def test_bad_configuration_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"capacity_bytes: missing"):
        TuttiTier(spec(), memoryview(primary()), "TuttiTier", root=str(tmp_path))
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rot'\]"):
        TuttiTier(spec(), memoryview(primary()), "TuttiTier", rot=str(tmp_path), capacity_bytes="1MiB")
    with pytest.raises(ValueError, match=r"root=None: expected a directory"):
        TuttiTier(spec(), memoryview(primary()), "TuttiTier", capacity_bytes="1MiB")


def test_vllms_factory_builds_it_from_a_secondary_tiers_entry(tmp_path):
    """The dict a user writes in secondary_tiers, through vLLM's own SecondaryTierFactory."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    region = primary()
    t = SecondaryTierFactory.create_secondary_tier(
        {"type": "TuttiTier", "module_path": "tutti.vllm.tier", "root": str(tmp_path), "capacity_bytes": "1MiB",
         "locality": "LOCAL"}, memoryview(region), spec())
    assert isinstance(t, TuttiTier) and t.tier_type == "TuttiTier"
    assert run(t, job(1, KEYS[:1], [0], False)) and t.lookup(KEYS[0], None) == LookupResult.HIT
    t.shutdown()


def test_an_auto_dtype_is_resolved_from_vllms_config(tmp_path):
    """vLLM 0.26 hands the tier dtype 'auto' (the model's); the namespace must still name the real
    dtype, so fp16 and bf16 KV of one model never share chunks (found on the H200)."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config

    s = spec()
    s.config.model.dtype = "auto"
    cfg = VllmConfig()
    for dtype, want in ((torch.float16, "float16"), (torch.bfloat16, "bfloat16")):
        cfg.model_config = SimpleNamespace(dtype=dtype)
        with set_current_vllm_config(cfg):
            t = TuttiTier(s, memoryview(primary()), "TuttiTier", root=str(tmp_path / want), capacity_bytes="1MiB")
        assert t._store.fingerprint.cache_dtype == want
        t.shutdown()


def test_an_auto_dtype_is_resolved_from_the_constructing_connector(tmp_path):
    """vLLM 0.26 builds the scheduler outside set_current_vllm_config: the tier finds the config
    the OffloadingConnector that constructs it holds (found on the H200: 'auto' refused there)."""
    import torch
    from vllm.config import VllmConfig

    s = spec()
    s.config.model.dtype = "auto"

    def offloading_connector_init(vllm_config):  # stands where vLLM's connector constructor stands
        return TuttiTier(s, memoryview(primary()), "TuttiTier", root=str(tmp_path / "c"), capacity_bytes="1MiB")

    cfg = VllmConfig()
    cfg.model_config = SimpleNamespace(dtype=torch.float16)
    t = offloading_connector_init(cfg)
    assert t._store.fingerprint.cache_dtype == "float16"
    t.shutdown()


def test_an_unresolvable_dtype_needs_the_tiers_own_key(tmp_path):
    s = spec()
    s.config.model.dtype = "auto"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        TuttiTier(s, memoryview(primary()), "TuttiTier", root=str(tmp_path / "a"), capacity_bytes="1MiB")
    assert not (tmp_path / "a").exists()  # refused before any IO
    t = TuttiTier(s, memoryview(primary()), "TuttiTier", root=str(tmp_path / "b"), capacity_bytes="1MiB",
                  kv_cache_dtype="bfloat16")
    assert t._store.fingerprint.cache_dtype == "bfloat16"
    t.shutdown()
    s.config.model.dtype = "float16"  # vLLM says float16: a key saying otherwise is refused, naming both
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16'.*'float16'"):
        TuttiTier(s, memoryview(primary()), "TuttiTier", root=str(tmp_path / "c"), capacity_bytes="1MiB",
                  kv_cache_dtype="bfloat16")


def test_direct_io_where_the_cpu_tier_is_aligned(tmp_path):
    """O_DIRECT (as vLLM's fs tier) when vLLM's CPU tier hands 4 KiB aligned chunks; buffered
    otherwise; bytes equal either way, through a fresh tier that rebuilds from the journal."""
    import os

    chunk = 4 * 4096
    raw = np.empty(SLOTS * chunk + 4096, dtype=np.uint8)
    off = (-raw.ctypes.data) % 4096
    region = raw[off:off + SLOTS * chunk].reshape(SLOTS, chunk)
    region[:] = np.random.default_rng(3).integers(0, 256, region.shape, dtype=np.uint8)
    want = region.copy()
    t = TuttiTier(spec(), memoryview(region), "TuttiTier", root=str(tmp_path / "d"), capacity_bytes="1MiB")
    assert t.direct
    assert run(t, job(1, KEYS, [0, 1, 2, 3], False))
    fd = t._store.location(0)[0]
    assert os.O_DIRECT & __import__("fcntl").fcntl(fd, __import__("fcntl").F_GETFL)
    t.shutdown()
    region[:] = 0
    t = TuttiTier(spec(), memoryview(region), "TuttiTier", root=str(tmp_path / "d"), capacity_bytes="1MiB")
    assert run(t, job(2, KEYS, [4, 5, 6, 7], True))
    assert np.array_equal(region[4:8], want[:4])
    t.shutdown()
    unaligned = TuttiTier(spec(), memoryview(primary()), "TuttiTier", root=str(tmp_path / "u"), capacity_bytes="1MiB")
    assert not unaligned.direct  # CHUNK is not a 4 KiB multiple
    unaligned.shutdown()
    with pytest.raises(ValueError, match=r"direct='yes'"):
        TuttiTier(spec(), memoryview(region), "TuttiTier", root=str(tmp_path / "x"), capacity_bytes="1MiB",
                  direct="yes")


def test_tutti_verify_checks_a_tier_store(tmp_path):
    """`tutti verify` knows the tier's CRC tags: a clean tier store passes, a flipped byte is named."""
    from tutti.tools.storetools import verify_store

    t = tier(tmp_path, primary())
    assert run(t, job(1, KEYS, [0, 1, 2, 3], False))
    slot_path, off = t._store.slab_path(2), t._store.location(2)[1]
    t.shutdown()
    res = verify_store([str(tmp_path)], progress=False)
    assert (res.slots, res.mismatches, res.errors) == (4, [], [])
    with open(slot_path, "r+b") as f:
        f.seek(off + 100)
        b = f.read(1)
        f.seek(off + 100)
        f.write(bytes([b[0] ^ 1]))
    res = verify_store([str(tmp_path)], progress=False)
    assert len(res.mismatches) == 1 and "checksum mismatch" in res.mismatches[0].detail and res.mismatches[0].slot == 2


def test_a_checkpoint_replaced_at_the_same_path_is_another_namespace(tmp_path):
    """Hardening round two, item 6: the tier's namespace names the weights (identity.model_identity,
    as the connector's does), so after a checkpoint is replaced under the same path its old
    chunks are not hits; context parallelism is refused as the connector refuses it."""
    from vllm.config import VllmConfig, set_current_vllm_config

    model = tmp_path / "model"
    model.mkdir()
    digests = []
    for weights in (b"old weights", b"new weights!"):
        (model / "model.safetensors").write_bytes(weights)
        cfg = VllmConfig()
        cfg.model_config = SimpleNamespace(model=str(model), dtype="bfloat16", quantization=None, hf_overrides=None,
                                           revision=None)
        with set_current_vllm_config(cfg):
            t = TuttiTier(spec(), memoryview(primary()), "TuttiTier", root=str(tmp_path / "t"), capacity_bytes="1MiB")
        digests.append(t._store.fingerprint.digest())
        t.shutdown()
    assert digests[0] != digests[1]
    cfg.parallel_config.decode_context_parallel_size = 2
    with set_current_vllm_config(cfg), pytest.raises(ValueError, match="decode_context_parallel_size=2"):
        TuttiTier(spec(), memoryview(primary()), "TuttiTier", root=str(tmp_path / "u"), capacity_bytes="1MiB")


def test_a_load_job_for_a_chunk_no_longer_held_fails(tmp_path):
    """Round two, item 9: a promotion asked for a key the tier has since evicted (or never held)
    reports failure, so vLLM never takes the CPU-tier slot's stale bytes as that chunk."""
    region = primary()
    t = tier(tmp_path, region)
    assert run(t, job(1, KEYS[:1], [0], False))
    assert not run(t, job(2, [KEYS[0], KEYS[3]], [12, 13], True))  # KEYS[3] was never stored
    assert run(t, job(3, [KEYS[0]], [14], True)) and np.array_equal(region[14], region[0])
    t.shutdown()
