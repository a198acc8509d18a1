"""A Mamba hybrid on the real vLLM CPU engine (TuttiHybridConnectorV1, hybrid KV cache manager on,
prefix caching on so vLLM keeps states at block boundaries: mamba_cache_mode "align"): a tiny
NemotronH (Mamba2, attention, Mamba2, MLP; vLLM makes three KV cache groups of it), weights
written by transformers with the mixers scaled up so that its tokens depend on the Mamba state.

Each phase runs in its own process: engines in one process reuse the same cache memory, so a
state left from an earlier engine would hide a load that never happened. Proven: a fresh process
hits 320 of 327 tokens on 3 prompts and its greedy tokens equal recompute's; the same hit with
the state loads left out gives other tokens (the test is able to fail); damaged state segments
fail their requests' loads and vLLM recomputes them (tokens equal); a state group without
'align' mode is refused at start, naming what to do.

The CPU build needs max_num_batched_tokens <= block size for Mamba2 with prefix caching (its
CPU scan returns no mid-prefill states): every step then ends on a block boundary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import phases

CHUNK = 64  # two vLLM blocks of 32
PROMPT = 5 * CHUNK + 7
PROMPTS = [[10 + (7 * i + 13 * s) % 1000 for i in range(PROMPT)] for s in range(3)]
ENGINE = dict(load_format="auto", skip_tokenizer_init=True, max_model_len=1024, max_num_batched_tokens=32,
              max_num_seqs=8)


def nemotron_h(dir: Path) -> Path:
    """A tiny NemotronH checkpoint: pattern M*M- (Mamba2, attention, Mamba2, MLP), 4 KV heads of 64
    (so the Mamba state fits one 32-token attention page), fp32; in/out projections of the mixers
    scaled x25 so the tokens depend on what the mixers carry (the Mamba state among it)."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=1024, hidden_size=256, hybrid_override_pattern="M*M-", num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=64, intermediate_size=512, mlp_hidden_act="relu2",
        mamba_num_heads=8, mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4, expand=1, chunk_size=64,
        use_conv_bias=True, use_bias=False, mamba_hidden_act="silu", layer_norm_epsilon=1e-5,
        max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32",
        mamba_ssm_cache_dtype="float32", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(0)
    NemotronHForCausalLM(cfg).save_pretrained(dir)
    phases.scale_mixers(dir / "model.safetensors", 25, ("in_proj.weight", "out_proj.weight", "o_proj.weight"))
    return dir


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm")
    pytest.importorskip("transformers").NemotronHConfig  # noqa: B018 - needs transformers with NemotronH
    return nemotron_h(tmp_path_factory.mktemp("nemotron_h"))


def run(phase: str, model: Path, root: Path) -> dict:
    engine = dict(ENGINE)
    if phase == "noalign":
        engine.update(enable_prefix_caching=False, mamba_cache_mode="none", max_num_batched_tokens=1024)
    return phases.run(model, root, PROMPTS, connector=None if phase == "none" else "TuttiHybridConnectorV1",
                      chunk=CHUNK, engine=engine, drop="state" if phase == "nostate" else None)


@pytest.fixture(scope="module")
def stored(model, tmp_path_factory):
    """Recompute (no connector) and a store by a first process: (recompute's result, the store's, root)."""
    root = tmp_path_factory.mktemp("state-kv") / "kv"
    want = run("none", model, root)
    assert "error" not in want, want.get("error")
    s = run("store", model, root)
    assert "error" not in s, s.get("error")
    return want, s, root


def test_a_mamba_hybrid_stores_states_and_hits(model, stored):
    want, s, root = stored
    assert sorted(want["groups"]) == ["FullAttentionSpec:", "MambaSpec:align", "MambaSpec:align"]
    # 5 chunks per prompt and, every step ending on a block boundary, the state at each chunk's end
    assert s["tokens"] == want["tokens"] and s["stats"]["stores_committed"] == 3 * (5 + 5)
    # written: a chunk entry's attention layer, a state entry's two Mamba layers (not the rest of a slot)
    seg = json.loads(next(root.rglob("manifest.json")).read_text())["segment_bytes"]
    assert s["stats"]["bytes_stored"] == 3 * 5 * (1 + 2) * seg
    from tutti.tools.storetools import verify_store

    v = verify_store([str(root)], progress=False)
    assert (v.slots, v.mismatches, v.errors) == (30, [], [])
    h = run("hit", model, root)
    assert "error" not in h, h.get("error")
    assert h["cached"] == [5 * CHUNK] * 3 and h["stats"]["loads_failed"] == 0
    assert h["tokens"] == want["tokens"]
    ctl = run("nostate", model, root)
    assert ctl["cached"] == [5 * CHUNK] * 3 and ctl["stats"]["bytes_loaded"] < h["stats"]["bytes_loaded"]
    assert ctl["tokens"] != want["tokens"], "the tokens do not depend on the Mamba state: this test proves nothing"


def test_a_damaged_state_is_recomputed(model, stored, tmp_path):
    import shutil

    want, _, src = stored
    root = tmp_path / "kv"
    shutil.copytree(src, root)
    # layer 0 (Mamba) of every slot: a chunk entry never reads it (its state groups hold the null
    # block), a state entry does, so exactly the state loads fail
    slabs = sorted(root.rglob("slab-*.bin"))
    manifest = json.loads((slabs[0].parent / "manifest.json").read_text())
    slot, seg = manifest["slot_bytes"], manifest["segment_bytes"]
    damaged = 0
    for slab in slabs:
        data = bytearray(slab.read_bytes())
        for off in range(0, len(data) - seg + 1, slot):
            data[off + seg - 100] ^= 0x41  # the segment's last block: where a state entry keeps the state
            damaged += 1
        slab.write_bytes(bytes(data))
    assert damaged >= 30
    h = run("hit", model, root)
    assert "error" not in h, h.get("error")
    assert h["tokens"] == want["tokens"], "a damaged state reached an output"
    # each failed state is dropped and the request looked up again: it then tries the state one
    # chunk earlier, damaged as well, until none is left (3 prompts x 5 states), and is recomputed
    assert h["stats"]["loads_failed"] == 3 * 5 and h["cached"] == [0, 0, 0]


def test_a_state_group_without_align_mode_is_refused(model, tmp_path):
    r = run("noalign", model, tmp_path / "kv")
    assert "error" in r and "mamba_cache_mode='none'" in r["error"] and "enable_prefix_caching=True" in r["error"]
    assert not (tmp_path / "kv").exists()  # refused before any IO
