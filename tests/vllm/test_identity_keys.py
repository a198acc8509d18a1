"""A chunk's identity is vLLM's block identity: what tutti keys, checked against vLLM's code.

The engine cases (cache salt, LoRA adapters, an adapter replaced in place) are
tests/reliability/test_identity.py, which writes their row of docs/reliability.md; the
multimodal case is test_identity_mm.py.
"""

from __future__ import annotations

import inspect


def test_vllm_block_hash_inputs_are_what_tutti_keys_cover():
    """tutti keys token ids plus vLLM's own per-block extra keys (it calls the function vLLM's
    block hash uses). This fails if vLLM's block hash starts taking another input, which tutti
    would then have to cover too."""
    from vllm.v1.core import kv_cache_utils as kcu

    assert list(inspect.signature(kcu.hash_block_tokens).parameters) == [
        "hash_function", "parent_block_hash", "curr_block_token_ids", "extra_keys"]
    assert list(inspect.signature(kcu.generate_block_hash_extra_keys).parameters) == [
        "request", "start_token_idx", "end_token_idx", "start_mm_idx"]
    src = inspect.getsource(kcu.generate_block_hash_extra_keys)
    for part in ("_gen_mm_extra_hash_keys", "_gen_lora_extra_hash_keys", "cache_salt",
                 "_gen_prompt_embeds_extra_hash_keys"):
        assert part in src, part


def test_request_identity_follows_vllm_extra_keys():
    """The identity bytes differ exactly where vLLM's extra keys (or the adapter) differ."""
    from types import SimpleNamespace

    from tutti.vllm.identity import request_identity

    def req(**kw):
        base = dict(lora_request=None, mm_features=None, cache_salt=None, prompt_embeds=None)
        base.update(kw)
        return SimpleNamespace(**base)

    assert request_identity(req(), 32) is None  # token ids alone
    a, b = request_identity(req(cache_salt="a"), 32), request_identity(req(cache_salt="b"), 32)
    assert a(0, 64) != b(0, 64)
    assert a(64, 128) == b(64, 128)  # the salt keys the first block; the chain carries it on
