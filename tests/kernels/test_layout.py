"""PagedLayout from shapes and strides, and infer_roles."""

import pytest
import torch

from tutti.kernels import PagedLayout, infer_roles
from tutti.kernels import conformance as C


def test_nhd_and_hnd_same_logical_shape_different_strides():
    nhd = torch.empty(10, 16, 4, 2 * 64, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # (B, H, N, 2D)
    hnd = torch.empty(10, 4, 16, 2 * 64, dtype=torch.bfloat16)
    roles = ("block", "head", "token", "dim")
    a, b = PagedLayout.from_tensor(nhd, roles), PagedLayout.from_tensor(hnd, roles)
    assert (a.num_blocks, a.block_size, a.num_heads, a.num_pieces, a.piece_bytes) == (10, 16, 4, 1, 256)
    assert (a.stride_token, a.stride_head, a.stride_block) == (4 * 256, 256, 16 * 4 * 256)
    assert (b.stride_token, b.stride_head, b.stride_block) == (256, 16 * 256, 16 * 4 * 256)
    assert a.content_bytes == b.content_bytes == 256 and a.token_bytes == 1024
    assert a.segment_bytes(16) == 16384 and a.segment_bytes(3) == 4096


def test_kv_apart_and_cross_layer():
    kv = torch.empty(2, 7, 16, 3, 8, dtype=torch.float32)
    lay = PagedLayout.from_tensor(kv, ("kv", "block", "token", "head", "dim"))
    assert (lay.num_pieces, lay.piece_bytes, lay.stride_piece) == (2, 32, 7 * 16 * 3 * 32)
    x = torch.empty(7, 5, 16, 3, 16, dtype=torch.float16)
    lay = PagedLayout.from_tensor(x, ("block", "layer", "token", "head", "dim"))
    assert (lay.num_layers, lay.stride_layer, lay.stride_block) == (5, 16 * 3 * 32, 5 * 16 * 3 * 32)


def test_mla_has_one_head_and_one_piece():
    x = torch.empty(9, 1, 16, 576, dtype=torch.bfloat16)
    lay = PagedLayout.from_tensor(x, ("block", "head", "token", "dim"))
    assert (lay.num_heads, lay.num_pieces, lay.content_bytes, lay.stride_head) == (1, 1, 1152, 0)
    assert PagedLayout.from_tensor(x[:, 0], ("block", "token", "dim")) == lay


def test_segment_is_4k_aligned():
    lay = PagedLayout.from_tensor(torch.empty(4, 16, 18, dtype=torch.int8), ("block", "token", "dim"))
    assert lay.segment_bytes(16) == 4096 and lay.segment_bytes(512) == 12288


@pytest.mark.parametrize("kind", C.KINDS)
def test_infer_roles_matches_every_layout(kind):
    case = C.make_case(kind, torch.float16, 16, num_blocks=9, num_heads=4, num_layers=3)
    mla = kind.startswith("mla")
    layers = 3 if kind.startswith("cross") else None
    roles = infer_roles(
        case.caches[0].shape, num_blocks=9, block_size=16, num_heads=1 if mla else 4, head_size=8, num_layers=layers, mla=mla
    )
    assert roles == case.roles


def test_infer_roles_ambiguous_and_impossible():
    with pytest.raises(ValueError, match="ambiguous"):
        infer_roles((10, 16, 16, 128), num_blocks=10, block_size=16, num_heads=16, head_size=64)
    with pytest.raises(ValueError, match="ambiguous"):
        infer_roles((2, 10, 16, 2, 64), num_blocks=10, block_size=16, num_heads=2, head_size=64)
    with pytest.raises(ValueError, match="no dim assignment"):
        infer_roles((10, 16, 5, 128), num_blocks=10, block_size=16, num_heads=4, head_size=64)
    with pytest.raises(ValueError, match="mla"):
        infer_roles((10, 16, 576), num_blocks=10, block_size=16, num_heads=4, head_size=576, mla=True)


def test_from_tensor_rejects_bad_roles():
    t = torch.empty(4, 16, 2, 8)
    with pytest.raises(ValueError, match="one role per dim"):
        PagedLayout.from_tensor(t, ("block", "token", "dim"))
    with pytest.raises(ValueError, match="unknown role 'heads'"):
        PagedLayout.from_tensor(t, ("block", "token", "heads", "dim"))
    with pytest.raises(ValueError, match="more than once"):
        PagedLayout.from_tensor(t, ("block", "token", "token", "dim"))
    with pytest.raises(ValueError, match="missing role 'block'"):
        PagedLayout.from_tensor(t, ("layer", "token", "head", "dim"))
    with pytest.raises(ValueError, match="has stride 8"):
        PagedLayout.from_tensor(t.permute(0, 1, 3, 2), ("block", "token", "head", "dim"))
    with pytest.raises(ValueError, match="'kv' axis"):
        PagedLayout.from_tensor(torch.empty(4, 16, 3, 8), ("block", "token", "kv", "dim"))
    with pytest.raises(ValueError, match="num_pieces"):
        PagedLayout(4, 16, 1, 3, 8, 1, 1, 1, 1)
