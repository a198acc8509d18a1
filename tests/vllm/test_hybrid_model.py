"""A hybrid model on the real vLLM CPU engine with its hybrid KV cache manager ON
(TuttiHybridConnectorV1): a tiny random Gemma 3 (three sliding-window layers, window 64, and one
full-attention layer; vLLM makes four KV cache groups of it). Stored by one engine, loaded by a
fresh process: hits (loaded asynchronously: vLLM takes failures of several-group models per request
only), and greedy tokens equal to the same prompts without the connector, and differ when the
hits' loads are left out (weights from transformers, attention scaled up); a corrupted chunk
fails its request's load and vLLM recomputes it. TuttiConnectorV1 leaves the hybrid manager off,
as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import phases

CHUNK = 64  # tokens: two vLLM blocks of 32; the window (64 tokens) spans one chunk
PROMPT = 5 * CHUNK + 7  # five whole chunks: a hit ends past several windows


def gemma3(dir: Path) -> Path:
    """A tiny Gemma 3 checkpoint written by transformers (three sliding-window layers of window 64,
    one full-attention layer), attention's value and output projections scaled x25 so its tokens
    depend on the KV a hit loads (at initialization attention barely moves the logits)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1024, max_position_embeddings=2048, sliding_window=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=64, torch_dtype="float32", bos_token_id=2,
        eos_token_id=1, pad_token_id=0, hidden_activation="gelu_pytorch_tanh")
    cfg.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).save_pretrained(dir)
    phases.scale_mixers(dir / "model.safetensors", 25, ("v_proj.weight", "o_proj.weight"))
    return dir


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    return gemma3(tmp_path_factory.mktemp("gemma3"))


def prompts():
    return [[10 + (7 * i + 13 * s) % 1000 for i in range(PROMPT)] for s in range(3)]


ENGINE = dict(load_format="auto", skip_tokenizer_init=True, max_model_len=1024)


@pytest.fixture(scope="module")
def recomputed(model, tmp_path_factory):
    """The three prompts without a connector, once for every test (each runs all three, so the
    batches match)."""
    return run(model, tmp_path_factory.mktemp("none") / "kv", prompts(), connector=None)


def run(model, root, ps, connector="TuttiHybridConnectorV1", drop=None):
    """One engine in its own process (see phases): tokens, cached tokens, KV cache groups, stats."""
    r = phases.run(model, root, ps, connector=connector, chunk=CHUNK, engine=ENGINE, drop=drop)
    assert "error" not in r, r.get("error")
    return r["tokens"], r["cached"], r["groups"], r["stats"]


def test_a_sliding_window_model_stores_and_hits_with_the_hybrid_manager_on(model, recomputed, tmp_path):
    ps = prompts()
    root = tmp_path / "kv"
    want, _, groups, _ = recomputed
    kinds = sorted(g.split(":")[0] for g in groups)
    assert len(groups) > 1 and "SlidingWindowSpec" in kinds and "FullAttentionSpec" in kinds
    got, cached, groups, s1 = run(model, root, ps)  # a fresh store: computed and stored
    assert len(groups) > 1, "the hybrid KV cache manager was turned off with tutti connected"
    assert got == want and cached == [0, 0, 0] and s1["stores_committed"] == 3 * 5
    got, cached, _, s2 = run(model, root, ps)  # a fresh process: every whole chunk is a hit
    assert cached == [5 * CHUNK] * 3 and s2["loads_failed"] == 0
    assert got == want
    # a sliding-window layer read only the chunks inside its window at the hit's end (the last
    # one), the full-attention layer all five: 3 x (5 + 3 x 1) of 3 x 5 x 4 segments
    seg = s2["bytes_loaded"] // (3 * (5 + 3))
    assert s2["bytes_loaded"] == 3 * (5 + 3) * seg
    # the negative control: the same hits with their loads leaving the blocks alone
    ctl, cached, _, _ = run(model, root, ps, drop="kv")
    assert cached == [5 * CHUNK] * 3
    assert ctl != want, "the tokens do not depend on the loaded KV: this test proves nothing"


def test_a_corrupted_chunk_of_a_hybrid_model_is_recomputed(model, recomputed, tmp_path):
    ps = prompts()
    root = tmp_path / "kv"
    want = recomputed[0]
    run(model, root, ps)
    slab = next(root.rglob("slab-*.bin"))
    seg = json.loads((slab.parent / "manifest.json").read_text())["segment_bytes"]
    data = bytearray(slab.read_bytes())
    data[3 * seg + 100] ^= 0x41  # slot 0 (the first prompt's first chunk), layer 3: full attention, always read
    data[0 * seg + 100] ^= 0x41  # and its layer 0: sliding window, outside the window at the hit's end: never read
    slab.write_bytes(bytes(data))
    got, cached, _, s = run(model, root, ps)
    assert got == want, "a damaged chunk reached an output"
    assert s["loads_failed"] == 1 and cached.count(5 * CHUNK) == 2  # the other prompts still hit


def test_tutti_connector_v1_keeps_vllms_hybrid_manager_off(model, recomputed, tmp_path):
    """The default connector declares no hybrid support: vLLM turns the hybrid manager off (one
    group, sliding-window layers kept as full attention) and tutti works as for any model."""
    ps = prompts()
    root = tmp_path / "kv"
    want = recomputed[0]
    got, _, groups, _ = run(model, root, ps, connector="TuttiConnectorV1")
    assert len(groups) == 1 and got == want
    got, cached, _, _ = run(model, root, ps, connector="TuttiConnectorV1")
    assert cached == [5 * CHUNK] * 3 and got == want
