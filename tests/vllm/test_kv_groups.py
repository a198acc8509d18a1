"""Which KV cache groups tutti takes (vLLM's own spec classes): full and sliding-window attention;
a Mamba state group, or any other kind, stops the server at start with a message naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec

from tutti.vllm import compat


def config(*groups):
    return SimpleNamespace(kv_cache_groups=list(groups))


def full(names):
    return KVCacheGroupSpec(names, FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))


def sliding(names, window=64):
    return KVCacheGroupSpec(names, SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64,
                                                     dtype=torch.bfloat16, sliding_window=window))


def test_full_and_sliding_groups_in_model_layer_order():
    groups = compat.kv_groups(config(sliding(["model.layers.0.attn", "model.layers.2.attn"]),
                                     full(["model.layers.1.attn"])))
    assert groups == [("sw64", ["model.layers.0.attn", "model.layers.2.attn"]), ("full", ["model.layers.1.attn"])]
    assert compat.groups_string(groups) == "0:sw64,1:full,0:sw64"
    assert compat.groups_string(compat.kv_groups(config(full(["model.layers.0.attn"])))) == ""  # unchanged namespaces


def test_a_state_space_group_is_refused_naming_it():
    mamba = KVCacheGroupSpec(["model.layers.1.mixer"], MambaSpec(block_size=16, shapes=((4, 8),),
                                                                 dtypes=(torch.float32,)))
    with pytest.raises(ValueError, match=r"KV cache group 1 of this model is a Mamba/linear-attention state group "
                                         r"\(layers \['model.layers.1.mixer'\]\)"):
        compat.kv_groups(config(full(["model.layers.0.attn"]), mamba))
