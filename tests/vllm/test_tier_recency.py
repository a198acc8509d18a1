"""TuttiTier's recency without touch(): vLLM 0.34 removed touch() from the offloading managers and
SecondaryTierManager, so a tier learns what is used from the loads it is asked for (a promotion is
this tier's hit). Driven through vLLM's tier interface as tests/vllm/test_tier.py does; on
vLLM 0.26-0.33 touch() is still called and still works (test_tier.py)."""

from __future__ import annotations

import inspect

from vllm.v1.kv_offload.base import LookupResult

from test_tier import KEYS, job, primary, run, tier


def test_a_loaded_prefix_is_kept_over_one_never_loaded(tmp_path):
    region = primary()
    slot_bytes = -(-(3 * 4096 + 512) // 4096) * 4096
    t = tier(tmp_path, region, capacity=3 * slot_bytes)
    assert run(t, job(1, [KEYS[0]], [0], False))
    assert run(t, job(2, KEYS[1:3], [1, 2], False))  # stored after KEYS[0]: more recent
    assert run(t, job(3, [KEYS[0]], [8], True))  # a load (a promotion, vLLM 0.34's only signal)
    assert run(t, job(4, [KEYS[3]], [3], False))  # full: evicts the tail of the prefix not loaded
    assert [t.lookup(k, None) == LookupResult.HIT for k in KEYS] == [True, True, False, True]
    assert run(t, job(5, KEYS[:2], [9, 10], True))  # a hit on the prefix
    assert run(t, job(6, [KEYS[2]], [2], False))  # evicts KEYS[3]: the prefix was loaded since
    assert [t.lookup(k, None) == LookupResult.HIT for k in KEYS] == [True, True, True, False]
    t.shutdown()


def test_a_load_job_touches_its_keys_as_a_prefix(tmp_path):
    """A job's keys come in prefix order: touched tail first, so the head is the most recent and a
    full tier gives the prefix up from its end."""
    region = primary()
    slot_bytes = -(-(3 * 4096 + 512) // 4096) * 4096
    t = tier(tmp_path, region, capacity=4 * slot_bytes)
    assert run(t, job(1, KEYS[:3], [0, 1, 2], False))
    assert run(t, job(2, [KEYS[3]], [3], False))
    assert run(t, job(3, KEYS[:3], [8, 9, 10], True))
    order = list(t._index.eviction.order())  # the first to evict first: KEYS[3], then the prefix from its end
    assert order == [t._key(k) for k in (KEYS[3], KEYS[2], KEYS[1], KEYS[0])]
    t.shutdown()


def test_this_vllm_and_compat_agree_on_touch():
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    from tutti.vllm import compat

    assert compat.tier_touched_by_vllm() == ("touch" in dict(inspect.getmembers(SecondaryTierManager)))
