"""A newcomer's kernel variant, written from the public kit alone (tutti.kernels: check_args,
layer_byte_views, kernel_block_ids), registered by name and proven with check_variant."""

from __future__ import annotations

import torch

from tutti import kernels as K


def prepare(caches, layout, block_ids, seg, k, name, id_range):
    """What both directions start from: the checked plan, byte views of the layers, kernel block ids."""
    plan = K.check_args(caches, layout, block_ids, seg, k, name, id_range)
    return plan, K.layer_byte_views(caches, layout), K.kernel_block_ids(block_ids, k)


@K.register_variant("kit-example", description="a loop over chunks, from the documented kit")
class LoopVariant:
    def gather(self, caches, layout, block_ids, out, *, kernel_blocks_per_block=1, id_range=None, **_):
        plan, views, ids = prepare(caches, layout, block_ids, out, kernel_blocks_per_block, "out", id_range)
        for layer, v in enumerate(views):
            for n in range(plan.num_chunks):
                # (blocks, tokens, heads, pieces, bytes) -> the chunk's tokens in [token, head, content] order
                data = v[ids[n]].reshape(-1)
                plan.seg[layer, n, : plan.data_bytes] = data
                plan.seg[layer, n, plan.data_bytes:] = 0

    def scatter(self, caches, layout, block_ids, src, *, kernel_blocks_per_block=1, id_range=None, **_):
        plan, views, ids = prepare(caches, layout, block_ids, src, kernel_blocks_per_block, "src", id_range)
        for layer, v in enumerate(views):
            for n in range(plan.num_chunks):
                v[ids[n]] = plan.seg[layer, n, : plan.data_bytes].reshape(v[ids[n]].shape)


def test_a_variant_from_the_kit_passes_the_conformance_suite():
    assert "kit-example" in K.available_variants()
    report = K.check_variant("kit-example", device="cpu", quick=True)  # AssertionError names a mismatch
    assert report.num_cases >= 10


def test_a_broken_variant_is_caught():
    @K.register_variant("kit-broken")
    class Broken(LoopVariant):
        def scatter(self, caches, layout, block_ids, src, **kw):
            super().scatter(caches, layout, block_ids, torch.zeros_like(src), **kw)  # writes zeros

    import pytest

    with pytest.raises(AssertionError):
        K.check_variant("kit-broken", device="cpu", quick=True)
