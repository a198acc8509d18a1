"""Which KV cache groups tutti takes (vLLM's own spec classes): full and sliding-window attention
and Mamba state groups in vLLM's 'align' mode; a state group in another mode, or any other kind,
stops the server at start with a message naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from tutti.vllm import layout


def config(*groups):
    return SimpleNamespace(kv_cache_groups=list(groups))


def full(names):
    return KVCacheGroupSpec(names, FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))


def sliding(names, window=64):
    return KVCacheGroupSpec(names, SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                     dtype=torch.bfloat16, sliding_window=window))


def test_full_and_sliding_groups_in_model_layer_order():
    groups = layout.kv_groups(config(sliding(["model.layers.0.attn", "model.layers.2.attn"]),
                                     full(["model.layers.1.attn"])))
    assert groups == [("sw64", ["model.layers.0.attn", "model.layers.2.attn"]), ("full", ["model.layers.1.attn"])]
    assert layout.groups_string(groups) == "0:sw64,1:full,0:sw64"
    assert layout.groups_string(layout.kv_groups(config(full(["model.layers.0.attn"])))) == ""  # unchanged namespaces


def mamba(mode):
    return KVCacheGroupSpec(["model.layers.1.mixer"], MambaSpec(block_size=16, shapes=((4, 8),),
                                                                dtypes=(torch.float32,), mamba_cache_mode=mode))


def test_a_state_group_in_align_mode_is_a_state_group():
    groups = layout.kv_groups(config(full(["model.layers.0.attn"]), mamba("align")))
    assert groups == [("full", ["model.layers.0.attn"]), ("state", ["model.layers.1.mixer"])]
    assert layout.groups_string(groups) == "0:full,1:state"


def test_a_state_group_without_align_mode_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"KV cache group 1 \(layers \['model.layers.1.mixer'\]\) holds "
                                         r"Mamba/linear-attention state with mamba_cache_mode='none'.*"
                                         r"enable_prefix_caching=True"):
        layout.kv_groups(config(full(["model.layers.0.attn"]), mamba("none")))


def test_another_group_kind_is_refused_naming_it():
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    local = KVCacheGroupSpec(["model.layers.1.attn"], ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, attention_chunk_size=64))
    with pytest.raises(ValueError, match=r"KV cache group 1 of this model is a ChunkedLocalAttentionSpec group"):
        layout.kv_groups(config(full(["model.layers.0.attn"]), local))


def test_a_state_page_is_seen_as_an_attention_page():
    """vLLM pads a state page to the attention page; the view makes block b the state's page b."""
    attn = torch.zeros(6, 4, 16, 32, dtype=torch.bfloat16)  # 4 KiB pages, block-first
    raw = torch.zeros(6 * 4096, dtype=torch.int8)
    state = raw.as_strided((6, 1, 1, 1000), (4096, 1000, 1000, 1))  # a state of 1000 B in each page
    v = layout.state_page_view(state, attn, "model.layers.1.mixer")
    assert v.shape == attn.shape and v.stride() == attn.stride() and v.dtype == attn.dtype
    state[3, 0, 0, :] = 7
    assert (v[3].view(torch.int8).reshape(-1)[:1000] == 7).all() and not v[2].view(torch.int8).any()
    # FlashAttention's (2, blocks, tokens, heads, dim) as vLLM re-strides it for hybrid models: K and V
    # of a block in its page
    fa = torch.zeros(6, 2, 16, 2, 32, dtype=torch.bfloat16).permute(1, 0, 2, 3, 4)
    v = layout.state_page_view(state, fa, "model.layers.1.mixer")
    assert v.shape == fa.shape and v.stride() == fa.stride()
    assert (v[:, 3].contiguous().view(torch.int8).reshape(-1)[:1000] == 7).all()
    flat = torch.zeros(2, 6, 16, 4, 32, dtype=torch.bfloat16)  # K and V halves apart: a page is not one block
    with pytest.raises(ValueError, match="do not share one contiguous page per block"):
        layout.state_page_view(state, flat, "model.layers.1.mixer")
